"""TRL's extra arguments to reward functions (issue 58, item 1; common/reward_extras.py): trainer_state, log_metric,
log_extra and `async def`, with functions written as TRL's docs write them (tests/toy_rewards.py)."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import tyro

from common.rewards import compute_rewards, import_function
from common.runtime import UserError
from tests import toy_rewards
from tests.conftest import ROOT, run_script
from tests.test_sft import read_log

COMPLETIONS = ["a b", "a", "a b c", "w x y z"]  # 2, 1, 3, 4 words


def sources_of(*names):
    return [(name, import_function(f"tests.toy_rewards:{name}"), None) for name in names]


def extras_for(*names, **options):
    """What a script makes: a RewardExtras where a function asks for TRL's extras (max_steps 50, 8 completions a
    pass over the prompts), else None."""
    from accelerate import Accelerator

    from common.reward_extras import RewardExtras
    from common.rewards import asks_for_extras

    args = argparse.Namespace(reward_funcs=[f"tests.toy_rewards:{n}" for n in names], max_steps=50,
                              reward_timeout=options.pop("reward_timeout", 0))
    return RewardExtras(Accelerator(), args, 8, **options) if asks_for_extras(args.reward_funcs) else None


def score(extras, names, weights, step, taken, completions=COMPLETIONS):
    return compute_rewards(sources_of(*names), weights, prompts=["p"] * len(completions), completions=completions,
                           columns={"topic": ["t"] * len(completions)}, completion_ids=[[7] * len(c) for c in
                                                                                        completions],
                           call=extras and extras.caller(step, taken))


def test_functions_that_ask_for_no_extra_are_called_as_before():
    """No function names an extra or takes **kwargs, none is async: the feature is not entered."""
    assert extras_for("strict") is None
    total, per_source = score(None, ["strict"], [1.0], 0, 0)
    assert total.tolist() == [3.0, 1.0, 5.0, 7.0]


def test_trainer_state_log_metric_and_log_extra_reach_the_functions_that_ask_for_them():
    """trainer_state: the updates done, max_steps, and the epoch (completions taken / completions in a pass); each
    function gets only the extras its signature takes (strict would raise a TypeError); log_metric's values are
    averaged over the step's calls and cleared by the flush; log_extra's columns are the last batch's."""
    names = ["curriculum", "accuracy_logged", "strict", "by_kwargs"]
    extras = extras_for(*names)
    toy_rewards.SEEN.clear()
    total, per_source = score(extras, names, [1.0, 0.5, 0.0, 2.0], 12, 20)
    assert toy_rewards.SEEN == [(12, 50, 2.5)]
    assert per_source["curriculum"].tolist() == [12.0] * 4 and per_source["by_kwargs"].tolist() == [2.5] * 4
    assert per_source["accuracy_logged"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert total.tolist() == [17.5, 17.0, 17.0, 17.5]  # strict's weight is 0: logged, not summed
    assert extras.rows(3) == [{"words": 2}, {"words": 1}, {"words": 3}]
    score(extras, names, [1.0, 0.5, 0.0, 2.0], 13, 28, completions=["a b", "c d", "e f"])  # accuracy 1
    assert toy_rewards.SEEN[-1] == (13, 50, 3.5)
    assert extras.rows(4) == [{"words": 2}] * 3 + [{}]
    assert extras.flush() == {"accuracy": pytest.approx((0.5 + 1.0) / 2)}
    assert extras.flush() == {}
    score(extras, ["curriculum"], [1.0], 14, 36)  # a batch that logs no column shows none
    assert extras.rows(2) == [{}, {}]
    assert extras_for("accuracy_logged", table=False).rows(2) == [{}, {}]


def test_async_functions_are_awaited_together_and_one_that_raises_is_one_line():
    """Each of the two returns its value only if the other starts while it waits: awaited one after the other,
    both would give 0. The run's one loop serves every batch. A raising one: `reward function 'name' raised ...`."""
    names = ["first_of_two", "second_of_two", "on_its_loop"]
    extras = extras_for(*names)
    toy_rewards.LOOPS.clear()
    for step in range(2):
        toy_rewards.STARTED.clear()
        total, _ = score(extras, names, [1.0, 0.25, 1.0], step, 8 * step)
        assert total.tolist() == [1.5] * 4
    assert len(toy_rewards.LOOPS) == 2 and toy_rewards.LOOPS[0] is toy_rewards.LOOPS[1]
    with pytest.raises(UserError, match=r"^reward function 'async_broken' raised ValueError: the grader is down$"):
        score(extras_for("async_broken"), ["async_broken"], [1.0], 0, 0)


ASYNC_HANGING = """
import argparse
from accelerate import Accelerator
from common.reward_extras import RewardExtras
from common.rewards import compute_rewards, import_function
from common.runtime import exit_on_user_error
extras = RewardExtras(Accelerator(), argparse.Namespace(max_steps=5, reward_timeout=1), 8)
with exit_on_user_error():
    compute_rewards([(n, import_function(f"tests.toy_rewards:{n}"), None) for n in ("on_its_loop", "async_hangs")],
                    [1.0, 1.0], prompts=["p"], completions=["a"], columns={}, call=extras.caller(0, 0))
    print("hung and came back")
"""


def test_async_functions_that_hang_end_the_process_with_one_line_naming_them():
    """The async functions of a batch, awaited together, have --reward_timeout together: one that never returns
    ends the process (status 2) with one line naming those awaited."""
    proc = subprocess.run([sys.executable, "-c", ASYNC_HANGING], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1:] == ["error: the async reward functions 'on_its_loop, async_hangs' ran past "
                                             "--reward_timeout (1 s)"] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("script", ["grpo", "rloo", "online_dpo", "ppo", "grpo_dynamic"])
def test_the_script_passes_the_extras_logs_the_metric_and_shows_the_column(tmp_path, sft_model, capsys, script,
                                                                           request):
    """Each script with reward functions, 3 steps on 5 prompts, end to end: trainer_state's global_step 0, 1, 2 and
    its epoch, counted in whole batches (a pass over the 5 prompts drops what fills no batch); log_metric's
    `accuracy` logged each step, the mean of the batch's accuracy rewards; log_extra's `words` in the samples table,
    each the word count of the completion it is shown with (none in online_dpo's table of pairs, nor under
    --dynamic_sampling, which reorders the rows shown)."""
    import importlib
    import re

    name = script.removesuffix("_dynamic")
    flags = {"grpo": ["--reward_model_paths", "--num_generations", "2", "--max_completion_length", "6"],
             "rloo": ["--reward_model_paths", "--rloo_k", "2", "--max_completion_length", "6"],
             "online_dpo": ["--reward_model_paths", "--max_new_tokens", "6"],
             "ppo": ["--reward_model_path", request.getfixturevalue("rm_model") if name == "ppo" else "",
                     "--response_length", "6"]}[name] + (["--dynamic_sampling"] if script != name else [])
    module = importlib.import_module(f"algos.{name}")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"TITLE: post {i}\n\nTL;DR:"}) + "\n" for i in range(5)))
    toy_rewards.SEEN.clear()
    out = str(tmp_path / script)
    module.main(tyro.cli(module.Args, args=[
        "--model_name_or_path", sft_model, "--dataset_name", str(prompts), *flags, "--reward_funcs",
        "tests.toy_rewards:accuracy_logged", "tests.toy_rewards:curriculum", "--reward_weights",
        *(["0"] if name == "ppo" else []), "1", "0", "--max_steps", "3", "--eval_steps", "1",
        "--num_sample_generations", "3", "--per_device_train_batch_size", "4", "--output_dir", out]))
    log = read_log(out)
    # completions a prompt, and a drawn batch: a step's (--dynamic_sampling: 4, drawn until the groups fill one)
    per_prompt, per_batch = (1 if name == "ppo" else 2), (4 if script != name else log[0]["episode"])
    whole_batches = 5 * per_prompt // per_batch  # in a pass over the 5 prompts
    steps, maxima, epochs = zip(*toy_rewards.SEEN)  # one call a drawn batch
    assert epochs == tuple(d / whole_batches for d in range(len(epochs))) and set(maxima) == {3}
    assert steps == (0, 1, 2) if script == name else sorted(steps) == list(steps) and set(steps) == {0, 1, 2}
    if script == name:
        assert [row["accuracy"] for row in log] == pytest.approx([row["rewards/accuracy_logged/mean"] for row in log])
    assert len(log) == 3 and all(0 <= row["accuracy"] <= 1 for row in log)
    shown = re.findall(r"\[(\d+)\]\s+(?:completion|response): (.*)\n(?:\[\1\].*\n)*?\[\1\]\s+words: (\d+)",
                       capsys.readouterr().out)
    assert len(shown) == (0 if script in ("online_dpo", "grpo_dynamic") else 3 * 3)  # 3 rows at steps 1, 2, 3
    assert all(len(text.split()) == int(words) for _, text, words in shown)


@pytest.mark.multiproc
def test_two_processes_average_log_metric_over_the_names_either_logged(tmp_path):
    """log_metric on 2 gloo processes: each name's mean on each process, then over those that logged it; a name
    one process alone logged (TRL asks every process to log the same; here it is gathered, not a hang)."""
    from tests.test_multiprocess import TWO_PROCESSES

    run_script(os.path.join(ROOT, "tests", "reward_extras_probe.py"), str(tmp_path / "flushed"), timeout=300,
               launcher=TWO_PROCESSES, env={**os.environ, "ACCELERATE_USE_CPU": "true"})
    for rank in range(2):
        assert json.loads((tmp_path / f"flushed{rank}.json").read_text()) == {
            "both": pytest.approx((1.5 + 3.0) / 2), "only_rank_1": 5.0}
