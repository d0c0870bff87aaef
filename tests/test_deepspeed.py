"""Every script under DeepSpeed ZeRO-3 (three under ZeRO-2 too) on 2 processes, launched as a user
launches it (`accelerate launch --config_file configs/deepspeed_zero3.yaml ...`), here on the CPU: without CUDA,
common/runtime.setup gives the processes a gloo group, so the 2 ranks really shard and communicate.
Each run has its evaluation, sample tables, a checkpoint after step 1 and the final
save on, and must log the losses of the 1-process run with the same global batch and save the same
weights; dpo, grpo and ppo also run under ZeRO-2, and under ZeRO-3 are resumed from that checkpoint
and must end where they ended.

Not in the default run (needs `pip install '.[deepspeed]'`, ~5 min on 2 cores; DeepSpeed compiles a
small op once): `python -m pytest -m deepspeed`; .ci/run runs them."""

import json
import os
import re
import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from benchmarks import tiny_tldr
from common.checkpoint import CheckpointArgs, Checkpointer
from common.runtime import UserError
from tests.conftest import ROOT, run_script
from tests.test_multiprocess import CASES, TOLERANCE, model_flags, one_process_run, small_data
from tests.test_sft import read_log

EVERYTHING_ON = ["--max_steps", "2", "--logging_steps", "1", "--eval_steps", "2", "--save_steps", "1"]


def launcher(stage: int, config: str | None = None, mixed_precision: str = "no"):
    """2 processes under the shipped ZeRO-<stage> yaml (or the yaml `config`), in fp32 (or `mixed_precision`)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            config or os.path.join(ROOT, "configs", f"deepspeed_zero{stage}.yaml"), "--num_processes", "2",
            "--dynamo_backend", "no"] + ([] if config else ["--mixed_precision", mixed_precision])


def sharded_launcher(tmp_path_factory, mixed_precision: str = "no", processes: int = 2):
    """ZeRO-3 as a model that only fits sharded meets it: the shipped yaml's settings, and DeepSpeed keeping no
    parameter whole beyond its module's forward (by default it keeps those under 1e5 elements, which is every one
    of the tiny model's, and up to 1e9 elements it will use again soon: nothing would be sharded here)."""
    folder = tmp_path_factory.mktemp("zero3_sharded")
    (folder / "ds.json").write_text(json.dumps({
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
                              "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
                              "stage3_gather_16bit_weights_on_model_save": True},
        **{k: "auto" for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
                               "train_batch_size")}, "bf16": {"enabled": mixed_precision == "bf16"}}))
    (folder / "zero3.yaml").write_text(
        "distributed_type: DEEPSPEED\nnum_machines: 1\nmachine_rank: 0\nrdzv_backend: static\nsame_network: true\n"
        "use_cpu: false\ndeepspeed_config:\n  deepspeed_multinode_launcher: "  # the precision: in the json
        f"standard\n  zero3_init_flag: true\n  deepspeed_config_file: {folder / 'ds.json'}\n")
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(folder / "zero3.yaml"),
            "--num_processes", str(processes), "--dynamo_backend", "no"]


def probed(out_dir, script: str) -> list:
    """tests/sharded_probe.py in place of algos/<script>.py: its records go to <out_dir>/probe."""
    return ["tests/sharded_probe.py", os.path.join(out_dir, "probe"), f"algos/{script}.py"]


def assert_sharded_all_the_way(out_dir, script: str, stdout: str, sharded: bool):
    """What tests/sharded_probe.py saw on each rank (issue 42): sample tables decoded sharded, in step on every
    rank, with at most one layer (and what lies outside the layers) whole at once, printed by rank 0 alone; ppo's
    value model left sharded while the policy samples; frozen models sharded (ZeRO-3 / FSDP2) and, after
    --precompute_ref_logps, freed."""
    ranks = [json.load(open(os.path.join(out_dir, "probe", f"rank{r}.json"))) for r in range(2)]
    for rank in ranks:
        tables = rank["generation"]
        if script in OFFLINE and sharded:
            assert tables and all(t["forwards"] > 0 for t in tables), tables  # every rank decodes, in step
            assert [t["forwards"] for t in tables] == [t["forwards"] for t in ranks[0]["generation"]]
            for t in tables:
                assert t["whole_peak"]["model"] <= t["largest_layer"] + t["outside_layers"]["model"] < \
                    t["elements"]["model"], t
        if script == "ppo" and sharded:  # the policy gathered to sample, the value model's layers not
            assert tables and all(t["whole_peak"]["policy"] == t["elements"]["policy"] and
                                  t["whole_peak"]["value_model"] <= t["outside_layers"]["value_model"]
                                  for t in tables), tables
        for frozen in rank["frozen"]:
            assert (frozen["bytes_here"] < 0.6 * frozen["bytes_whole"]) == sharded, frozen
            if script == "dpo":  # --precompute_ref_logps: no reference parameter alive at any logged step
                assert set(frozen["alive_at_steps"].values()) == {0}, frozen
    if script in OFFLINE:
        assert stdout.count("--- samples at step 2 ---") == 1  # rank 0 prints it
    print(f"\n{script} per-rank records:", [{k: v for k, v in r.items() if k != "generation"} for r in ranks],
          ranks[0]["generation"][-1:])


