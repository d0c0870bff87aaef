"""benchmarks/same_runs.py --compare (issue 56's check that a refactor changes no run): on small hand-made files,
"same" and exit 0, or the first difference (key and step, or the tensor) and exit 1. The runs themselves take
minutes (`python benchmarks/same_runs.py --out A.json`) and are not in any suite."""

import copy
import json
import math

from benchmarks import same_runs


def runs() -> dict:
    log = [{"step": s, "loss": 1.0 / s, "lr": 3e-5 * (4 - s), "kl": math.nan if s == 2 else 0.1 * s}
           for s in (1, 2, 3)]
    return {"project": "/p", "steps": 3, "runs": {
        "sft": {"log": log, "tensors": {"embed.weight": "aa" * 32, "head.weight": "bb" * 32}},
        "grpo": {"log": copy.deepcopy(log[:2]), "tensors": {"embed.weight": "cc" * 32}}}}


def compare(tmp_path, capsys, a: dict, b: dict) -> tuple[int, dict]:
    for name, data in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(data))
    code = same_runs.main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    lines = capsys.readouterr().out.splitlines()
    return code, {line.split(":")[0].strip(): line.split(":", 1)[1].strip() for line in lines if ":" in line}


def test_the_same_runs_are_same_and_nan_equals_nan(tmp_path, capsys):
    code, lines = compare(tmp_path, capsys, runs(), runs())
    assert code == 0 and lines == {"sft": "same", "grpo": "same"}


def test_a_value_changed_at_step_3_is_named_with_both_values(tmp_path, capsys):
    b = runs()
    b["runs"]["sft"]["log"][2]["lr"] = 1e-5  # was 3e-5 * 1, an ulp is enough
    b["runs"]["grpo"]["log"][1]["kl"] = 0.25  # was nan
    code, lines = compare(tmp_path, capsys, runs(), b)
    assert code == 1 and lines == {"sft": "lr at step 3: 3e-05 != 1e-05", "grpo": "kl at step 2: nan != 0.25"}


def test_a_changed_tensor_a_missing_key_step_or_run_and_a_failed_run_differ(tmp_path, capsys):
    a, b = runs(), runs()
    b["runs"]["sft"]["tensors"]["head.weight"] = "bc" * 32
    del b["runs"]["grpo"]["log"][1]["loss"]
    code, lines = compare(tmp_path, capsys, a, b)
    assert code == 1 and lines == {"sft": "tensor head.weight: bbbbbbbbbbbb != bcbcbcbcbcbc",
                                   "grpo": "loss at step 2: 0.5 != (not logged)"}
    b = runs()
    b["runs"]["grpo"]["log"].pop()
    b["runs"]["ppo"] = {"error": "exit 1: Traceback ...\nValueError: boom"}
    a["runs"]["ppo"] = b["runs"]["ppo"]
    b["runs"].pop("sft")
    code, lines = compare(tmp_path, capsys, a, b)
    assert code == 1 and lines["grpo"] == "2 records logged != 1" and lines["ppo"] == "failed: ValueError: boom"
    assert lines["sft"] == f"run only in {tmp_path / 'a.json'}"


def test_the_clocks_fields_are_left_out_and_every_configuration_is_listed():
    assert [k for k in ("time", "eps", "steps_per_second", "vllm/push_seconds", "async/trainer_wait_seconds", "loss",
                        "episode", "async/staleness") if same_runs.is_timing(k)] == [
        "time", "eps", "steps_per_second", "vllm/push_seconds", "async/trainer_wait_seconds"]
    runs = same_runs.configurations(3, "/w")
    assert list(runs) == ["sft", "reward", "dpo", "kto", "online_dpo", "grpo", "grpo_iterations2", "grpo_dynamic",
                          "rloo", "ppo", "gkd", "grpo_tools", "rloo_tools", "grpo_async"]
    for name, argv in runs.items():  # the project's files relative to it (a worktree runs its own), outputs apart
        assert argv[0].startswith(("algos/", "tests/")) and argv[-2:] == ["--output_dir", f"/w/out/{name}"]
        assert argv[argv.index("--max_steps") + 1] == "3" and argv[argv.index("--run_name") + 1] == name
