"""Reward functions for tests/test_realmodel.py, written as for TRL (`--reward_funcs tests.realmodel_rewards:...`)."""


def short_reply(completions, **kwargs):
    """Shorter is better (in characters, so that two samples rarely tie). With conversational prompts
    TRL hands each completion over as a list of messages, the assistant's reply last: anything else
    is an error here, so the test also checks that grpo.py keeps that contract."""
    rewards = []
    for c in completions:
        reply = c[-1] if isinstance(c, list) and c and isinstance(c[-1], dict) else {}
        if reply.get("role") != "assistant" or not isinstance(reply.get("content"), str):
            raise TypeError(f"expected a list of messages ending in the assistant's reply, got {str(c)[:80]!r}")
        rewards.append(-float(len(reply["content"])))
    return rewards