# the scripts whose sample tables run with --no-ds3-gather-for-generation here
OFFLINE = ("sft", "dpo", "kto", "reward")


def saved_weights(path, script):
    cls = AutoModelForSequenceClassification if script == "reward" else AutoModelForCausalLM
    return cls.from_pretrained(path).state_dict()


def assert_same_losses(a_log, b_log, keys, steps, tolerance=1e-5):
    """The training rows of `steps` log the same `keys` in both runs."""
    a, b = ([r for r in log if r["step"] in steps and keys[0] in r] for log in (a_log, b_log))
    assert [r["step"] for r in a] == [r["step"] for r in b] == steps
    compared = set()
    for x, y in zip(a, b):
        for key in set(keys) & x.keys() & y.keys():
            assert x[key] == pytest.approx(y[key], abs=tolerance), (key, x[key], y[key])
            compared.add(key)
    assert compared == set(keys)


def assert_matches_one_process(out_dir, one, script, keys, tolerance, label):
    """The run in `out_dir` logged the 1-process run's `keys` at steps 1-2 and saved its weights, whole and
    loadable the `from_pretrained` way; prints the largest differences. Returns (log, weights)."""
    log, reference_log = read_log(out_dir), read_log(one)
    assert_same_losses(log, reference_log, keys, [1, 2], tolerance)
    weights, reference = saved_weights(out_dir, script), saved_weights(one, script)
    assert weights.keys() == reference.keys()
    for name in weights:
        assert torch.allclose(weights[name], reference[name], atol=tolerance), name
    rows = [(x, y) for x, y in zip(log, reference_log) if x["step"] == y["step"]]
    print(f"\n{script} {label}:", {k: max(abs(x[k] - y[k]) for x, y in rows if k in x and k in y) for k in keys},
          "weights:", max((weights[k] - reference[k]).abs().max().item() for k in weights))
    return log, weights


# ZeRO-3 (parameters sharded too) for every script; ZeRO-2 shares the scripts' DeepSpeed code paths with it
# (prepare, the frozen models' engines, checkpoints), so it runs here for ppo alone, the script with the most
# engines (dpo under ZeRO-2 with bf16 and accumulation: tests/test_accumulation_bf16.py); resumed under ZeRO-3:
# an offline script, an online one and ppo's two models
ZERO2, RESUMED = ("ppo",), ("dpo", "grpo", "ppo")


@pytest.mark.deepspeed
@pytest.mark.parametrize("script, stage", [(s, 3) for s in CASES] + [(s, 2) for s in ZERO2],
                         ids=[f"{s}-3" for s in CASES] + [f"{s}-2" for s in ZERO2])
def test_deepspeed_two_processes_match_one_process(tmp_path, tmp_path_factory, sft_model, rm_model, script, stage):
    pytest.importorskip("deepspeed")
    flags, keys = CASES[script]
    one = one_process_run(script, sft_model, rm_model, tmp_path_factory)
    flags = flags + (["--no-ds3-gather-for-generation"] if script in OFFLINE else [])
    common = [*model_flags(script, sft_model, rm_model), *flags, *EVERYTHING_ON, "--gradient_accumulation_steps", "1"]
    run = sharded_launcher(tmp_path_factory) if stage == 3 else launcher(stage)
    out = run_script(*probed(str(tmp_path / "ds"), script), *common, "--output_dir", str(tmp_path / "ds"),
                     launcher=run).stdout
    log, ds = assert_matches_one_process(str(tmp_path / "ds"), one, script, keys, TOLERANCE.get(script, 1e-5),
                                         f"zero{stage}")
    assert "--- samples at step 2 ---" in out
    assert_sharded_all_the_way(str(tmp_path / "ds"), script, out, sharded=stage == 3)
    common = [f"algos/{script}.py", *common]
    assert sorted(os.listdir(tmp_path / "ds" / "checkpoints")) == ["step_1", "step_2"]
    if stage == 3 and script in RESUMED:  # resumed from step 1's checkpoint, it ends where the first run ended
        run_script(*common, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint",
                   str(tmp_path / "ds" / "checkpoints" / "step_1"), launcher=run)
        assert_same_losses(read_log(str(tmp_path / "resumed")), log, keys, [2])
        resumed = saved_weights(str(tmp_path / "resumed"), script)
        assert all(torch.allclose(resumed[k], ds[k], atol=1e-6) for k in ds)


