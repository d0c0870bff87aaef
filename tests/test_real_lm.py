"""benchmarks/real_lm.py in quick mode on SmolLM2-135M-Instruct (python -m pytest -m realmodel): every
stage of the real-model study runs (2 steps each, 8 held-out questions, one seed) and the report,
its JSON and its figure are written with a row for every method."""

import json
import os
import time

import pytest

from benchmarks import real_lm
from tests.conftest import run_script
from tests.test_realmodel import check_run, one_thread, smollm2  # noqa: F401  (fixtures: one torch thread, the model)


def test_methods_bring_the_stages_they_wait_for():
    """--methods ppo gkd: each seed trains the reward model and SFT too (their inputs), evaluates only ppo and gkd,
    and every stage waits only for stages of the study (a missing one would never start)."""
    stages = real_lm.study_stages(real_lm.Args(methods=["ppo", "gkd"], seeds=[2, 1], model_name_or_path="m"))
    assert list(stages) == ["pairs", "evaluate_start", (2, "sft"), (2, "reward"), (2, "ppo"), (2, "gkd"),
                            (2, "evaluate", 0), (2, "evaluate", 1), (1, "sft"), (1, "reward"), (1, "ppo"),
                            (1, "gkd"), (1, "evaluate", 0), (1, "evaluate", 1)]
    assert all(need in stages for _, needs, _ in stages.values() for need in needs)
    assert stages[2, "ppo"][1] == [(2, "reward")] and stages[1, "gkd"][1] == [(1, "sft")]
    evaluated = [argv[argv.index("--stage_models") + 1:] for key, (argv, _, _) in stages.items()
                 if key[1:2] == ("evaluate",)]
    assert evaluated == [[f"output/real_lm/seed_{seed}/{name}"] for seed in (2, 1) for name in ("ppo", "gkd")]


@pytest.mark.realmodel
def test_quick_study_runs_every_stage_and_writes_the_report(smollm2, tmp_path):  # noqa: F811
    out, results = tmp_path / "study", tmp_path / "results"
    run_script("benchmarks/real_lm.py", "--quick", "--model_name_or_path", smollm2, "--output_dir", str(out),
               "--results_dir", str(results), timeout=1800)

    # every training stage logged its 2 steps and saved a model; every policy was evaluated
    for name in real_lm.STAGES:
        [log] = (out / "seed_1" / name / "logs").glob(f"{name}__1__*.jsonl")
        with open(log) as f:
            assert sum("lr" in json.loads(line) for line in f) == 2, name
        assert (out / "seed_1" / name / "config.json").is_file(), name
    assert all((out / "seed_1" / name / "real_lm_eval.json").is_file() for name in real_lm.POLICIES)
    argv = real_lm.stage_argv("gkd", 1, str(out / "seed_1"), real_lm.Args(quick=True))  # distils the seed's SFT model
    assert argv[argv.index("--teacher_model_name_or_path") + 1] == str(out / "seed_1" / "sft")
    for name in ("sft", "dpo", "kto"):  # finite losses; the saved model loads, keeps pad == eos and was trained
        check_run(str(out / "seed_1" / name), smollm2)

    with open(results / "real_lm.json") as f:
        result = json.load(f)
    assert set(result["methods"]) == set(real_lm.POLICIES)
    for name, runs in result["methods"].items():
        run = runs["1"]
        assert run["n"] == 8 and len(run["correct"]) == 8 and run["mean_tokens"] > 0, name
        assert 0 <= runs["ci95"][0] <= runs["accuracy"] <= runs["ci95"][1] <= 1, name
        assert runs["seeds_above_start"] == int(run["accuracy"] > result["start"]["ci95"][1]), name
    assert 0 <= result["reward_model"]["1"]["heldout_pair_accuracy"] <= 1
    assert result["pairs"]["train_pairs"] >= 2 and result["start"]["n"] == 8
    report = (results / "real_lm.md").read_text()
    assert "QUICK MODE" in report
    assert all(f"| {title} |" in report for title in real_lm.TITLES.values())
    assert os.path.getsize(results / "real_lm.png") > 0

    # started again with --resume, nothing is trained again and the report is the same; the time is both runs':
    # the first counted up to its last finished stage (what progress.jsonl holds of it: not its report's time, so
    # the sum can be under the first run's own total, as it was in CI on 2026-11-28), then the second's own
    with open(out / "progress.jsonl") as f:
        first = max(r["elapsed"] for r in map(json.loads, f) if "elapsed" in r)
    began = time.time()
    again = run_script("benchmarks/real_lm.py", "--quick", "--model_name_or_path", smollm2, "--output_dir", str(out),
                       "--results_dir", str(results), "--resume", timeout=600)
    stages = len(real_lm.study_stages(real_lm.Args(quick=True, seeds=[1], jobs=2)))
    assert f"{stages} of {stages} stages already finished" in again.stdout
    with open(results / "real_lm.json") as f:
        resumed = json.load(f)
    assert resumed["methods"] == result["methods"] and resumed["runs"] == 2
    assert first < resumed["total_seconds"] < first + (time.time() - began)

    # --methods ppo in the same folder: nothing is trained again (ppo's evaluation, grouped anew, runs again) and the
    # report holds the start model and PPO alone, with PPO's numbers as before
    again = run_script("benchmarks/real_lm.py", "--quick", "--model_name_or_path", smollm2, "--output_dir", str(out),
                       "--results_dir", str(results), "--resume", "--methods", "ppo", timeout=600)
    assert "4 of 5 stages already finished" in again.stdout  # pairs, start, reward, ppo; not ppo's evaluation
    with open(results / "real_lm.json") as f:
        only = json.load(f)
    assert list(only["methods"]) == ["ppo"]
    assert only["methods"]["ppo"]["1"]["correct"] == result["methods"]["ppo"]["1"]["correct"]
    report = (results / "real_lm.md").read_text()
    assert "| PPO (RM) |" in report and "| SFT" not in report and "Reward model (from the start model" in report
    assert 'steps {"reward": 2, "ppo": 2}' in report
