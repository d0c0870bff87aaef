"""The sampler-mismatch correction (`--vllm_importance_sampling_cap`): vLLM's sampling distribution differs
slightly from the trainer's (kernels, precision), so grpo, rloo and ppo may weight each token's clipped term
by the ratio pi_train / pi_vllm of its sampled token, truncated (TIS, Yao et al. 2025) or masked outside a
range (IcePop, Ling Team 2025; MIS per sequence, Liu et al. 2025). Entered only with the flag and --use_vllm."""

from dataclasses import dataclass
from typing import Literal

import torch
import tyro

from common.runtime import UserError


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # --vllm_importance_sampling_cap, not --correction.vllm-...
@dataclass
class SamplerCorrectionArgs:
    """sampler-mismatch correction with vLLM (common/sampler_correction.py)"""
    vllm_importance_sampling_cap: float | None = None
    """sampler-mismatch correction (None: off): upper bound of the ratio pi_train / pi_vllm (TIS e.g. 2, IcePop 5)"""
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_mask"] = "token_truncate"
    """TIS (Yao et al. 2025) clamps ratios; IcePop (Ling Team 2025) zeroes tokens; MIS (Liu et al. 2025) sequences"""
    vllm_importance_sampling_clip_min: float = 0.0
    """lower bound of the ratio (TRL's name): truncation raises a ratio to it, masking zeroes below it (IcePop 0.5)"""


def check_correction(args: SamplerCorrectionArgs, *, use_vllm: bool, repetition_penalty: float = 1.0,
                     max_staleness: int = 0) -> dict | None:
    """Before anything loads: the correction's flags compatible with the others; importance_weights' options
    (None: no correction)."""
    if not (use_vllm and args.vllm_importance_sampling_cap):
        return None
    if repetition_penalty != 1:  # README: sampler mismatch
        raise UserError("--repetition_penalty with --vllm_importance_sampling_cap: vLLM's logprobs include the "
                        "penalty, the trainer's leave it out, so their ratio would measure the penalty; drop one")
    if max_staleness:
        raise UserError("--max_staleness with --vllm_importance_sampling_cap: the staleness weight pi_old / "
                        "pi_behaviour already divides by vLLM's log-probabilities; the two would correct one ratio")
    return dict(mode=args.vllm_importance_sampling_mode, low=args.vllm_importance_sampling_clip_min,
                high=args.vllm_importance_sampling_cap)


def importance_weights(logps, sampler_logps, mask, mode: str, low: float, high: float):
    """Sampler-mismatch weights [B, T] of the clipped term from the ratio pi_train / pi_vllm of the sampled tokens
    (mask; others get 1), and its statistics: token_truncate clamps it to [low, high], token_mask and sequence_mask
    zero it outside.
    Called by grpo, rloo and ppo with their sampling-time logprobs (see each script's UPDATE)."""
    log_ratio, real = (logps - sampler_logps) * mask, mask.bool()
    if mode == "sequence_mask":  # MIS: one ratio per sequence, the geometric mean exp(mean_t log ratio) of its tokens'
        log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        real = real.any(-1, keepdim=True)
    elif mode not in ("token_truncate", "token_mask"):
        raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}")
    ratio = torch.exp(log_ratio)
    outside = (ratio < low) | (ratio > high)
    weights = ratio.clamp(min=low, max=high) if mode == "token_truncate" else ratio.masked_fill(outside, 0.0)
    seen = ratio[real]  # statistics over tokens (sequence_mask: sequences); the share outside: truncated or masked
    return torch.where(mask.bool(), weights, 1.0), dict(mean=seen.mean(), min=seen.min(), max=seen.max(),
                                                        masked_fraction=outside[real].float().mean())


def importance_metrics(accelerator, corrections: list) -> dict:
    """TRL's sampling/importance_sampling_ratio/* from importance_weights' statistics of several micro-batches, over
    every process: min of the mins, max of the maxes, mean of the rest."""
    metrics = {}
    for k in corrections[0] if corrections else ():
        v = accelerator.gather(torch.stack([d[k] for d in corrections]))
        metrics[f"sampling/importance_sampling_ratio/{k}"] = {"min": torch.amin, "max": torch.amax}.get(
            k, torch.mean)(v).item()
    return metrics

