"""common/rewards.py: reward models and functions, weights, None, columns, and clear errors."""

import importlib
import math
import subprocess
import sys
import time
import types

import pytest
import torch
import tyro

from common.rewards import compute_rewards, import_function, load_reward_sources, score_with_model
from common.runtime import UserError
from tests.conftest import ROOT


@pytest.fixture()
def reward_module(monkeypatch):
    """A module of reward functions importable as `toy_mod:<name>`."""
    module = types.ModuleType("toy_mod")
    module.length = lambda prompts, completions, **kw: [float(len(c)) for c in completions]
    module.sometimes = lambda prompts, completions, **kw: [None if c.startswith("x") else 10.0 for c in completions]
    module.columns = lambda prompts, completions, topic, **kw: [float(t == "cats") for t in topic]
    module.short = lambda prompts, completions, **kw: [1.0]
    module.broken = lambda prompts, completions, **kw: 1 / 0
    monkeypatch.setitem(sys.modules, "toy_mod", module)
    return module


def test_weights_none_and_columns(reward_module):
    sources, weights = load_reward_sources([], ["toy_mod:length", "toy_mod:sometimes", "toy_mod:columns"],
                                           [0.5, 1.0, 2.0], None)
    total, per_source = compute_rewards(sources, weights, prompts=["p", "p"], completions=["ab", "xyz"],
                                        columns={"topic": ["cats", "dogs"]})
    # "ab": 0.5*2 + 10 + 2*1 = 13; "xyz": 0.5*3 + (None: left out) + 2*0 = 1.5
    assert total.tolist() == [13.0, 1.5]
    assert math.isnan(per_source["sometimes"][1]) and per_source["length"].tolist() == [2.0, 3.0]


def test_trl_style_signatures_are_called_by_keyword(reward_module):
    seen = {}

    def trl_style(completions, **kwargs):  # TRL's documented form
        seen["kwargs"] = sorted(kwargs)
        return [float(len(c)) for c in completions]

    def keyword_only(*, completion_ids, prompts, **kwargs):
        return [float(len(ids)) + len(p) for ids, p in zip(completion_ids, prompts)]

    reward_module.trl_style, reward_module.keyword_only = trl_style, keyword_only
    sources, weights = load_reward_sources([], ["toy_mod:trl_style", "toy_mod:keyword_only", "toy_mod:columns"],
                                           [1.0, 10.0, 100.0], None)
    total, _ = compute_rewards(sources, weights, prompts=["p", "pq"], completions=["abc", "d"],
                               columns={"topic": ["cats", "dogs"]}, completion_ids=[[5, 6], [7]])
    # "abc": 3 + 10 * (2 ids + 1) + 100 * 1 = 133; "d": 1 + 10 * (1 + 2) + 0 = 31
    assert total.tolist() == [133.0, 31.0]
    assert seen["kwargs"] == ["completion_ids", "prompts", "topic"]


def test_a_completion_no_source_scores_is_nan_not_zero(reward_module):
    reward_module.nan_for_x = lambda completions, **kw: [math.nan if c.startswith("x") else 1.0 for c in completions]
    sources, weights = load_reward_sources([], ["toy_mod:sometimes", "toy_mod:nan_for_x"], [1.0, 2.0], None)
    total, per_source = compute_rewards(sources, weights, prompts=["p"] * 3, completions=["ab", "xy", "xz"], columns={})
    # "ab": 10 + 2; "xy" and "xz": None and NaN from every source -> unscorable
    assert total[0].item() == 12.0 and total[1:].isnan().all()
    assert per_source["nan_for_x"][1:].isnan().all()


def test_a_reward_of_weight_zero_is_logged_not_summed(reward_module):
    """An oracle passed with weight 0: its scores are reported, but neither its values nor its
    coverage enter the reward (a completion only it scores stays unscorable)."""
    sources, weights = load_reward_sources([], ["toy_mod:sometimes", "toy_mod:length"], [1.0, 0.0], None)
    total, per_source = compute_rewards(sources, weights, prompts=["p"] * 2, completions=["ab", "xyz"], columns={})
    assert total[0].item() == 10.0 and total[1].isnan()  # "xyz": only the weight-0 source scored it
    assert per_source["length"].tolist() == [2.0, 3.0]
    with pytest.raises(UserError, match="every reward has weight 0"):
        load_reward_sources([], ["toy_mod:length"], [0.0], None)


def test_inf_from_a_reward_function_is_named(reward_module):
    reward_module.huge = lambda completions, **kw: [1.0, -math.inf]
    sources, weights = load_reward_sources([], ["toy_mod:huge"], None, None)
    with pytest.raises(UserError, match=r"reward function 'huge' returned -inf for completion 1 \('b'\); rewards must "
                                        "be finite"):
        compute_rewards(sources, weights, prompts=["p", "p"], completions=["a", "b"], columns={})


