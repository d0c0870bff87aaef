"""Loading tokenizers, policies and reward models; LoRA, gradient checkpointing, frozen models."""

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Literal

import torch
import tyro
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from common.runtime import UserError, check_built


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # --use_peft, not --model.use-peft
@dataclass
class ModelArgs:
    """memory, precision and LoRA (common/models.py)"""
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype the weights are loaded in (auto: the checkpoint's)"""
    bf16: bool = False
    """bf16 mixed precision (as `accelerate launch --mixed_precision bf16`)"""
    gradient_checkpointing: bool = False
    """recompute activations during the backward pass instead of storing them (less memory, ~30% slower)"""
    ds3_gather_for_generation: bool = True
    """ZeRO-3 / FSDP2: gather the policy's weights to sample (off: sharded, slower, for models too large to gather)"""
    use_peft: bool = False
    """train LoRA adapters instead of all weights (needs peft); a reference is the base model with adapters off"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA scale numerator (the update is scaled by lora_alpha / lora_r)"""
    lora_dropout: float = 0.05
    """dropout on the LoRA input"""
    lora_target_modules: list[str] | None = None
    """modules that get adapters (default: peft's choice for the architecture; all-linear: every linear layer)"""

    def lora(self) -> dict | None:
        """LoraConfig's options with --use_peft, else None (adapt's `lora`)."""
        return dict(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                    target_modules=self.lora_target_modules) if self.use_peft else None


def _from_pretrained(cls, name_or_path: str, what: str, **kwargs):
    """`what`: the role it plays, named in errors with its path ("the policy", "reward model 1's tokenizer")."""
    check_built(name_or_path, what)
    try:
        return cls.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError) as e:
        hint = "" if os.path.isdir(name_or_path) else " (not a local directory; as a hub name it needs network access)"
        raise UserError(f"could not load {what} '{name_or_path}'{hint}: {str(e).splitlines()[0]}") from None


def load_tokenizer(name_or_path: str, role: str = "policy", chat_template_path: str | None = None):
    """The tokenizer as shipped, padding on the left; without a pad token EOS pads (as in TRL): every mask
    here comes from lengths and each completion's first EOS, never from `ids == pad_token_id`. `role`
    (policy, reference, reward model i) names it in errors, here and in common/data.py's.
    chat_template_path (TRL's option): a Jinja file, or a tokenizer whose chat template replaces the shipped one
    (e.g. configs/chatml_tools.jinja, ChatML that renders tools); saved with the model."""
    tokenizer = _from_pretrained(AutoTokenizer, name_or_path, f"the {role}'s tokenizer")
    if chat_template_path:
        tokenizer.chat_template = (open(chat_template_path).read() if os.path.isfile(chat_template_path) else
                                   _from_pretrained(AutoTokenizer, chat_template_path, "the template").chat_template)
    tokenizer.described = f"the {role}'s tokenizer '{name_or_path}'"
    if tokenizer.eos_token_id is None:
        raise UserError(f"{tokenizer.described} has no eos_token; set one and save it")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _load_model(cls, name_or_path: str, tokenizer, dtype: str, role: str, **kwargs):
    """The model in `dtype` (auto: the checkpoint's), the tokenizer's pad id in its (generation) config."""
    dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    model = _from_pretrained(cls, name_or_path, f"the {role}", dtype=dtype, **kwargs)
    for config in filter(None, (model.config, getattr(model, "generation_config", None))):  # a classifier has none
        config.pad_token_id = tokenizer.pad_token_id
    return model


def load_policy(name_or_path: str, tokenizer, dtype: str = "auto", role: str = "policy"):
    """A causal LM (the policy, or a frozen reference when put in eval mode by the caller)."""
    return _load_model(AutoModelForCausalLM, name_or_path, tokenizer, dtype, role)


def load_reward_model(name_or_path: str, tokenizer, dtype: str = "auto", new_head: bool = False,
                      role: str = "reward model"):
    """A one-label sequence classifier (its logit is the reward). A causal LM only with new_head (reward
    training): its score head would be random."""
    config = _from_pretrained(AutoConfig, name_or_path, f"the {role}")
    classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    if classifier and config.num_labels != 1:
        raise UserError(f"the {role} '{name_or_path}' is a sequence classifier with {config.num_labels} labels, but a "
                        "reward model has one output (its logit is the reward), as reward.py saves")
    if not classifier and not new_head:
        architectures = ", ".join(config.architectures or ["no architecture"])
        raise UserError(f"the {role} '{name_or_path}' is not a reward model ({architectures}, not a sequence "
                        "classifier): its score head would be random; train one with reward.py, or use --reward_funcs")
    return _load_model(AutoModelForSequenceClassification, name_or_path, tokenizer, dtype, role, num_labels=1)


def hint_learning_rate(accelerator, model, learning_rate: float, default: float):
    """One line when a real model meets the tiny task's default rate (real models want 10-1000x smaller)."""
    if learning_rate == default and model.num_parameters() > 10_000_000:
        accelerator.print(f"hint: --learning_rate {default} is the tiny task's default; for a model of "
                          f"{model.num_parameters() / 1e6:.0f}M parameters see README \"Real models\"")


