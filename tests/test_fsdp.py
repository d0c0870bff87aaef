"""Every script under FSDP2 on 2 processes, launched as a user launches it (`accelerate launch
--config_file configs/fsdp2.yaml ...`), here on the CPU with gloo (ACCELERATE_USE_CPU=true; common/runtime.setup
turns FSDP on there, which accelerate does for accelerators only). As in test_deepspeed.py, each run
has its evaluation, sample tables (generation with gathered weights), a checkpoint after step 1 and the
final save on, and must log the 1-process run's losses and save its weights; the online scripts are
also resumed from step 1 and must end where they ended; and a step whose `.metadata` files were replaced by
a pickle that runs a command is refused on resume, the command not run.

Not in the default run (~6 min on 2 cores): `python -m pytest -m fsdp`; .ci/run runs it together with
the DeepSpeed tests, so that both compare against the same 1-process runs. The last test (LoRA's
reference first under bf16 mixed precision, one process, no script launched) is in the default run."""

import os
import pickle
import sys
import types

import pytest
import torch

from tests.conftest import ROOT, run_script
from tests.test_common_checkpoint import crafted
from tests.test_deepspeed import (EVERYTHING_ON, OFFLINE, assert_matches_one_process, assert_same_losses,
                                  assert_sharded_all_the_way, probed, saved_weights)
from tests.test_multiprocess import CASES, TOLERANCE, TWO_PROCESSES, model_flags, one_process_run
from tests.test_sft import read_log

LAUNCHER = [sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", os.path.join(ROOT, "configs", "fsdp2.yaml"), "--num_processes", "2",
            "--mixed_precision", "no", "--dynamo_backend", "no"]
ON_CPU = {**os.environ, "ACCELERATE_USE_CPU": "true"}


@pytest.mark.fsdp
@pytest.mark.parametrize("script", list(CASES))
def test_fsdp2_two_processes_match_one_process(tmp_path, tmp_path_factory, sft_model, rm_model, script):
    flags, keys = CASES[script]
    one = one_process_run(script, sft_model, rm_model, tmp_path_factory)
    flags = flags + (["--no-ds3-gather-for-generation"] if script in OFFLINE else [])
    common = [*model_flags(script, sft_model, rm_model), *flags, *EVERYTHING_ON, "--gradient_accumulation_steps", "1"]
    out = run_script(*probed(str(tmp_path / "fsdp"), script), *common, "--output_dir", str(tmp_path / "fsdp"),
                     launcher=LAUNCHER, env=ON_CPU).stdout
    log, fsdp = assert_matches_one_process(str(tmp_path / "fsdp"), one, script, keys, TOLERANCE.get(script, 1e-5),
                                           "fsdp2")
    assert "--- samples at step 2 ---" in out
    assert_sharded_all_the_way(str(tmp_path / "fsdp"), script, out, sharded=True)
    common = [f"algos/{script}.py", *common]
    # sharded for real: accelerate writes an FSDP model's state as torch.distributed.checkpoint shards
    assert "pytorch_model_fsdp_0" in os.listdir(tmp_path / "fsdp" / "checkpoints" / "step_1")
    if script in ("grpo", "rloo", "ppo", "online_dpo"):  # resumed from step 1, it ends where the first run ended
        run_script(*common, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint",
                   str(tmp_path / "fsdp" / "checkpoints" / "step_1"), launcher=LAUNCHER, env=ON_CPU)
        assert_same_losses(read_log(str(tmp_path / "resumed")), log, keys, [2])
        resumed = saved_weights(str(tmp_path / "resumed"), script)
        assert all(torch.allclose(resumed[k], fsdp[k], atol=1e-6) for k in fsdp)