@pytest.mark.parametrize("spec,weights,message", [
    ("toy_mod:short", None, "returned 1 values for 2 completions"),
    ("toy_mod:broken", None, "reward function 'broken' raised ZeroDivisionError"),
])
def test_bad_reward_functions_are_one_line_errors(reward_module, spec, weights, message):
    sources, weights = load_reward_sources([], [spec], weights, None)
    with pytest.raises(UserError, match=message):
        compute_rewards(sources, weights, prompts=["p", "p"], completions=["a", "b"], columns={})


def test_reward_source_errors(reward_module):
    with pytest.raises(UserError, match="could not import reward function 'toy_mod:missing'"):
        load_reward_sources([], ["toy_mod:missing"], None, None)
    with pytest.raises(UserError, match="no reward"):
        load_reward_sources([], [], None, None)
    with pytest.raises(UserError, match="2 reward_weights for 1 rewards"):
        load_reward_sources([], ["toy_mod:length"], [1.0, 2.0], None)


def test_reward_model_reads_prompt_completion_eos_left_truncated(tiny_model, tokenizer):
    from common.models import load_reward_model

    torch.manual_seed(0)
    model = load_reward_model(tiny_model, tokenizer, new_head=True).eval()
    prompt, completion = "TITLE: a b c\n\nTL;DR:", " my dad ate my cake"
    ids = tokenizer(prompt).input_ids + tokenizer(completion).input_ids + [tokenizer.eos_token_id]
    with torch.no_grad():
        direct = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        cut = model(input_ids=torch.tensor([ids[-5:]])).logits[0, 0].item()
    scores = score_with_model(model, tokenizer, [prompt, "x"], [completion, " y"])
    assert scores.tolist()[0] == pytest.approx(direct, abs=1e-5)
    tokenizer.model_max_length = 5  # the start of the prompt is dropped, the completion kept
    assert score_with_model(model, tokenizer, [prompt], [completion]).item() == pytest.approx(cut, abs=1e-5)


@pytest.mark.parametrize("script", ["grpo", "rloo", "online_dpo"])
def test_the_default_reward_model_only_when_nothing_else_scores(script):
    """As in TRL, reward functions alone are the whole reward: the default reward model (output/reward) is
    used only when neither --reward_model_paths nor --reward_funcs (nor online_dpo's --judge) is given."""
    args = importlib.import_module(f"algos.{script}").Args
    paths = lambda *argv: tyro.cli(args, args=list(argv)).reward_model_paths  # noqa: E731
    assert paths() == ["output/reward"]
    assert paths("--reward_funcs", "m:f") == []
    assert paths("--reward_model_paths", "rm", "--reward_funcs", "m:f") == ["rm"]
    assert paths("--reward_model_paths", "--reward_funcs", "m:f") == []  # the old way to say it still works
    assert paths("--reward_model_paths", "a", "b") == ["a", "b"]
    if script == "online_dpo":
        assert paths("--judge", "m:j") == []


HANGING = """
import time
from common.rewards import compute_rewards, import_function
from common.runtime import exit_on_user_error
rewards = lambda name, timeout: compute_rewards([(name, import_function(f"tests.toy_rewards:{name}"), None)], [1.0],
                                                prompts=["p", "p"], completions=["a", "bcd"], columns={},
                                                timeout=timeout)[0].tolist()
with exit_on_user_error():
    in_time = rewards("takes_half_a_second", 1.5)
    time.sleep(1.5)  # past the 1.5 s: its watchdog must be gone
    print("in time", in_time, "no limit", rewards("takes_half_a_second", 0), flush=True)
    rewards("hangs", 1)
    print("hung and came back")
"""


def test_a_reward_function_that_hangs_ends_the_process_with_one_line_naming_it():
    """--reward_timeout: a function that returns in time is not touched later, 0 is no limit, and one that hangs
    ends the process (status 2) with one line, about 1 s after it was called (TRL has no limit: the run waits)."""
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", HANGING], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout == "in time [1.0, 3.0] no limit [1.0, 3.0]\n"
    assert proc.stderr.splitlines()[-1:] == ["error: reward function 'hangs' ran past --reward_timeout (1 s)"]
    assert "Traceback" not in proc.stderr
    assert time.time() - start < 30  # ~7 s in the default suite; a mutant that hangs costs its row this much



