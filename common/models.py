"""Loading tokenizers, policies and reward models from a hub name or a local directory."""

import os

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from benchmarks import tiny_tldr
from common.runtime import UserError

PAD_TOKEN = "<|pad|>"


def resolve(name_or_path: str) -> str:
    """The tiny task's default names ("tiny-pythia", ...) build locally on first use."""
    return tiny_tldr.materialize(name_or_path) or name_or_path


def _from_pretrained(cls, name_or_path: str, **kwargs):
    path = resolve(name_or_path)
    try:
        return cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        hint = "" if os.path.isdir(path) else (
            " (not a local directory; as a hub name it needs network access)")
        raise UserError(f"could not load '{name_or_path}'{hint}: {str(e).splitlines()[0]}") from None


def load_tokenizer(name_or_path: str):
    """Tokenizer with a pad token distinct from EOS, left-padding for generation.

    pad == eos is refused: padding is masked out of the loss, so EOS would be masked too and the
    model would never learn to stop. A missing pad token is added (call `fit_embeddings` after)."""
    tokenizer = _from_pretrained(AutoTokenizer, name_or_path)
    if tokenizer.eos_token_id is None:
        raise UserError(f"tokenizer of '{name_or_path}' has no eos_token; set one and save it")
    if tokenizer.pad_token_id is None:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    elif tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise UserError(
            f"tokenizer of '{name_or_path}' uses its EOS token {tokenizer.eos_token!r} as pad token, "
            "so EOS would be masked like padding and the model would never learn to stop; save the "
            f"tokenizer with a distinct pad token (or with none: the scripts then add {PAD_TOKEN!r})")
    tokenizer.padding_side = "left"
    return tokenizer


def fit_embeddings(model, tokenizer):
    """Grow the embeddings if the tokenizer gained a token, and record the pad id in the config."""
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def load_policy(name_or_path: str, tokenizer, dtype: str = "auto"):
    """A causal LM (the policy, or a frozen reference when put in eval mode by the caller)."""
    model = _from_pretrained(AutoModelForCausalLM, name_or_path, dtype=_dtype(dtype))
    return fit_embeddings(model, tokenizer)


def load_reward_model(name_or_path: str, tokenizer, dtype: str = "auto"):
    """A sequence classifier with exactly one label: its logit is the scalar reward. Loading a
    causal LM here adds a freshly initialised score head (how reward training starts)."""
    model = _from_pretrained(AutoModelForSequenceClassification, name_or_path, num_labels=1,
                             dtype=_dtype(dtype))
    return fit_embeddings(model, tokenizer)


def _dtype(name: str):
    return name if name == "auto" else getattr(torch, name)