def adapt(model, *, gradient_checkpointing: bool = False, lora: dict | None = None, no_dropout: bool = False,
          task_type: str = "CAUSAL_LM"):
    """Gradient checkpointing, LoRA adapters (lora: LoraConfig's r, lora_alpha, lora_dropout,
    target_modules) and no dropout, as asked."""
    if gradient_checkpointing:  # non-reentrant: works with frozen inputs (LoRA) and DDP
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise UserError("--use_peft needs peft: pip install 'minimal-post-training[peft]'") from None
        # peft takes the shorthand as a string only
        lora = {**lora, "target_modules": "all-linear"} if lora["target_modules"] == ["all-linear"] else lora
        model = get_peft_model(model, LoraConfig(task_type=task_type, **lora))
    if no_dropout:  # after LoRA, so lora_dropout goes too
        disable_dropout(model)
    return model


def disable_dropout(model):
    """Dropout rate 0 in every module, whatever its mode (new LoRA layers start in train mode): else the
    old logprobs, the reference and PPO's values would each come from another random network, and the
    first update's ratio would not be 1."""
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
        # FSDP2 sets itself up at its first forward and takes the gradients' dtype from the parameters that need
        # them then: not in a forward with the adapters off (peft freezes them), or under bf16 mixed precision
        # backward meets fp32 adapters with bf16 gradients (dpo, kto). Private API, as in generation.py.
        if isinstance(model, FSDPModule):
            model._get_fsdp_state()._lazy_init()
        with accelerator.unwrap_model(model).disable_adapter():
            yield model


def deepspeed_stage(accelerator) -> int | None:
    return getattr(accelerator.state.deepspeed_plugin, "zero_stage", None)  # None: no DeepSpeed


def rank_bytes(model) -> tuple[int, int]:
    """(bytes of `model`'s parameters held on this rank, bytes of the whole model): a ZeRO-3 partition, an FSDP2
    shard, or everything."""
    here = whole = 0
    for p in model.parameters():
        whole += (p.numel() if getattr(p, "ds_numel", None) is None else p.ds_numel) * p.element_size()
        here += (p.ds_tensor.numel() + p.data.numel() if hasattr(p, "ds_tensor") else  # partition (+ whole: kept)
                 p.to_local().numel() if hasattr(p, "to_local") else p.numel()) * p.element_size()
    return here, whole


def prepare_frozen(accelerator, model):
    """An evaluated-only model (reference, reward model): eval mode, no gradients, on the device, under the
    policy's autocast (else an fp32 reference of a bf16 policy gives KL > 0 at step 1). Under DeepSpeed:
    an inference engine in the training dtype, which shards it under ZeRO-3 (loaded from disk, not copied).
    Under FSDP2: sharded as the policy is (accelerate's own wrapping, the same mesh and mixed-precision policy,
    which casts the weights to bf16 and takes the place of autocast: the step-1 KL is 0), resharded after every
    forward, the root's too."""
    model.eval().requires_grad_(False)
    stage, whole = deepspeed_stage(accelerator), rank_bytes(model)[1]
    if accelerator.is_fsdp2:  # accelerate prepares the policy so, and with no autocast around it
        from accelerate.utils import fsdp2_prepare_model

        model = fsdp2_prepare_model(accelerator, model)  # fully_shard moves each rank's shard alone to its device
        model.set_reshard_after_forward(True)  # no backward follows to reshard what stays gathered
    elif stage is None:
        model = model.to(accelerator.device)
        model.forward = accelerator.autocast()(model.forward)  # a no-op without mixed precision
    else:
        import deepspeed
        trained = accelerator.state.deepspeed_plugin.deepspeed_config
        config = {"train_micro_batch_size_per_gpu": trained["train_micro_batch_size_per_gpu"],
                  **{k: {"enabled": trained.get(k, {}).get("enabled", False) is True} for k in ("bf16", "fp16")},
                  "zero_optimization": {"stage": 3 if stage == 3 else 0, **{  # the policy's ZeRO-3 settings too
                      k: v for k, v in trained["zero_optimization"].items() if k[:7] == "stage3_" and v != "auto"}}}
        engine = deepspeed.initialize(model=model, config=config)[0]
        model = engine.module.eval()
        # the engine holds the parameter hooks: kept alive as long as the model, and no longer (a module-level
        # list kept every frozen model whole after the script dropped it, e.g. after --precompute_ref_logps)
        object.__setattr__(model, "_frozen_engine", engine)  # not a registered submodule (that would be a cycle)
        if stage == 3:  # and two globals of DeepSpeed 0.19 that would keep it: the bottom of its stack of modules
            from deepspeed.runtime.zero import parameter_offload  # in forward (each forward pushes its own)...

            parameter_offload.FWD_MODULE_STACK.remove(model)
            # ...and a class-wide, unbounded lru_cache on a method of the coordinator (under a wrapper that hides
            # it): each frozen model's coordinator gets its own cache, freed with it
            coordinator = getattr(engine.optimizer, "parameter_offload", engine.optimizer).get_param_coordinator()
            name = "_PartitionedParameterCoordinator__params_to_release"
            method = getattr(type(coordinator), name, None)
            cached = [c.cell_contents for c in getattr(method, "__closure__", None) or ()
                      if hasattr(c.cell_contents, "cache_clear")]
            if cached:  # else another DeepSpeed version: left as it is
                setattr(coordinator, name, functools.lru_cache(None)(cached[0].__wrapped__.__get__(coordinator)))
    accelerator.print(f"frozen {model.config.model_type} ({model.config._name_or_path}): "
                      f"{rank_bytes(model)[0] / 2**20:.1f} MiB on each rank, of {whole / 2**20:.1f} MiB whole")
    return model
