"""--use_peft (LoRA), --gradient_checkpointing, --bf16 and --torch_dtype on CPU."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from tests.conftest import run_script
from tests.test_sft import read_log

LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.0"]


def test_lora_dpo_reference_is_the_base_model_and_adapters_load_with_peft(tmp_path, sft_model):
    peft = pytest.importorskip("peft")  # in the dev extra; only these tests need it
    out = str(tmp_path / "dpo")
    run_script("algos/dpo.py", "--model_name_or_path", sft_model, *LORA, "--max_steps", "3", "--learning_rate", "1e-2",
               "--per_device_train_batch_size", "4", "--dataset_test_split", "",
               "--logging_steps", "1", "--output_dir", out)
    log = read_log(out)
    # LoRA's B starts at zero, so at step 1 the policy equals the reference (adapters off): loss = log 2
    assert log[0]["loss"] == pytest.approx(0.693147, abs=1e-5) and log[-1]["loss"] != log[0]["loss"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    base = AutoModelForCausalLM.from_pretrained(sft_model)
    tuned = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft_model), out)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert not torch.allclose(base(ids).logits, tuned(ids).logits)  # the adapters were trained and saved
    with tuned.disable_adapter():
        assert torch.allclose(base(ids).logits, tuned(ids).logits, atol=1e-6)


@pytest.mark.parametrize("script", ["reward", "grpo", "ppo"])
def test_lora_runs_and_saves_adapters(tmp_path, sft_model, rm_model, script):
    peft = pytest.importorskip("peft")
    out = str(tmp_path / script)
    flags = {"reward": ["--per_device_train_batch_size", "4", "--dataset_test_split", ""],
             "grpo": ["--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "8",
                      "--reward_model_paths", "--reward_funcs", "tests.toy_rewards:short"],
             "ppo": ["--per_device_train_batch_size", "4", "--response_length", "8",
                     "--reward_model_path", rm_model]}[script]
    run_script(f"algos/{script}.py", "--model_name_or_path", sft_model, *LORA, "--max_steps", "2", *flags,
               "--output_dir", out)
    assert "adapter_config.json" in os.listdir(out)
    cls = AutoModelForSequenceClassification if script == "reward" else AutoModelForCausalLM
    base = cls.from_pretrained(sft_model, **({"num_labels": 1} if script == "reward" else {}))
    peft.PeftModel.from_pretrained(base, out)
    if script == "ppo":  # the reference is the policy with adapters off: no KL at the first rollout
        assert read_log(out)[0]["objective/kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.long  # 17 s or more: in .ci/run's lane 1, out of the default suite
def test_gradient_checkpointing_leaves_the_loss_unchanged_and_bf16_runs(tmp_path, sft_model):
    losses = {}
    for name, flags in {"plain": [], "checkpointing": ["--gradient_checkpointing", "--torch_dtype", "float32"],
                        "bf16": ["--bf16"]}.items():
        out = str(tmp_path / name)
        run_script("algos/sft.py", "--model_name_or_path", sft_model, "--max_steps", "3",
                   "--per_device_train_batch_size", "4", "--eval_steps", "100", "--num_sample_generations", "0",
                   "--logging_steps", "1", *flags, "--output_dir", out)
        losses[name] = [r["loss"] for r in read_log(out) if "loss" in r]
    assert losses["checkpointing"] == pytest.approx(losses["plain"], abs=1e-6)
    assert losses["bf16"] != losses["plain"] and losses["bf16"] == pytest.approx(losses["plain"], rel=0.05)
