"""benchmarks/vs_trl.py: the step clock, the table, and that both sides get the same numbers; a two-step
run of one pair where TRL is installed."""

import json
import math
import os

from types import SimpleNamespace

import pytest
import torch
import tyro

from benchmarks import vs_trl
from common.runtime import flags


def write_clock(path, times, repeat=()):
    with open(path, "w") as f:
        for step, t in enumerate(times, 1):
            f.write(json.dumps({"step": step, "time": t}) + "\n")
            if step in repeat:  # a second record of the same step (an evaluation) keeps the first time
                f.write(json.dumps({"step": step, "time": t + 100}) + "\n")


def test_median_leaves_out_the_first_step(tmp_path):
    # step 1 (warm-up) takes 10 s; steps 2..5 take 1, 3, 2, 50 s: the median of those is 2.5
    write_clock(tmp_path / "log.jsonl", [10, 11, 14, 16, 66], repeat=(3,))
    times = vs_trl.step_times(tmp_path / "log.jsonl")
    assert times == [10, 11, 14, 16, 66]
    assert vs_trl.seconds_per_update(times) == 2.5


def test_rollouts_of_several_updates_count_alike_on_both_sides():
    # rloo with 2 updates per rollout: ours logs once per rollout, TRL once per update
    ours = [5.0, 9.0, 13.0, 17.0]  # rollouts of 4 s
    trl = [3.0, 5.0, 8.0, 9.0, 12.0, 13.0, 16.0, 17.0]  # the same rollouts, each as a 3 s and a 1 s update
    assert vs_trl.seconds_per_update(ours, 2, 1) == vs_trl.seconds_per_update(trl, 2, 2) == 2.0
    with pytest.raises(ValueError):
        vs_trl.seconds_per_update([5.0], 1, 1)


def test_table():
    row = {"trl_trainer": "trl.SFTTrainer", "ours": {"seconds_per_update": 0.1, "peak_rss_mib": 600.4},
           "trl": {"seconds_per_update": 0.25, "peak_rss_mib": 1234.0}, "ratio": 2.5}
    text = vs_trl.table({"sft": row})
    assert text.splitlines()[1].split() == ["sft", "trl.SFTTrainer", "0.100", "0.250", "2.50x", "600", "1,234"]
    md = vs_trl.table({"sft": row}, markdown=True).splitlines()
    assert md[0].startswith("| script |") and md[2] == "| sft | trl.SFTTrainer | 0.100 | 0.250 | 2.50x | 600 | 1,234 |"


@pytest.mark.parametrize("model,script", [(m, s) for m, scripts in vs_trl.MODELS.items() for s in scripts
                                                 if s in vs_trl.SHARED])
def test_both_sides_get_the_same_numbers(model, script):
    """Our flags parse back to the settings; TRL's config holds the same values under its names, the same
    warm-up steps as our script computes, and as many optimizer steps."""
    import importlib

    module = importlib.import_module(f"algos.{script}")
    settings, steps = vs_trl.settings_for(script, model), 5
    ours = SimpleNamespace(**flags(tyro.cli(module.Args, args=vs_trl.our_argv(script, settings, steps, "m", "d.jsonl",
                                                                                "out"))))  # groups' flags too
    trl = vs_trl.trl_config(settings, script, steps)
    updates = vs_trl.updates_per_step(script, settings)
    assert trl["max_steps"] == steps * updates
    for name, value in settings.items():
        assert getattr(ours, name) == value, name
        if name in vs_trl.NOT_IN_TRL.get(script, ()):
            continue
        theirs = trl[vs_trl.TRL_NAMES.get(name, name)]
        if name == "warmup_ratio":  # our scripts: ceil(warmup_ratio x their optimizer steps)
            assert theirs == math.ceil(ours.warmup_ratio * steps * updates)
        elif name == "num_mini_batches":
            assert theirs == ours.gradient_accumulation_steps * ours.num_mini_batches
        elif name == "min_p":
            assert theirs is None and ours.min_p == 0.0  # both off
        elif name == "loss_type" and script == "dpo":
            assert theirs == [ours.loss_type]
        else:
            assert theirs == value, name
    assert ours.max_steps == steps and ours.seed == trl["seed"]
    if script in vs_trl.ONLINE:
        assert ours.reward_funcs == ["benchmarks.vs_trl:gold_reward"] and ours.reward_model_paths == []


