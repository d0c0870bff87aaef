"""On a CUDA machine only (marker `gpu`, skipped elsewhere): every script trains a few steps on the
GPU, from the tiny SFT model, and logs finite losses; bf16 autocast through accelerate included;
DeepSpeed ZeRO-2 and ZeRO-3 (configs/) for an offline and two online scripts; every script under
FSDP2 (configs/fsdp2.yaml, bf16 mixed precision) with its checkpoint, samples and evaluation, and
LoRA under it for dpo, kto, grpo and ppo; LoRA with gradient checkpointing and bf16. Each launch
gets its own port, so that `-n` (pytest-xdist) can run them side by side on one GPU (.ci/gpu)."""

import math
import os
import socket

import pytest
from transformers import AutoModelForCausalLM

from tests.conftest import run_script
from tests.test_sft import read_log

SCRIPTS = {
    "reward.py": [],
    "dpo.py": ["--precompute_ref_logps"],
    "kto.py": [],
    "grpo.py": ["--reward_model_paths", "--reward_funcs", "benchmarks.tiny_tldr:gold_reward", "--num_iterations", "2"],
    "rloo.py": ["--reward_model_paths", "--reward_funcs", "benchmarks.tiny_tldr:gold_reward"],
    "online_dpo.py": ["--reward_model_paths", "--reward_funcs", "benchmarks.tiny_tldr:gold_reward"],
    "ppo.py": ["--reward_model_path", "<rm>", "--reward_funcs", "benchmarks.tiny_tldr:gold_reward"],
}
LOSS_KEY = {"rloo.py": "loss/policy_avg", "ppo.py": "loss/value_avg"}


def flags(script, rm_model):
    return [rm_model if a == "<rm>" else a for a in SCRIPTS[script]]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def one_gpu(config: str) -> list[str]:
    """`accelerate launch` with a shipped config on one process, on a port of its own."""
    return ["accelerate", "launch", "--config_file", f"configs/{config}.yaml", "--num_processes", "1",
            "--main_process_port", free_port()]


@pytest.mark.gpu
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_trains_on_cuda(tmp_path, sft_model, rm_model, script, mixed_precision):
    out = str(tmp_path / "out")
    launcher = ["accelerate", "launch", "--num_processes", "1", "--mixed_precision", mixed_precision]
    proc = run_script(f"algos/{script}", "--model_name_or_path", sft_model, "--max_steps", "3",
                      "--output_dir", out, *flags(script, rm_model), launcher=launcher)
    log = [r for r in read_log(out) if "lr" in r]
    assert len(log) == 3 and all(math.isfinite(r[LOSS_KEY.get(script, "loss")]) for r in log), proc.stdout[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["deepspeed_zero2", "deepspeed_zero3"])
@pytest.mark.parametrize("script", ["dpo.py", "grpo.py", "ppo.py"])
def test_script_trains_under_deepspeed(tmp_path, sft_model, rm_model, script, config):
    pytest.importorskip("deepspeed")
    out = str(tmp_path / "out")
    launcher = one_gpu(config)
    proc = run_script(f"algos/{script}", "--model_name_or_path", sft_model, "--max_steps", "3", "--logging_steps", "1",
                      "--output_dir", out, *flags(script, rm_model), launcher=launcher)
    log = [r for r in read_log(out) if "lr" in r]
    assert len(log) == 3 and all(math.isfinite(r[LOSS_KEY.get(script, "loss")]) for r in log), proc.stdout[-2000:]
    print(config, script, [round(r[LOSS_KEY.get(script, "loss")], 5) for r in log],
          proc.stdout.strip().splitlines()[-1])
    AutoModelForCausalLM.from_pretrained(out)  # the gathered checkpoint loads