def test_with_a_time_limit_a_function_still_runs_in_the_main_thread_where_signal_alarm_works():
    """The limit watches from a thread of its own: the function is called where TRL calls it, so one that times
    itself with SIGALRM (math_verify) still can."""
    sources = [("alarm", import_function("tests.toy_rewards:times_itself_with_an_alarm"), None)]
    total, _ = compute_rewards(sources, [1.0], prompts=["p", "p"], completions=["a", "b"], columns={}, timeout=5)
    assert total.tolist() == [0.5, 0.5]

@pytest.mark.parametrize("script", ["grpo", "rloo", "online_dpo", "ppo", "gkd"])
def test_the_timeouts_0_is_no_limit_and_below_0_is_refused_before_anything_loads(tmp_path, script):
    """--reward_timeout (the scripts with reward functions) and --tool_timeout (those with episodes)."""
    from common.runtime import check_flags, flags
    from tests.conftest import script_args

    args_class, out = importlib.import_module(f"algos.{script}").Args, str(tmp_path / "out")
    names = [n for n in ("reward_timeout", "tool_timeout") if n in flags(script_args(args_class, output_dir=out))]
    assert names == {"online_dpo": ["reward_timeout"], "ppo": ["reward_timeout"], "gkd": ["tool_timeout"]}.get(
        script, ["reward_timeout", "tool_timeout"])
    for name in names:
        for seconds in (0.0, 2.5):
            check_flags(script_args(args_class, output_dir=out, **{name: seconds}))
        with pytest.raises(UserError, match=rf"^--{name} must be >= 0 \(got -1.0\); 0 is no limit$"):
            check_flags(script_args(args_class, output_dir=out, **{name: -1.0}))


class Watchdog:
    """common/rewards.py's threading.Timer, recorded (none fires): each made, with its seconds and message."""
    made = []

    def __init__(self, seconds, function, args):
        self.seconds, self.message, self.started, self.cancelled = seconds, args[0], False, False
        Watchdog.made.append(self)

    def start(self):
        self.started = True

    def cancel(self):
        self.cancelled = True


@pytest.mark.parametrize("script,flags,named", [
    ("grpo", ["--reward_funcs", "tests.toy_rewards:lengths"], ["reward function 'lengths'"]),
    ("rloo", ["--reward_funcs", "tests.toy_rewards:lengths"], ["reward function 'lengths'"]),
    ("online_dpo", ["--reward_funcs", "tests.toy_rewards:lengths"], ["reward function 'lengths'"]),
    ("online_dpo", ["--judge", "tests.toy_rewards:prefer_shorter"], ["judge 'tests.toy_rewards:prefer_shorter'"]),
    ("ppo", ["--reward_funcs", "tests.toy_rewards:lengths", "--reward_weights", "0", "1"],
     ["reward function 'lengths'"]),
    ("grpo", ["--reward_funcs", "tests.toy_rewards:by_kwargs", "tests.toy_rewards:on_its_loop"],  # reward_extras.py
     ["reward function 'by_kwargs'", "reward function 'on_its_loop'", "the async reward functions 'on_its_loop'"]),
], ids=["grpo", "rloo", "online_dpo", "online_dpo_judge", "ppo", "grpo_extras"])
def test_every_script_gives_its_reward_functions_and_judge_reward_timeout(tmp_path, monkeypatch, sft_model,
                                                                          request, script, flags, named):
    """--reward_timeout 7 reaches the watchdog of every call of a user's scoring function, in each script (a function
    asking for no extra: common/rewards.py calls it) and in reward_extras.py (an async function: its call returns a
    coroutine, then all are awaited within the limit), and each watchdog is cancelled when its function returns."""
    import importlib

    from tests.test_bad_input import PROMPT, write_jsonl

    monkeypatch.setattr("common.rewards.threading", types.SimpleNamespace(Timer=Watchdog))
    Watchdog.made.clear()
    model = {"ppo": ["--reward_model_path", request.getfixturevalue("rm_model") if script == "ppo" else ""]}.get(
        script, ["--reward_model_paths"])
    sizes = {"grpo": ["--num_generations", "2", "--max_completion_length", "4"],
             "rloo": ["--rloo_k", "2", "--max_completion_length", "4"], "online_dpo": ["--max_new_tokens", "4"],
             "ppo": ["--response_length", "4"]}[script]
    module = importlib.import_module(f"algos.{script}")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": PROMPT}] * 4)
    module.main(tyro.cli(module.Args, args=[
        "--model_name_or_path", sft_model, "--dataset_name", prompts,
        *model, *flags, *sizes, "--reward_timeout", "7", "--max_steps", "1", "--per_device_train_batch_size", "4",
        "--output_dir", str(tmp_path / "out")]))
    assert sorted({w.message for w in Watchdog.made}) == sorted(f"{n} ran past --reward_timeout (7 s)" for n in named)
    assert all(w.seconds == 7 and w.started and w.cancelled for w in Watchdog.made)