def test_adamw_is_torch_default():
    defaults = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    assert defaults["betas"] == (vs_trl.ADAMW["adam_beta1"], vs_trl.ADAMW["adam_beta2"])
    assert defaults["eps"] == vs_trl.ADAMW["adam_epsilon"] and not defaults["fused"]


def test_reward_reads_plain_and_conversational_rows():
    prompt = ("SUBREDDIT: r/jobs\n\nTITLE: boss\n\nPOST: last week my boss read my texts. i feel angry about it. "
              "what should i do?\n\nTL;DR:")
    summary = " my boss read my texts, i am angry."
    chat = [{"role": "user", "content": "Summarize in one sentence: " + vs_trl.post_body(prompt)}]
    plain, = vs_trl.gold_reward([prompt], [summary])
    conversational, = vs_trl.gold_reward([chat], [[{"role": "assistant", "content": summary}]])
    assert plain == conversational == 3.0


def test_two_steps_of_sft_against_trl(tmp_path):
    pytest.importorskip("trl")
    assert "PPOTrainer" in vs_trl.trl_missing("ppo")  # gone by TRL 1.16: skipped with this reason
    assert all(vs_trl.trl_missing(s) is None for s in vs_trl.SHARED)
    section = vs_trl.main(vs_trl.Args(scripts=["sft"], runs=1, steps=2, work_dir=str(tmp_path), results_dir=""))
    result = section["results"]["sft"]
    for side in ("ours", "trl"):
        run, = result["runs"][side]
        assert len(run["clock"]) == 2 and run["seconds_per_update"] > 0 and run["peak_rss_mib"] > 100
    facts = result["runs"]["trl"][0]["facts"]
    assert facts["dtype"] == "torch.float32" and not facts["activation_checkpointing"] and facts["torch_threads"] == 2
    assert facts["optimizer"] == "AdamW"
    for group in facts["optimizer_groups"]:  # the settings took effect in TRL's optimizer
        assert group["betas"] == [0.9, 0.999] and group["eps"] == 1e-8 and not group["fused"]
        assert group["weight_decay"] == result["settings"]["weight_decay"]
    assert result["ratio"] > 0 and vs_trl.table(section["results"]).startswith("script")


def test_a_reused_work_dir_measures_the_new_runs(tmp_path, monkeypatch):
    """A second invocation in the same --work_dir must time its own runs: our JSONL log appends and
    the clock keeps a step's first line, so the old run's outputs have to go first."""
    calls = iter(range(100))

    def fake_spawn(spec, spec_path, timeout):  # call n writes steps 1..3 at n + 1 seconds per step
        n = next(calls)
        if spec["side"] == "ours":
            out = spec["argv"][spec["argv"].index("--output_dir") + 1]
            os.makedirs(os.path.join(out, "logs"), exist_ok=True)
            path = os.path.join(out, "logs", "vs_trl.jsonl")
        else:
            path = spec["clock"]
        with open(path, "a") as f:
            for step in (1, 2, 3):
                f.write(json.dumps({"step": step, "time": step * (n + 1)}) + "\n")
        return 500.0

    monkeypatch.setattr(vs_trl, "spawn", fake_spawn)
    monkeypatch.setattr(vs_trl, "longest_in_tokens", lambda *a: {})
    args = vs_trl.Args(scripts=["sft"], runs=1, steps=3)
    first = vs_trl.compare("sft", args, str(tmp_path), "model", "data")
    second = vs_trl.compare("sft", args, str(tmp_path), "model", "data")
    assert (first["ours"]["seconds_per_update"], first["trl"]["seconds_per_update"]) == (1, 2)
    assert (second["ours"]["seconds_per_update"], second["trl"]["seconds_per_update"]) == (3, 4)
