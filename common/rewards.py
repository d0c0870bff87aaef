"""Rewards for the online scripts: reward models and Python reward functions, weighted and summed.

A reward model is a sequence classifier with one output and its own tokenizer: prompt + completion
are re-tokenized for it (ending in EOS, as in reward training) and left-truncated to its length.
A reward function is named `module:function` and called as
`f(prompts, completions, **columns) -> list[float | None]`, where `columns` holds the dataset's
other columns for these rows; None means "does not apply" and is left out of the sum.
"""

import importlib
import math
import os
import sys

import torch

from common.data import encode_completion, encode_prompt
from common.generation import pad
from common.models import load_reward_model, load_tokenizer, prepare_frozen
from common.runtime import UserError


def load_reward_sources(model_paths: list[str], function_specs: list[str], weights: list[float] | None, accelerator):
    """[(name, model or function, tokenizer or None)] and their weights (default: all 1)."""
    sources = []
    for path in model_paths:
        tokenizer = load_tokenizer(path)
        model = prepare_frozen(accelerator, load_reward_model(path, tokenizer))
        sources.append((os.path.basename(os.path.normpath(path)), model, tokenizer))
    for spec in function_specs:
        sources.append((spec.partition(":")[2], import_function(spec), None))
    if not sources:
        raise UserError("no reward: pass --reward_model_paths and/or --reward_funcs")
    weights = [1.0] * len(sources) if weights is None else list(weights)
    if len(weights) != len(sources):
        raise UserError(f"{len(weights)} reward_weights for {len(sources)} rewards "
                        f"({', '.join(name for name, _, _ in sources)}); give one weight per reward")
    names = [name for name, _, _ in sources]
    sources = [(f"{name}_{i}" if names.count(name) > 1 else name, fn, tok) for i, (name, fn, tok) in enumerate(sources)]
    return sources, weights


def import_function(spec: str, what: str = "reward function"):
    """The function named by `module:function`; modules are also found from the working directory."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `python algos/x.py` puts algos/, not the working directory, on the path
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"could not import {what} '{spec}' (expected module:function): {e}") from None


def import_judge(spec: str):
    """The pairwise judge `module:function(prompts, completion_pairs) -> list[int]`, wrapped so that
    whatever it does wrong (raises, returns the wrong length or other than 0 / 1) is one line."""
    judge = import_function(spec, "judge")

    def checked(prompts, completion_pairs):
        try:
            picks = judge(prompts, completion_pairs)
        except Exception as e:  # a user's function: say which one failed, in one line
            raise UserError(f"judge '{spec}' raised {type(e).__name__}: {e}") from None
        if (not isinstance(picks, (list, tuple)) or len(picks) != len(completion_pairs)
                or any(p not in (0, 1) for p in picks)):
            raise UserError(f"judge '{spec}' returned {str(picks)[:60]!r}; it must return 0 or 1 (the index of the "
                            f"better completion) for each of the {len(completion_pairs)} pairs")
        return list(picks)
    return checked


@torch.no_grad()
def score_with_model(model, tokenizer, prompts, completions, batch_size: int = 64) -> torch.Tensor:
    """The reward model's scalar for each (prompt, completion), in its own tokens."""
    max_length = min(tokenizer.model_max_length, getattr(model.config, "max_position_embeddings", None) or 10**9)
    seqs = [(encode_prompt(tokenizer, p) + encode_completion(tokenizer, p, c))[-max_length:]
            for p, c in zip(prompts, completions)]
    device = next(model.parameters()).device
    scores = []
    for i in range(0, len(seqs), batch_size):
        ids, mask = pad(seqs[i:i + batch_size], tokenizer.pad_token_id)  # right: the head reads the last real token
        scores.append(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0].float().cpu())
    return torch.cat(scores)


def compute_rewards(sources, weights, prompts: list, completions: list, columns: dict):
    """(weighted sum per completion [N], {name: [N] with nan where a function returned None})."""
    per_source = {}
    for name, fn, tokenizer in sources:
        if tokenizer is not None:
            per_source[name] = score_with_model(fn, tokenizer, prompts, completions)
            continue
        try:
            values = fn(prompts, completions, **columns)
        except Exception as e:  # a user's function: say which one failed, in one line
            raise UserError(f"reward function '{name}' raised {type(e).__name__}: {e}") from None
        if not isinstance(values, (list, tuple)) or len(values) != len(prompts):
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise UserError(f"reward function '{name}' returned {got} values for {len(prompts)} completions; "
                            "it must return a list with one float (or None) per completion")
        try:
            per_source[name] = torch.tensor([math.nan if v is None else float(v) for v in values])
        except (TypeError, ValueError):
            bad = next(v for v in values if v is not None and not isinstance(v, (int, float)))
            raise UserError(f"reward function '{name}' returned {type(bad).__name__} {str(bad)[:40]!r}; "
                            "it must return a list with one float (or None) per completion") from None
    weighted = torch.stack(list(per_source.values()), dim=1) * torch.tensor(weights)
    return weighted.nansum(dim=1), per_source
