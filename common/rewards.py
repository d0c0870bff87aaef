"""Rewards for the online scripts: reward models (one-output classifiers, each with its tokenizer:
prompt + completion re-tokenized, ending in EOS, left-truncated) and reward functions `module:function`
called as TRL does, weighted and summed; weight 0: logged, not summed (an oracle to watch)."""

import inspect
import math
import os
import pkgutil
import sys
import threading

import torch

from common.data import encode_completion, encode_prompt
from common.generation import CACHE, pad, real_positions, shared_prefix_cache
from common.models import load_reward_model, load_tokenizer, prepare_frozen
from common.runtime import UserError, exit_now

EXTRAS = ("trainer_state", "log_metric", "log_extra")  # TRL's further arguments (common/reward_extras.py)


def load_reward_sources(model_paths: list[str], function_specs: list[str], weights: list[float] | None, accelerator,
                        functions: list = ()):
    """[(name, model or function, tokenizer or None)] and their weights (default: all 1); `functions`: (name,
    function) pairs after them, of weight 1 (an environment's get_reward)."""
    sources = []
    for i, path in enumerate(model_paths, 1):
        tokenizer = load_tokenizer(path, role=f"reward model {i}")
        model = prepare_frozen(accelerator, load_reward_model(path, tokenizer, role=f"reward model {i}"))
        sources.append((os.path.basename(os.path.normpath(path)), model, tokenizer))
    sources += [(spec.partition(":")[2], import_function(spec), None) for spec in function_specs]
    weights = [1.0] * len(sources) if weights is None else list(weights)
    sources, weights = sources + [(name, fn, None) for name, fn in functions], weights + [1.0] * len(functions)
    if not sources:
        raise UserError("no reward: pass --reward_model_paths and/or --reward_funcs")
    if len(weights) != len(sources):
        raise UserError(f"{len(weights)} reward_weights for {len(sources)} rewards "
                        f"({', '.join(name for name, _, _ in sources)}); give one weight per reward")
    if not any(weights):
        raise UserError("every reward has weight 0 (weight 0 only logs a reward); give one a weight")
    names = [name for name, _, _ in sources]
    sources = [(f"{name}_{i}" if names.count(name) > 1 else name, fn, tok) for i, (name, fn, tok) in enumerate(sources)]
    return sources, weights


def asks_for_extras(specs: list[str]) -> bool:
    """Whether a function `module:function` of specs is async, or names one of EXTRAS or takes **kwargs: then
    common/reward_extras.py calls the functions, with the EXTRAS each takes (TRL's contract)."""
    return any(inspect.iscoroutinefunction(fn) or any(p.name in EXTRAS or p.kind is p.VAR_KEYWORD for p in
                                                      inspect.signature(fn).parameters.values())
               for fn in map(import_function, specs))


def import_function(spec: str, what: str = "reward function"):
    """The function named by `module:function`; modules are also found from the working directory."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `python algos/x.py` puts algos/, not the working directory, on the path
    try:
        return pkgutil.resolve_name(spec)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"could not import {what} '{spec}' (expected module:function): {e}") from None


def last_token_scores(model, input_ids, attention_mask, prefix: int = 0) -> torch.Tensor:
    """A one-output classifier's score of each LEFT-padded row at its last token, [B]. HF reads the last
    token that is not `pad_token_id`: with pad == eos, the one before the EOS. Shown a pad id that never
    occurs, it reads the last position, which left padding makes the last real token; positions count
    real tokens, so a row scores as unpadded (padding may also sit between a left-padded prompt block
    and the completion block). prefix: that block's width; rows sharing it run it once."""
    config = getattr(model, "module", model).config  # under DDP / DeepSpeed: the wrapped model's
    pad_id, config.pad_token_id = config.pad_token_id, -1
    try:
        position_ids = real_positions(attention_mask)
        cache = shared_prefix_cache(model, input_ids, attention_mask, prefix)
        if cache is not None:
            return model(input_ids=input_ids[:, prefix:], attention_mask=attention_mask,
                         position_ids=position_ids[:, prefix:], use_cache=True, **{CACHE: cache}).logits[:, 0].float()
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, 0].float()
    finally:
        config.pad_token_id = pad_id