@pytest.mark.gpu
@pytest.mark.parametrize("script", ["sft.py", *sorted(SCRIPTS)])
def test_script_trains_under_fsdp2_in_bf16(tmp_path, sft_model, rm_model, script):
    """configs/fsdp2.yaml as shipped (bf16 mixed precision, sharded checkpoints) on one GPU: a
    checkpoint after step 1, samples and an evaluation at step 2, and a final model that loads."""
    from transformers import AutoModelForSequenceClassification

    out = str(tmp_path / "out")
    launcher = one_gpu("fsdp2")
    proc = run_script(f"algos/{script}", "--model_name_or_path", sft_model, "--max_steps", "2", "--logging_steps", "1",
                      "--eval_steps", "2", "--save_steps", "1", "--output_dir", out,
                      *(flags(script, rm_model) if script in SCRIPTS else []), launcher=launcher)
    log = [r for r in read_log(out) if "lr" in r]
    assert len(log) == 2 and all(math.isfinite(r[LOSS_KEY.get(script, "loss")]) for r in log), proc.stdout[-2000:]
    assert "pytorch_model_fsdp_0" in os.listdir(os.path.join(out, "checkpoints", "step_1"))
    assert "--- samples at step 2 ---" in proc.stdout, proc.stdout[-2000:]
    cls = AutoModelForSequenceClassification if script == "reward.py" else AutoModelForCausalLM
    weights = cls.from_pretrained(out).state_dict()
    assert all(t.isfinite().all() for t in weights.values())
    print("fsdp2 bf16", script, [round(r[LOSS_KEY.get(script, "loss")], 5) for r in log])


@pytest.mark.gpu
@pytest.mark.parametrize("script", ["dpo.py", "kto.py", "grpo.py", "ppo.py"])
def test_lora_under_fsdp2_in_bf16(tmp_path, sft_model, rm_model, script):
    """LoRA inside FSDP2's shards (frozen base, trainable adapters; the reference is the base with the
    adapters off, which dpo and kto score first: that failed here before common.models.reference set
    FSDP2 up first): finite losses, and a saved adapter that loads on the base and was trained."""
    from peft import PeftModel

    out = str(tmp_path / "out")
    launcher = one_gpu("fsdp2")
    proc = run_script(f"algos/{script}", "--model_name_or_path", sft_model, "--max_steps", "2", "--logging_steps", "1",
                      "--use_peft", "--output_dir", out, *flags(script, rm_model), launcher=launcher)
    log = [r for r in read_log(out) if "lr" in r]
    assert len(log) == 2 and all(math.isfinite(r[LOSS_KEY.get(script, "loss")]) for r in log), proc.stdout[-2000:]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft_model), out)
    assert any("lora_B" in name and p.abs().sum() > 0 for name, p in model.named_parameters())  # trained
    print("fsdp2 lora bf16", script, [round(r[LOSS_KEY.get(script, "loss")], 5) for r in log])


@pytest.mark.gpu
@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_lora_with_gradient_checkpointing_and_bf16_on_cuda(tmp_path, sft_model, rm_model, script):
    out = str(tmp_path / "out")
    proc = run_script(f"algos/{script}", "--model_name_or_path", sft_model, "--max_steps", "3", "--use_peft",
                      "--gradient_checkpointing", "--bf16", "--output_dir", out, *flags(script, rm_model))
    log = [r for r in read_log(out) if "lr" in r]
    assert len(log) == 3 and all(math.isfinite(r[LOSS_KEY.get(script, "loss")]) for r in log), proc.stdout[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [["--vllm_enable_sleep_mode"], ["--use_peft", "--bf16"]], ids=["sleep", "lora_bf16"])
def test_grpo_samples_with_vllm_on_cuda(tmp_path, sft_model, extra):
    """The colocated engine on CUDA: sleeping between rollouts (it must wake with its weights, or it
    waits forever), and taking LoRA-adapted bf16 weights (base + delta, the base left as it was)."""
    pytest.importorskip("vllm")
    out = str(tmp_path / "out")
    proc = run_script("algos/grpo.py", "--model_name_or_path", sft_model, "--max_steps", "3", "--use_vllm", *extra,
                      "--output_dir", out, *flags("grpo.py", None))
    log = [r for r in read_log(out) if "lr" in r]
    assert len(log) == 3 and all(math.isfinite(r["loss"]) for r in log), proc.stdout[-2000:]