@pytest.mark.deepspeed
def test_dpo_lora_with_precomputed_reference_under_zero3(tmp_path, sft_model):
    """With LoRA the reference is the policy with adapters off: its logprobs are precomputed after
    `prepare` (before it, ZeRO-3 had sharded the model with no engine to gather it)."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("peft")
    run_script("algos/dpo.py", "--model_name_or_path", sft_model, "--dataset_name",
               small_data(tiny_tldr.TINY_PREFERENCE_DATA), "--use_peft", "--precompute_ref_logps",
               "--max_steps", "2", "--per_device_train_batch_size", "4", "--dataset_test_split", "",
               "--logging_steps", "1", "--output_dir", str(tmp_path), launcher=launcher(3))
    assert [r["step"] for r in read_log(str(tmp_path)) if "loss" in r] == [1, 2]
    assert os.path.exists(tmp_path / "adapter_config.json")


@pytest.mark.deepspeed
def test_generation_under_zero3_gathers_once(tmp_path, tiny_model):
    """Inside `unwrapped_for_generation` the weights stay whole: decoding 8 tokens makes no collective
    call (DeepSpeed's hooks are off), the logits equal the sharded model's, and the hooks come back."""
    pytest.importorskip("deepspeed")
    run_script("tests/zero3_probe.py", tiny_model, str(tmp_path), launcher=launcher(3))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for rank in ranks:
        assert rank["collectives_while_generating"] == 0 and rank["tokens"] == 8 and rank["same_logits"], rank


@pytest.mark.deepspeed
def test_nonfinite_loss_on_one_rank_stops_every_rank_before_backward(tmp_path):
    """NaN on rank 1 only, at step 3: every rank skips backward (DeepSpeed would step inside it), and
    the checkpoint of step 3 holds the weights of step 2."""
    pytest.importorskip("deepspeed")
    proc = run_script("tests/nan_sft.py", "--max_steps", "4", "--per_device_train_batch_size", "2",
                      "--dataset_test_split", "", "--num_sample_generations", "0", "--save_steps", "2",
                      "--output_dir", str(tmp_path), launcher=launcher(2), check=False,
                      env={**os.environ, "NAN_CALL": "3", "NAN_RANK": "1"})
    assert proc.returncode != 0
    assert ("error: step 3: non-finite loss (nan); the update was dropped and the last good weights, untouched by it, "
            f"saved in {tmp_path}/checkpoints/step_3; lower --learning_rate and continue with --resume_from_checkpoint "
            "latest\n") in proc.stderr
    states = [torch.load(tmp_path / "checkpoints" / step / "pytorch_model" / "mp_rank_00_model_states.pt",
                         weights_only=False)["module"] for step in ("step_2", "step_3")]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


class _Engine:
    def __init__(self, applied):
        self.applied = applied

    def was_step_applied(self):
        return self.applied


def _checkpointer(tmp_path, applied, skip=False):
    accelerator = types.SimpleNamespace(
        is_main_process=True, is_local_main_process=True, device="cpu", num_processes=1, process_index=0,
        register_for_checkpointing=lambda *a: None,
        state=types.SimpleNamespace(deepspeed_plugin=object()), reduce=lambda t, op: t, wait_for_everyone=lambda: None,
        deepspeed_engine_wrapped=types.SimpleNamespace(engine=_Engine(applied)), print=print,
        save_state=lambda path: None)
    return Checkpointer(accelerator, None, CheckpointArgs(skip_nonfinite_steps=skip), output_dir=str(tmp_path),
                        run_name="r")


@pytest.mark.parametrize("applied", [False, True])
def test_nonfinite_gradient_under_deepspeed_says_what_happened(tmp_path, applied):
    """DeepSpeed steps inside backward: when its overflow check skipped the step, the weights saved are
    the last good ones; when it applied it (older versions in fp32), no checkpoint is written and the
    message says the update could not be dropped."""
    checkpointer = _checkpointer(tmp_path, applied)
    assert checkpointer.finite_loss(torch.tensor(1.0))  # the loss was finite: backward ran
    assert not checkpointer.finite(loss=1.0, grad_norm=float("inf"))
    why = "DeepSpeed applied this update inside backward, before it could be checked, so it could not be dropped" \
        if applied else r"the update was dropped and the last good weights, untouched by it, saved in"
    with pytest.raises(UserError, match=why):
        checkpointer.end_of_step(3, {})
    assert os.path.isdir(tmp_path / "checkpoints" / "step_3") != applied
    with pytest.raises(UserError, match="--skip_nonfinite_steps cannot be used with DeepSpeed"):
        _checkpointer(tmp_path, applied, skip=True)


@pytest.mark.deepspeed
def test_evaluation_of_an_odd_split_under_zero3(tmp_path):
    """5 eval rows on 2 ranks: shares of 3 and 2 rows would make rank 0 run one more sharded forward
    than rank 1 (a hang under ZeRO-3); both ranks evaluate 2 rows, one row is left out."""
    pytest.importorskip("deepspeed")
    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 8), ("validation", 5)):
        with open(data / f"{split}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"prompt": f"post {i}: the cat sat", "completion": f" cat {i}"}) + "\n")
    run_script("algos/sft.py", "--dataset_name", str(data), "--max_steps", "1", "--per_device_train_batch_size", "2",
               "--per_device_eval_batch_size", "2", "--num_sample_generations", "0",
               "--output_dir", str(tmp_path / "out"), launcher=launcher(3), timeout=180)
    assert "eval_loss" in read_log(str(tmp_path / "out"))[-1]


@pytest.mark.deepspeed
def test_gradient_accumulation_is_the_flags_alone(tmp_path):
    """A DeepSpeed yaml as `accelerate config` writes it says gradient_accumulation_steps 1, the flag 2: accelerate
    kept DeepSpeed's 1 (a warning in its log) and the optimizer stepped on every micro-batch; now each rank says so in
    one line. A DeepSpeed json without the key (accelerate read it as 1): the flag's 2 is used, so 2 processes x 4
    rows x 2 micro-batches log the losses of 1 process x 8 rows x 2 micro-batches."""
    pytest.importorskip("deepspeed")
    flags = ["algos/sft.py", "--max_steps", "3", "--logging_steps", "1", "--gradient_accumulation_steps", "2",
             "--num_sample_generations", "0", "--dataset_test_split", ""]
    yaml = ("distributed_type: DEEPSPEED\nnum_machines: 1\nnum_processes: 2\nmachine_rank: 0\nrdzv_backend: static\n"
            "same_network: true\nuse_cpu: false\ndeepspeed_config:\n  deepspeed_multinode_launcher: standard\n")
    (tmp_path / "says_1.yaml").write_text(yaml + "  zero_stage: 2\n  gradient_accumulation_steps: 1\n"
                                          "mixed_precision: 'no'\n")
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    (tmp_path / "json.yaml").write_text(yaml + f"  deepspeed_config_file: {tmp_path / 'ds.json'}\n")
    proc = run_script(*flags, "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "says_1"),
                      launcher=launcher(2, str(tmp_path / "says_1.yaml")), check=False, timeout=180)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode != 0 and errors, proc.stderr[-3000:]
    for line in errors:  # each rank that got there before the launcher stopped it
        assert re.fullmatch(r"\[rank [01]\] error: --gradient_accumulation_steps is 2 but the accelerate launch config "
                            r"\(ACCELERATE_GRADIENT_ACCUMULATION_STEPS, from its deepspeed_config or "
                            r"--gradient_accumulation_steps\) says 1; the script accumulates by its flag: make the two "
                            r"equal", line), line
    assert not os.path.exists(tmp_path / "says_1" / "logs")
    run_script(*flags, "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "json"),
               launcher=launcher(2, str(tmp_path / "json.yaml")), timeout=300)
    run_script(*flags, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "one"))
    losses = [[r["loss"] for r in read_log(str(tmp_path / run)) if "loss" in r] for run in ("json", "one")]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], abs=1e-5), losses