def test_lora_reference_first_keeps_fp32_gradients_under_bf16_mixed_precision(tiny_model):
    """With LoRA the reference is the policy with its adapters off, and peft freezes them meanwhile. If
    that is FSDP2's first forward (dpo and kto score the reference first), FSDP2 takes no gradient
    dtype from the frozen adapters, and under bf16 mixed precision backward fails (bf16 gradients for
    fp32 adapters; seen on an H100). common.models.reference sets FSDP2 up before. One process, gloo."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from common.models import reference
    from tests.test_gpu import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                               LoraConfig(r=4, target_modules=["query_key_value"]))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for layer in model.base_model.model.gpt_neox.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        ids = torch.arange(16).view(2, 8)
        with torch.no_grad(), reference(types.SimpleNamespace(unwrap_model=lambda m: m), model, None) as ref:
            ref(input_ids=ids)
        model(input_ids=ids).logits.float().mean().backward()
        grads = {name: p.grad.dtype for name, p in model.named_parameters() if p.grad is not None}
        assert grads and set(grads.values()) == {torch.float32} and all("lora_" in name for name in grads)
    finally:
        dist.destroy_process_group()


@pytest.mark.fsdp
@pytest.mark.parametrize("backend", ["fsdp2", "ddp"])
def test_tr_dpo_two_processes_match_one_process_and_resume(tmp_path, sft_model, backend):
    """TR-DPO mixes the policy into the reference each step: under FSDP2 the reference is sharded as the policy
    (common.models.prepare_frozen), so they mix shard by shard (a full reference met DTensor shards and crashed);
    2 processes log and save what 1 process does; the checkpoint holds the reference once over the ranks' files
    (FSDP2: each rank its shards; DDP: rank r every world-th tensor), and resuming it ends where the run ended."""
    flags = ["algos/dpo.py", "--model_name_or_path", sft_model, "--per_device_train_batch_size", "4", "--max_steps",
             "3", "--logging_steps", "1", "--dataset_test_split", "", "--sync_ref_model", "--ref_model_sync_steps", "1",
             "--ref_model_mixup_alpha", "0.5", "--learning_rate", "1e-3", "--warmup_ratio", "0", "--save_steps", "1",
             "--save_total_limit", "3"]
    two = LAUNCHER if backend == "fsdp2" else TWO_PROCESSES
    run_script(*flags, "--output_dir", str(tmp_path / "two"), launcher=two, env=ON_CPU)
    run_script(*flags, "--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "one"))
    log = read_log(str(tmp_path / "two"))
    assert_same_losses(log, read_log(str(tmp_path / "one")), ["loss", "rewards/margins"], [1, 2, 3])
    weights, reference = saved_weights(str(tmp_path / "two"), "dpo"), saved_weights(str(tmp_path / "one"), "dpo")
    # summed in other orders, the gradients differ in float noise, which Adam's normalised steps enlarge: 2e-5 here
    assert all(torch.allclose(weights[k], reference[k], atol=1e-4) for k in weights)
    step_1 = tmp_path / "two" / "checkpoints" / "step_1"
    held = [torch.load(step_1 / f"loop_state_{r}.pt", weights_only=True)["ref_model"] for r in range(2)]
    sizes = [sum(t.numel() for t in part.values()) for part in held]
    assert sum(sizes) == sum(t.numel() for t in reference.values()) and all(sizes), sizes  # once, split
    run_script(*flags, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", str(step_1),
               launcher=two, env=ON_CPU)
    assert_same_losses(read_log(str(tmp_path / "resumed")), log, ["loss"], [2, 3])
    resumed = saved_weights(str(tmp_path / "resumed"), "dpo")
    assert all(torch.equal(resumed[k], weights[k]) for k in weights)


@pytest.mark.fsdp
def test_fsdp2_checkpoint_whose_metadata_would_run_code_is_not_loaded(tmp_path, tiny_model):
    """accelerate loads an FSDP2 checkpoint with torch.distributed.checkpoint, whose reader unpickles its
    `.metadata` files in full: a step 1 whose two (model, optimizer) are replaced by a pickle running a shell
    command must stop both ranks with one line each, the command not run (before: run, then a traceback)."""
    flags = ["algos/sft.py", "--max_steps", "2", "--save_steps", "1", "--dataset_test_split", "",
             "--per_device_train_batch_size", "2"]
    run_script(*flags, "--max_steps", "1", "--output_dir", str(tmp_path / "out"), launcher=LAUNCHER, env=ON_CPU)
    step, marker = tmp_path / "out" / "checkpoints" / "step_1", tmp_path / "marker"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        with open(step / part / ".metadata", "wb") as f:
            pickle.dump(crafted(marker)["os.system"], f)
    proc = run_script(*flags, "--output_dir", str(tmp_path / "new"), "--resume_from_checkpoint", str(step),
                      launcher=LAUNCHER, env=ON_CPU, check=False, timeout=300)
    errors = sorted(line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line)
    assert proc.returncode != 0 and errors == [
        f"[rank {r}] error: '{step}' holds pickled code, not only data (optimizer_0/.metadata calls "
        f"{os.system.__module__}.system), as read by process 0; it was not loaded" for r in (0, 1)], proc.stderr[-3000:]
    assert not marker.exists() and not (tmp_path / "new" / "logs").exists()
