"""common/episodes.py: multi-turn episodes with tools and environments, driven by a scripted stand-in
policy (fixed replies per turn) so that every token of an episode is known and worked out by hand here."""

import os

import pytest
import torch

from common.episodes import call_tool, load_tools, parse_tool_calls, run_episodes
from common.generation import Samples, pad
from common.runtime import UserError
from tests.conftest import ROOT


@pytest.fixture()
def chat_tokenizer(tokenizer):
    """The tiny tokenizer with configs/chatml_tools.jinja, its turns ended by the tokenizer's EOS (the token the
    policy stops at), as SmolLM2's <|im_end|> is its EOS."""
    template = open(os.path.join(ROOT, "configs", "chatml_tools.jinja")).read()
    tokenizer.chat_template = template.replace("<|im_end|>", tokenizer.eos_token)
    return tokenizer


def scripted(tokenizer, replies: list[list[str]]):
    """A stand-in policy: episode e's turn k (from its seed: e + k * 2**48) is replies[e][k] then EOS, cut at
    the turn's token budget; records every call."""
    calls = []

    def sample(prompts, seeds, max_new_tokens, **options):
        calls.append(dict(prompts=prompts, seeds=seeds, max_new_tokens=max_new_tokens))
        out = []
        for seed in seeds:
            turns = replies[seed % 2**48]
            text = turns[seed // 2**48] if seed // 2**48 < len(turns) else "(a turn no episode here needs)"
            ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            out.append(ids[:max_new_tokens])
        ids, mask = pad(out, tokenizer.pad_token_id)
        ids, mask = (torch.nn.functional.pad(t, (0, max_new_tokens - t.shape[1])) for t in (ids, mask))
        return Samples(*pad(prompts, tokenizer.pad_token_id, "left"), ids, mask,
                       torch.tensor([o[-1] == tokenizer.eos_token_id for o in out]))
    return sample, calls


class Processes:
    """A stand-in accelerator for run_episodes' one collective: whether any process still has an episode going
    (`others`: what the other processes answer, turn by turn; none: this process alone)."""
    device = "cpu"

    def __init__(self, others=()):
        self.others = iter(others)

    def reduce(self, going, reduction):
        assert reduction == "max"
        return torch.maximum(going, torch.tensor(float(next(self.others, False))))


CALL = '<tool_call>\n{{"name": "multiply", "arguments": {{"a": {}, "b": {}}}}}\n</tool_call>'
ROW = {"prompt": [{"role": "user", "content": "What is 12 * 3 * 2?"}], "answer": "72"}


def glue(result: str, eos: str) -> str:
    """By hand, from configs/chatml_tools.jinja: after the assistant's end of turn, a user turn holding the
    result, then the next assistant header."""
    return f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response>{eos}\n<|im_start|>assistant\n"


def test_a_three_turn_episode_token_by_token(chat_tokenizer):
    tok, eos = chat_tokenizer, chat_tokenizer.eos_token
    tools = load_tools(tok, [], "tests.toy_tools:Calculator", num_episodes=1)
    replies = [[CALL.format(12, 3), CALL.format(36, 2), "It is 72."]]
    sample, calls = scripted(tok, replies)
    episodes = run_episodes(sample, tok, [ROW], tools, seeds=[0], max_new_tokens=400, max_prompt_length=1000,
                            max_calls=None, prompt_ids=None, accelerator=Processes())
    s = episodes.samples
    n = int(s.completion_mask.sum())
    text = tok.decode(s.completion_ids[0, :n])
    # the whole episode: the model's three turns, each ended by EOS, and the two tool results between them
    assert text == (CALL.format(12, 3) + eos + glue("36", eos) + CALL.format(36, 2) + eos + glue("72", eos)
                    + "It is 72." + eos)
    learnt = tok.decode(s.completion_ids[0][s.model_mask[0].bool()])
    assert learnt == CALL.format(12, 3) + eos + CALL.format(36, 2) + eos + "It is 72." + eos
    assert s.model_mask[0, n:].sum() == 0 and s.completion_mask[0, n:].sum() == 0 and bool(s.finished[0])
    # the prompt: the tools' schemas in the system turn, reset's string after the question, the assistant header
    prompt = tok.decode(s.prompt_ids[0][s.prompt_mask[0].bool()])
    assert prompt.startswith("<|im_start|>system\n") and '"name": "multiply"' in prompt
    assert prompt.endswith("What is 12 * 3 * 2? (a calculator is available)" + eos + "\n<|im_start|>assistant\n")
    # each turn continues the episode so far, with its own seed
    assert [c["seeds"] for c in calls] == [[0], [2**48], [2 * 2**48]]
    assert calls[1]["prompts"][0] == s.prompt_ids[0][s.prompt_mask[0].bool()].tolist() + \
        s.completion_ids[0, :len(calls[1]["prompts"][0]) - int(s.prompt_mask[0].sum())].tolist()
    assert calls[2]["max_new_tokens"] == 400 - len(tok(text.split("It is 72.")[0], add_special_tokens=False).input_ids)
    # what reward functions get, as TRL passes it
    def function(a, b):
        return {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    assert episodes.completions == [[
        {"role": "assistant", "content": "", "tool_calls": [function(12, 3)]},
        {"role": "tool", "name": "multiply", "content": "36"},
        {"role": "assistant", "content": "", "tool_calls": [function(36, 2)]},
        {"role": "tool", "name": "multiply", "content": "72"},
        {"role": "assistant", "content": "It is 72."}]]
    assert episodes.turns.tolist() == [3] and episodes.calls.tolist() == [2] and episodes.failures.tolist() == [0]
    [(name, reward)] = tools.reward_functions()
    assert name == "Calculator" and reward(environments=tools.environments) == [2.0]


def test_failed_calls_are_answered_and_counted_and_episodes_end_as_they_should(chat_tokenizer):
    tok = chat_tokenizer
    tools = load_tools(tok, ["tests.toy_tools:multiply", "tests.toy_tools:broken"], None, num_episodes=5)
    replies = [['<tool_call>{"name": "multiply", "arguments": </tool_call>', "sorry"],  # does not parse
               ['<tool_call>{"name": "divide", "arguments": {"a": 1}}</tool_call>', "no"],  # unknown tool
               ['<tool_call>{"name": "multiply", "arguments": {"c": 1}}</tool_call>'
                '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>', "hm"],  # misfit, raises
               [CALL.format(1, 2), CALL.format(2, 2), "4"],  # cut by max_calls after its first call turn
               ["one two three four five six seven eight nine ten " * 100]]  # never stops: truncated
    sample, _ = scripted(tok, replies)
    rows = [ROW] * 5
    episodes = run_episodes(sample, tok, rows, tools, seeds=list(range(5)), max_new_tokens=600, max_prompt_length=1000,
                            max_calls=1, prompt_ids=None, accelerator=Processes())
    answers = [[m["content"] for m in c if m["role"] == "tool"] for c in episodes.completions]
    assert answers[0] == ["{'error': 'could not parse the tool call {\"name\": \"multiply\", \"arguments\": "
                          "(JSONDecodeError: Expecting value: line 1 column 34 (char 33))'}"]
    assert answers[1] == ["{'error': 'Tool divide not found.'}"]
    assert "unexpected keyword argument 'c'" in answers[2][0] and answers[2][1] == "{'error': 'the tool is broken'}"
    assert answers[3] == ["2"]  # the second call turn ends the episode, its call not run
    assert episodes.calls.tolist() == [1, 1, 2, 1, 0] and episodes.failures.tolist() == [1, 1, 2, 0, 0]
    assert episodes.turns.tolist() == [2, 2, 2, 2, 1]
    assert episodes.samples.finished.tolist() == [True, True, True, True, False]
    assert episodes.samples.completion_mask[4].sum() == 600 == episodes.samples.model_mask[4].sum()


def test_a_tool_result_that_would_pass_the_length_limit_is_not_appended(chat_tokenizer):
    tok, eos = chat_tokenizer, chat_tokenizer.eos_token
    tools = load_tools(tok, ["tests.toy_tools:multiply"], None, num_episodes=1)
    call = tok(CALL.format(12, 3) + eos, add_special_tokens=False).input_ids
    room = len(call) + len(tok(glue("36", eos), add_special_tokens=False).input_ids)
    sample, calls = scripted(tok, [[CALL.format(12, 3), "36"]])
    episodes = run_episodes(sample, tok, [ROW], tools, seeds=[0], max_new_tokens=room, max_prompt_length=1000,
                            max_calls=None, prompt_ids=None, accelerator=Processes())
    s = episodes.samples
    assert len(calls) == 1 and not s.finished[0]  # no room for a reply after the result: truncated, one turn
    assert s.completion_mask[0].sum() == len(call) and s.completion_ids[0, :len(call)].tolist() == call
    assert [m["role"] for m in episodes.completions[0]] == ["assistant"] and episodes.calls.tolist() == [1]


def test_every_rank_samples_as_many_turns_as_the_longest_episode(chat_tokenizer):
    """Sharded decoding (ZeRO-3, FSDP2) needs every process in each generate call: a process whose episodes
    ended samples one dropped token per turn while another's go on."""
    tok = chat_tokenizer
    tools = load_tools(tok, ["tests.toy_tools:multiply"], None, num_episodes=1)
    sample, calls = scripted(tok, [["done"]])
    others = Processes([True, True, True, True, False])  # another process: 4 turns, this one 1
    episodes = run_episodes(sample, tok, [ROW], tools, seeds=[0], max_new_tokens=50, max_prompt_length=1000,
                            max_calls=None, prompt_ids=None, accelerator=others)
    assert len(calls) == 4 and [c["max_new_tokens"] for c in calls] == [50, 1, 1, 1]
    s = episodes.samples
    assert tok.decode(s.completion_ids[0][s.model_mask[0].bool()]) == "done" + tok.eos_token


def test_parsing_hermes_and_llama3_calls():
    assert parse_tool_calls('ok <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "hermes") == \
        ("ok", [{"name": "f", "arguments": {"x": 1}}])
    assert parse_tool_calls('{"name": "f", "parameters": {"x": 1}}', "llama3") == ("", [{"name": "f",
                                                                                         "arguments": {"x": 1}}])
    assert parse_tool_calls("no call here", "llama3") == ("no call here", [])
    assert call_tool({"f": lambda x: x + 1}, {"name": "f", "arguments": {"x": 1}}) == (
        {"role": "tool", "name": "f", "content": "2"}, False)


def test_a_template_that_renders_no_tools_is_one_error(tokenizer):
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(UserError, match="renders no tools; pass --chat_template_path"):
        load_tools(tokenizer, ["tests.toy_tools:multiply"], None, num_episodes=1)
    tokenizer.chat_template = "[INST] {{ tools }} {% for m in messages %}{{ m.content }}{% endfor %} [/INST]"
    with pytest.raises(UserError, match=r"tool calls in the chat template's format \(Mistral\) cannot be parsed"):
        load_tools(tokenizer, ["tests.toy_tools:multiply"], None, num_episodes=1)


def test_grpo_first_step_trains_the_models_tokens_of_each_episode_only(tmp_path, tiny_model, monkeypatch):
    """grpo.py at its defaults with --environment_factory, the policy's turns scripted (0, 1 or 2 calls before
    its answer, so the environment's reward, its number of calls, differs within each group): the gradient of
    its first step against the loss written out here over each episode's own tokens, read by one plain forward
    of the whole episode; tool results and the template's text around them carry no loss, no KL term and no
    count in the normaliser. A KL or policy-gradient term over the tool tokens, or a shifted position, fails."""
    import statistics

    from algos import grpo
    from tests.first_step import (assert_gradient, gradient, gradients_before_clipping, grads_of, own_logprobs,
                                  perturbed_reference, policy_with, weights_of, write_splits)
    from common.models import load_tokenizer

    template = tmp_path / "template.jinja"
    template.write_text(open(os.path.join(ROOT, "configs", "chatml_tools.jinja")).read().replace(
        "<|im_end|>", "<|endoftext|>"))
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} * 3 * 2?"}]} for i in range(4)]
    data = write_splits(tmp_path / "data", rows)
    tokenizer = load_tokenizer(tiny_model, chat_template_path=str(template))
    eos = tokenizer.eos_token
    turns = {0: ["42"], 1: [CALL.format(2, 3), "6"], 2: [CALL.format(2, 3), CALL.format(6, 2), "12"]}
    args = grpo.Args(model_name_or_path=tiny_model, dataset_name=data, reward_model_paths=[],
                     environment_factory="tests.toy_tools:Calculator", chat_template_path=str(template),
                     per_device_train_batch_size=16, max_completion_length=300, output_dir=str(tmp_path / "grpo"))
    first_seed = args.seed * 10**9
    sample, calls = scripted(tokenizer, [turns[j % 3] for j in range(16)])

    def generate(model, tok, prompts, max_new_tokens, seeds, **options):
        return sample(prompts, [s - first_seed for s in seeds], max_new_tokens)  # episodes 0..15 by seed
    monkeypatch.setattr(grpo, "generate", generate)
    loaded = perturbed_reference(monkeypatch, grpo)
    (record,) = gradients_before_clipping(monkeypatch, grpo.main, args)
    policy, ref = policy_with(tiny_model, tokenizer, weights_of(record)), loaded[1]
    prompts = calls[0]["prompts"]  # what the policy saw first: the schemas, the question, reset's string
    assert all(tokenizer.decode(p).endswith("(a calculator is available)" + eos + "\n<|im_start|>assistant\n")
               for p in prompts)
    # by hand: each episode's tokens, the model's turns (learnt) and the results between them (not)
    results = {CALL.format(2, 3): "6", CALL.format(6, 2): "12"}
    rewards, episodes = [], []
    for j in range(16):
        pieces = []
        for text in turns[j % 3]:
            pieces.append((tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id], True))
            if text in results:
                pieces.append((tokenizer(glue(results[text], eos), add_special_tokens=False).input_ids, False))
        episodes.append(pieces)
        rewards.append(float(len(turns[j % 3]) - 1))
    advantages = []
    for g in range(0, 16, args.num_generations):
        group = rewards[g:g + args.num_generations]
        advantages += [(r - statistics.mean(group)) / (statistics.stdev(group) + 1e-4) for r in group]
    tokens = sum(len(ids) for pieces in episodes for ids, learnt in pieces if learnt)
    pg = kl = 0.0
    for p, pieces, a in zip(prompts, episodes, advantages):
        completion = [t for ids, _ in pieces for t in ids]
        learnt = torch.tensor([learn for ids, learn in pieces for _ in ids], dtype=torch.float)
        logps = own_logprobs(policy, p, completion)
        with torch.no_grad():
            ref_logps = own_logprobs(ref, p, completion)
        q = ref_logps - logps
        pg = pg - a * (logps * learnt).sum() / tokens
        kl = kl + args.beta * ((q.exp() - q - 1) * learnt).sum() / tokens
    assert_gradient(grads_of(record), {"policy gradient": gradient(pg, policy), "kl": gradient(kl, policy)})
