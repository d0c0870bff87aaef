"""Reward functions the tests name on the command line (`--reward_funcs tests.toy_rewards:short`)."""

import os
import threading
import time


def short(prompts, completions, **columns):
    """Fewer words is better: a reward any policy can raise by stopping earlier."""
    return [-float(len(c.split())) for c in completions]


def character_codes(prompts, completions, **columns):
    """The online runs' reward: the sum of a completion's character codes, which practically never ties within a
    group. A group whose rewards tie has advantage 0, and at step 1 (the policy still its reference) its only gradient
    is the KL term's, 0 but for float noise, which Adam's first step turns into steps of the learning rate's size. With
    tests.toy_rewards:short (a group in four tied) and learning rate 1e-2, grpo's step 2 under FSDP2 was 6e-4 apart:
    the padded run's first step had moved the embeddings of that group's tokens, which the packed run and a
    1-process run left where they were."""
    return [float(sum(map(ord, c))) for c in completions]


def words(prompts, completions, completion_ids, completion):
    """`short` without **kwargs (it names tiny_tldr's other column), so not given TRL's extras: the base path."""
    return [-float(len(c.split())) for c in completions]


def zero(prompts, completions, **columns):
    return [0.0] * len(completions)


def prefer_shorter(prompts, completion_pairs):
    """A pairwise judge: index of the completion with fewer words (ties: the first)."""
    return [int(len(b.split()) < len(a.split())) for a, b in completion_pairs]


def broken(prompts, completions, **columns):
    return 1 / 0


def one_value(prompts, completions, **columns):
    """The wrong length for any batch of two or more (also a judge with the wrong length)."""
    return [0.0]


def not_numbers(prompts, completions, **columns):
    return ["good"] * len(completions)


def infinite(completions, **kwargs):
    return [float("inf")] * len(completions)


def short_or_none(prompts, completions, **columns):
    """`short`, but None ("does not apply") for completions of an odd number of words."""
    return [None if len(c.split()) % 2 else -float(len(c.split())) for c in completions]


def none(prompts, completions, **columns):
    """Applies to nothing: every completion unscored."""
    return [None] * len(completions)


CALLS = []  # what constant_for_odd_prompts returned, call by call (the dynamic-sampling test reads it)


def constant_for_odd_prompts(prompts, completions, **columns):
    """`short` for prompts of an even number of characters; 0 for the others, whose groups are then constant."""
    out = [0.0 if len(str(p)) % 2 else -float(len(c.split())) for p, c in zip(prompts, completions)]
    CALLS.append(out)
    return out


def missing_file_on_rank_1(prompts, completions, **columns):
    """`short`, but on rank 1 it reads a file that is missing there (as on one machine of several). With
    HANG_AFTER_FAILING set, rank 1 then cannot exit either: a non-daemon thread keeps its interpreter alive."""
    if os.environ.get("RANK") == "1":
        if os.environ.get("HANG_AFTER_FAILING"):
            threading.Thread(target=time.sleep, args=(3600,)).start()
        open("/nonexistent/reward_table.json")
    return short(prompts, completions)


# TRL's extra arguments (common/reward_extras.py), in functions written as TRL's docs write them

SEEN = []  # what the functions below were given, call by call


def curriculum(completions, trainer_state, **kwargs):
    """A curriculum reads the trainer's progress: here its reward is the step, and it notes the state."""
    SEEN.append((trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch))
    return [float(trainer_state.global_step)] * len(completions)


def by_kwargs(completions, **kwargs):
    """The way TRL's docs advise: everything in **kwargs; its reward is the epoch."""
    return [float(kwargs["trainer_state"].epoch)] * len(completions)


def accuracy_logged(completions, log_extra=None, log_metric=None, **kwargs):
    """TRL's example 6: a column of the completions table and a scalar of its own. "Accurate": an even number of
    words."""
    words = [len(str(c).split()) for c in completions]
    rewards = [float(n % 2 == 0) for n in words]
    if log_extra:
        log_extra("words", words)
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))
    return rewards


def strict(prompts, completions, completion_ids, topic):
    """Takes neither TRL's extras nor **kwargs (but the dataset's column `topic`): called without the extras (a
    TypeError if it were not)."""
    return [float(len(ids)) for ids in completion_ids]


STARTED = set()  # which of the two async functions below has started, in this batch


async def first_of_two(prompts, completions, **kwargs):
    """1 when second_of_two starts while this one is still waiting (the two awaited together), else 0 after 2 s."""
    return await _when_the_other_starts("first", "second", 1.0, len(completions))


async def second_of_two(prompts, completions, **kwargs):
    """2 when first_of_two starts while this one is still waiting, else 0 after 2 s."""
    return await _when_the_other_starts("second", "first", 2.0, len(completions))


async def _when_the_other_starts(me: str, other: str, value: float, n: int) -> list[float]:
    import asyncio

    STARTED.add(me)
    for _ in range(200):
        if other in STARTED:
            return [value] * n
        await asyncio.sleep(0.01)
    return [0.0] * n


LOOPS = []  # the event loop each call of on_its_loop ran on


async def on_its_loop(prompts, completions, **kwargs):
    """A function that keeps a client between calls needs them on one loop: notes the loop it runs on."""
    import asyncio

    LOOPS.append(asyncio.get_running_loop())
    return [0.0] * len(completions)


async def async_broken(prompts, completions, **kwargs):
    raise ValueError("the grader is down")


IDS = []  # the completion_ids record_ids was given, call by call


def record_ids(completion_ids, **kwargs):
    IDS.append(completion_ids)
    return [0.0] * len(completion_ids)


PROMPTS = []  # the prompts record_prompts was given, call by call


def record_prompts(prompts, completions, **kwargs):
    PROMPTS.append(prompts)
    return [0.0] * len(completions)


def hangs(prompts, completions, completion_ids):
    """A reward function that never returns (a grader that does not answer), and asks for no extra of TRL's."""
    time.sleep(3600)


def takes_half_a_second(prompts, completions, completion_ids):
    time.sleep(0.5)
    return [float(len(c)) for c in completions]


def judge_hangs(prompts, completion_pairs):
    time.sleep(3600)


async def async_hangs(prompts, completions, **kwargs):
    import asyncio

    await asyncio.sleep(3600)


def hangs_asking_for_extras(completions, trainer_state, **kwargs):
    time.sleep(3600)


def hangs_on_rank_1(prompts, completions, **columns):
    """Hangs on the process of rank 1 only (a grader one machine cannot reach); 0 elsewhere."""
    if os.environ.get("RANK") == "1":
        time.sleep(3600)
    return [0.0] * len(completions)


def times_itself_with_an_alarm(prompts, completions, completion_ids):
    """Gives up on its work after 50 ms by SIGALRM, as math_verify times its parsing (TRL's accuracy_reward): works
    in the main thread only (signal.signal raises ValueError in another)."""
    import signal

    def give_up(signum, frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, give_up)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    try:
        while True:
            time.sleep(0.01)
    except TimeoutError:
        return [0.5] * len(completions)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def lengths(prompts, completions, completion_ids):
    """Each completion's length in tokens; asks for no extra of TRL's (common/rewards.py calls it)."""
    return [float(len(ids)) for ids in completion_ids]