@torch.no_grad()
def score_with_model(model, tokenizer, prompts, completions, batch_size: int = 64, scores=last_token_scores):
    """The reward model's scalar for each (prompt, completion), in its own tokens; `scores`: the pass that reads
    them (common/packing.packed_scores with --padding_free)."""
    max_length = min(tokenizer.model_max_length, getattr(model.config, "max_position_embeddings", None) or 10**9)
    pairs = []  # (prompt, completion) tokens, the prompt cut from the left to fit max_length
    for p, c in zip(prompts, completions):
        completion = encode_completion(tokenizer, p, c)[-max_length:]
        prompt = encode_prompt(tokenizer, p)
        pairs.append((prompt[max(0, len(prompt) + len(completion) - max_length):], completion))
    out = []
    for i in range(0, len(pairs), batch_size):  # a prompt block, then a completion block, each left-padded
        p_ids, p_mask = pad([p for p, _ in pairs[i:i + batch_size]], tokenizer.pad_token_id, side="left")
        c_ids, c_mask = pad([c for _, c in pairs[i:i + batch_size]], tokenizer.pad_token_id, side="left")
        ids, mask = torch.cat([p_ids, c_ids], 1).to(model.device), torch.cat([p_mask, c_mask], 1).to(model.device)
        out.append(scores(model, ids, mask, p_ids.shape[1]).cpu())
    return torch.cat(out)


def compute_rewards(sources, weights, *, prompts: list, completions: list, columns: dict, timeout: float = 0,
                    completion_ids: list[list[int]] | None = None, scores=last_token_scores, call=None):
    """(weighted sum per completion [N], {name: [N], NaN where a source gave None or NaN}). Functions are
    called by keyword as TRL does, `f(prompts=, completions=, completion_ids=, **columns)` (the dataset's
    other columns), each given `timeout` seconds (called), or through `call(sources, kwargs) -> {name: list}`
    (TRL's extra arguments and async functions: common/reward_extras.py); reward models through `scores`
    (score_with_model's). None / NaN: left out of the sum; a completion no source scores sums to NaN, not 0 (the
    scripts give it no gradient rather than a made-up reward). inf is an error."""
    per_source = {name: score_with_model(fn, tokenizer, prompts, completions, scores=scores)
                  for name, fn, tokenizer in sources if tokenizer is not None}  # sources: the models first
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    returned = call(sources, kwargs) if call else {n: called(n, f, kwargs, timeout) for n, f, t in sources if t is None}
    per_source |= {name: _as_rewards(name, values, completions) for name, values in returned.items()}
    # a source of weight 0 is logged (rewards/<name>/mean) but not optimised: an oracle to watch
    counted = [(values, w) for values, w in zip(per_source.values(), weights) if w != 0]
    weighted = torch.stack([values for values, _ in counted], dim=1) * torch.tensor([w for _, w in counted])
    unscorable = weighted.isnan().all(dim=1)
    return weighted.nansum(dim=1).masked_fill(unscorable, math.nan), per_source


def called(name: str, fn, kwargs: dict, timeout=0.0, args=(), what="reward function", flag="--reward_timeout"):
    """fn(*args, **kwargs), a user's function (`what` `name`): what it raises, as one line that names it; not returned
    within `timeout` seconds (0: no limit; the `flag` that set it), the same line and the process ends (exit_now: a
    function that hangs cannot be stopped, and a run that waits on it forever tells no one)."""
    timer = threading.Timer(timeout or None, exit_now, [f"{what} '{name}' ran past {flag} ({timeout:g} s)"])
    timer.start()  # 0: waits for the cancel alone
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise UserError(f"{what} '{name}' raised {type(e).__name__}: {e}") from None
    finally:
        timer.cancel()


def _as_rewards(name: str, values, completions: list) -> torch.Tensor:
    """A reward function's list as a tensor (None: NaN), or one line saying what is wrong with it."""
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise UserError(f"reward function '{name}' returned {got} values for {len(completions)} completions; "
                        "it must return a list with one float (or None) per completion")
    try:
        rewards = torch.tensor([math.nan if v is None else float(v) for v in values])
    except (TypeError, ValueError):
        bad = next(v for v in values if v is not None and not isinstance(v, (int, float)))
        raise UserError(f"reward function '{name}' returned {type(bad).__name__} {str(bad)[:40]!r}; "
                        "it must return a list with one float (or None) per completion") from None
    if rewards.isinf().any():
        i = int(rewards.isinf().nonzero()[0])
        raise UserError(f"reward function '{name}' returned {values[i]} for completion {i} "
                        f"({str(completions[i])[:40]!r}); rewards must be finite (None: unscored)")
    return rewards
