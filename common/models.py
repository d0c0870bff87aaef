"""Loading tokenizers, policies and reward models; LoRA, gradient checkpointing, frozen models."""

import contextlib
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from common.runtime import UserError, check_built


def _from_pretrained(cls, name_or_path: str, **kwargs):
    check_built(name_or_path)
    try:
        return cls.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError) as e:
        hint = "" if os.path.isdir(name_or_path) else (
            " (not a local directory; as a hub name it needs network access)")
        raise UserError(f"could not load '{name_or_path}'{hint}: {str(e).splitlines()[0]}") from None


def load_tokenizer(name_or_path: str):
    """The tokenizer as shipped, left-padding for generation. Without a pad token, EOS pads (as in
    TRL): every mask in these scripts comes from sequence lengths and from each completion's first
    EOS, never from `ids == pad_token_id`, so pad == eos is safe and the EOS stays in every loss."""
    tokenizer = _from_pretrained(AutoTokenizer, name_or_path)
    if tokenizer.eos_token_id is None:
        raise UserError(f"tokenizer of '{name_or_path}' has no eos_token; set one and save it")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def record_pad_id(model, tokenizer):
    """Record the tokenizer's pad id in the model's config and generation config."""
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def load_policy(name_or_path: str, tokenizer, dtype: str = "auto"):
    """A causal LM (the policy, or a frozen reference when put in eval mode by the caller)."""
    model = _from_pretrained(AutoModelForCausalLM, name_or_path, dtype=_dtype(dtype))
    return record_pad_id(model, tokenizer)


def load_reward_model(name_or_path: str, tokenizer, dtype: str = "auto", new_head: bool = False):
    """A sequence classifier with exactly one label: its logit is the scalar reward. A causal LM is
    refused unless new_head (reward training): it would get a freshly initialised, random score head."""
    config = _from_pretrained(AutoConfig, name_or_path)
    classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    if classifier and config.num_labels != 1:
        raise UserError(f"'{name_or_path}' is a sequence classifier with {config.num_labels} labels, but a reward "
                        "model has one output (its logit is the reward); use a one-label classifier such as "
                        "reward.py saves, or start reward.py from a causal LM (it adds a one-output head)")
    if not classifier and not new_head:
        raise UserError(f"'{name_or_path}' is not a reward model ({', '.join(config.architectures or ['no architecture'])}, "
                        "not a sequence classifier): its score head would be random; train one with reward.py, "
                        "or pass a reward function with --reward_funcs")
    model = _from_pretrained(AutoModelForSequenceClassification, name_or_path, num_labels=1, dtype=_dtype(dtype))
    return record_pad_id(model, tokenizer)


def hint_learning_rate(accelerator, model, learning_rate: float, default: float):
    """One line when a real model meets the tiny task's default learning rate: the defaults are tuned
    for its ~1M-parameter model, and real models want rates 10-1000x smaller (README, "Real models")."""
    if learning_rate == default and model.num_parameters() > 10_000_000:
        accelerator.print(f"hint: --learning_rate {default} is the tiny task's default; for a model of "
                          f"{model.num_parameters() / 1e6:.0f}M parameters see README \"Real models\" for learning rates")


def adapt(model, *, gradient_checkpointing: bool = False, lora: dict | None = None, no_dropout: bool = False,
          task_type: str = "CAUSAL_LM"):
    """Turn on gradient checkpointing, wrap the model with LoRA adapters (lora: LoraConfig's r, lora_alpha,
    lora_dropout, target_modules) and turn dropout off, as asked."""
    if gradient_checkpointing:  # non-reentrant: works with frozen inputs (LoRA) and DDP
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise UserError("--use_peft needs peft: pip install 'minimal-post-training[peft]'") from None
        targets = lora["target_modules"]
        model = get_peft_model(model, LoraConfig(task_type=task_type, **{
            **lora, "target_modules": targets[0] if targets == ["all-linear"] else targets}))
    if no_dropout:  # after LoRA, so lora_dropout goes too
        disable_dropout(model)
    return model


def disable_dropout(model):
    """Dropout rate 0 in every module, whatever its mode. New LoRA layers start in train mode (and the
    offline scripts turn it on for the whole model): with dropout, the old logprobs, the reference
    (LoRA: adapters off) and PPO's values would each come from another random network, and the
    ratio of the first update would not be 1."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # HF attention keeps a rate, not a module
            module.attention_dropout = 0.0
    return model


@contextlib.contextmanager
def reference(accelerator, model, ref_model):
    """The frozen reference model: its own copy, or with LoRA the policy itself with adapters off."""
    if ref_model is not None:
        yield ref_model
    else:
        with accelerator.unwrap_model(model).disable_adapter():
            yield model


def deepspeed_stage(accelerator) -> int | None:
    plugin = accelerator.state.deepspeed_plugin
    return None if plugin is None else plugin.zero_stage


_frozen_engines = []  # DeepSpeed engines of frozen models, kept alive for their parameter hooks


def prepare_frozen(accelerator, model):
    """A model that is only evaluated (reference, reward model): eval mode, no gradients, on the
    device. Without DeepSpeed it runs under the policy's autocast (--bf16), else a reference computing
    in fp32 would differ from an identical policy computing in bf16 (a KL > 0 at step 1). Under
    DeepSpeed it goes through an inference-only engine in the training dtype; under ZeRO-3 that
    engine shards it (it is loaded from disk, never deep-copied from a sharded module)."""
    model.eval().requires_grad_(False)
    stage = deepspeed_stage(accelerator)
    if stage is None:
        model.forward = accelerator.autocast()(model.forward)  # a no-op without mixed precision
        return model.to(accelerator.device)
    import deepspeed
    trained = accelerator.state.deepspeed_plugin.deepspeed_config
    config = {"train_micro_batch_size_per_gpu": trained["train_micro_batch_size_per_gpu"],
              "bf16": {"enabled": trained.get("bf16", {}).get("enabled", False) is True},
              "fp16": {"enabled": trained.get("fp16", {}).get("enabled", False) is True},
              "zero_optimization": {"stage": 3 if stage == 3 else 0}}
    engine = deepspeed.initialize(model=model, config=config)[0]
    _frozen_engines.append(engine)
    return engine.module.eval()


def _dtype(name: str):
    return name if name == "auto" else getattr(torch, name)
