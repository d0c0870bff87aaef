"""Padding, sampling completions, cutting them at the stop token, and per-token logprobs."""

import contextlib
import math
from dataclasses import dataclass

import torch
import tyro
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.utils.rnn import pad_sequence
from transformers import GenerationConfig, LogitsProcessor, MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.modeling_outputs import CausalLMOutputWithPast

from common.models import deepspeed_stage

# the key/value cache's name in model calls and outputs: `cache` since transformers 5.2x renamed it (the old name
# warns there), `past_key_values` before (the floor, 4.56, knows only that)
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # --top_p, not --sampling.top-p
@dataclass
class SamplingArgs:
    """sampling beyond the temperature (common/generation.py); the training logprobs are of the same distribution"""
    top_p: float = 1.0
    """nucleus sampling; training logprobs are of the truncated, renormalised distribution too"""
    top_k: int = 0
    """top-k sampling (0 disables); training logprobs too, as top_p"""
    min_p: float = 0.0
    """min-p sampling (0 disables); training logprobs too, as top_p"""
    repetition_penalty: float = 1.0
    """HF repetition penalty (1 disables); training logprobs leave it out (refused with the sampler correction)"""

    def truncation(self) -> dict:
        """The options of generate and token_logprobs that cut the distribution."""
        return dict(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)


def pad(seqs: list[list[int]], pad_id: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of a batch of token lists, padded on `side`."""
    ids = pad_sequence([torch.tensor(s, dtype=torch.long) for s in seqs], True, pad_id, padding_side=side)
    return ids, pad_sequence([torch.ones(len(s), dtype=torch.long) for s in seqs], True, 0, padding_side=side)


def stop_token_ids(model_or_generation_config, tokenizer) -> list[int]:
    """The tokenizer's EOS and the generation config's (chat models list their end-of-turn token there,
    e.g. Llama 3, Qwen): vLLM stops at all of them, so HF generate and the truncation must too."""
    config = getattr(model_or_generation_config, "generation_config", model_or_generation_config)
    eos = getattr(config, "eos_token_id", None)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return list(dict.fromkeys([tokenizer.eos_token_id, *eos]))


def truncate_at_stop(ids: torch.Tensor, stop_ids: int | list[int], pad_id: int):
    """(ids up to and including each row's first stop token, padded after; mask of kept tokens; stopped)."""
    is_stop = torch.isin(ids, torch.tensor(stop_ids, device=ids.device))
    finished = is_stop.any(dim=1)
    first_stop = torch.where(finished, is_stop.int().argmax(dim=1), ids.shape[1])
    keep = torch.arange(ids.shape[1], device=ids.device)[None, :] <= first_stop[:, None]
    return ids.masked_fill(~keep, pad_id), keep.long(), finished


def truncate_scores(scores: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, keep=None):
    """scores [N, V] (logits / temperature) with -inf on the tokens truncated sampling drops, in vLLM 0.32's
    order (v1/sample/sampler.py: min-p, then top-k, then top-p over what they keep), each step by HF's warper;
    keep: [N] a token per row left as it is whatever its rank (a label the reference or moved weights rank out)."""
    kept = scores
    for warp in ([MinPLogitsWarper(min_p)] if min_p else []) + ([TopKLogitsWarper(top_k)] if top_k else []) + (
            [TopPLogitsWarper(top_p)] if top_p < 1 else []):
        kept = warp(None, kept)  # none of the three reads the ids
    return kept if keep is None or kept is scores else kept.scatter_(1, keep[:, None], scores.gather(1, keep[:, None]))


class SeededSampler(LogitsProcessor):
    """Draws each row's next token from its own random stream, from `truncate_scores(scores / temperature)`,
    and returns scores on which greedy decoding picks it: a completion depends only on its prompt and seed,
    not on its batch (HF samples every row from one generator), so 1 and N processes sample alike.
    Each row's uniforms are drawn up front; a step picks every row's token by inverse CDF (a multinomial
    call per row and token cost 16x more on the tiny model)."""

    def __init__(self, seeds: list[int], device, *, temperature: float, top_k: int, top_p: float, min_p: float,
                 max_new_tokens: int):
        self.uniforms = torch.stack([torch.rand(max_new_tokens, generator=torch.Generator(device).manual_seed(s),
                                                device=device) for s in seeds])
        self.step, self.temperature, self.truncation = 0, temperature, dict(top_k=top_k, top_p=top_p, min_p=min_p)

    def __call__(self, input_ids, scores):
        scores = truncate_scores(scores / self.temperature, **self.truncation)
        cdf = torch.softmax(scores.float(), dim=-1).cumsum(dim=-1)
        u = self.uniforms[:, self.step, None] * cdf[:, -1:]  # scaled by the total, which rounding moves off 1
        self.step += 1
        # the first token whose cumulative probability exceeds u (right=True: never a token of probability 0)
        tokens = torch.searchsorted(cdf, u, right=True).clamp(max=scores.shape[-1] - 1)
        return torch.full_like(scores, -math.inf).scatter_(1, tokens, 0.0)


@dataclass
class Samples:
    """Completions of a batch of prompts, from HF `generate` or from vLLM (common/vllm.py), each cut at its
    first stop token (`stop_token_ids`)."""
    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # [N, T] up to and including the stop token, padded after it
    completion_mask: torch.Tensor  # [N, T] 1 on those tokens
    finished: torch.Tensor  # [N] the completion stopped by itself (else max_new_tokens cut it)
    sampler_logps: torch.Tensor | None = None  # [N, T] vLLM's logprob of each token (0 after it); None from HF
    model_mask: torch.Tensor | None = None  # [N, T] multi-turn (common/episodes.py): 1 on the model's own tokens


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
             batch_size: int = 64, seeds: list[int] | None = None) -> Samples:
    """Sample with HF `generate` (temperature 0: greedy), row i with seed seeds[i] (default: drawn from
    torch's generator)."""
    stop_ids = stop_token_ids(model, tokenizer)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, repetition_penalty=repetition_penalty,
                              eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id)
    if temperature > 0 and seeds is None:
        seeds = torch.randint(2**62, (len(prompts),)).tolist()
    prompt_ids, prompt_mask = pad(prompts, tokenizer.pad_token_id, side="left")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    # synced_gpus: only a sharded model needs every rank to decode in step (HF would turn it on whenever
    # ZeRO-3 is configured, and one rank sampling alone would then wait forever)
    synced = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1 and any(
        isinstance(p, DTensor) or getattr(p, "ds_status", None) is not None and p.ds_status.name == "NOT_AVAILABLE"
        for p in model.parameters())  # a ZeRO-3 or FSDP2 shard
    starts = list(range(0, len(prompts), batch_size))
    if synced:  # ranks may hold different numbers of prompts (episodes' later turns, GKD's on-policy ones): each makes
        # as many chunks' model calls (every forward a collective) as the rank with the most; None: a throwaway chunk,
        # the first prompt alone, its output dropped
        most = torch.tensor(len(starts), device=device)
        torch.distributed.all_reduce(most, torch.distributed.ReduceOp.MAX)
        starts += [None] * (int(most) - len(starts))
    chunks = []
    for i in starts:
        rows = slice(0, 1) if i is None else slice(i, i + batch_size)
        ids, mask = prompt_ids[rows].to(device), prompt_mask[rows].to(device)
        sampler = ([SeededSampler(seeds[rows], device, temperature=temperature, top_k=top_k, top_p=top_p,
                                  min_p=min_p, max_new_tokens=max_new_tokens)] if temperature > 0 else [])
        # the samples of one prompt share its prefill: generate continues from the prompt's cache
        cache = shared_prefix_cache(model, ids, mask, ids.shape[1] - 1, logits_to_keep=1)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, logits_processor=sampler,
                             synced_gpus=synced, **({CACHE: cache} if cache is not None else {}))
        if i is not None:
            chunks.append(F.pad(out[:, ids.shape[1]:], (0, max_new_tokens - (out.shape[1] - ids.shape[1])),
                                value=tokenizer.pad_token_id))
    model.train(was_training)
    return Samples(prompt_ids.to(device), prompt_mask.to(device),
                   *truncate_at_stop(torch.cat(chunks), stop_ids, tokenizer.pad_token_id))


def decodes_here(accelerator, gather: bool) -> bool:
    """Whether this rank takes part in a sample table that rank 0 alone prints: rank 0 does; the others too
    when the model stays sharded for it (gather off under ZeRO-3 / FSDP2), each forward being a collective."""
    return accelerator.is_main_process or not gather and (accelerator.is_fsdp2 or deepspeed_stage(accelerator) == 3)


@contextlib.contextmanager
def unwrapped_for_generation(accelerator, model, gather: bool = True, part: str | None = None):
    """The bare model (or its submodule `part`, e.g. ppo's policy) for `generate`. Under ZeRO-3 every rank (all
    must enter) gathers its full weights and DeepSpeed's per-module hooks come off meanwhile (else each module
    would release its weights after a forward and gather them again for every token); inside, one rank alone may
    use it. gather=False (a model too large to gather) decodes sharded: every rank must generate, and HF keeps
    them in step. FSDP2 likewise: every sharded module gathered, and not freed after each forward while inside.
    With `part`, only its weights are gathered (under FSDP2 also the root's few, e.g. embeddings, held in
    common with the rest)."""
    unwrapped = accelerator.unwrap_model(model)
    inner = unwrapped if part is None else getattr(unwrapped, part)
    if not gather or not (accelerator.is_fsdp2 or deepspeed_stage(accelerator) == 3):  # ZeRO-3 / FSDP2: sharded
        yield inner
    elif accelerator.is_fsdp2:
        model._get_fsdp_state()._lazy_init()  # the root first (PPO generates with a submodule); private API
        sharded = [model] + [m for m in inner.modules() if isinstance(m, FSDPModule) and m is not model]
        for module in sharded:
            module.unshard()  # not recursive: each module
            module.set_reshard_after_forward(False, recurse=False)
        try:
            yield inner
        finally:
            for module in sharded:
                module.reshard()
                module.set_reshard_after_forward(accelerator.state.fsdp_plugin.reshard_after_forward, recurse=False)
            model.set_reshard_after_forward(False, recurse=False)  # FSDP2 never reshards the root after forward
    else:
        import deepspeed
        from deepspeed.runtime.zero import parameter_offload

        offload = model.optimizer.parameter_offload  # the engine's ZeRO-3 optimizer holds the hooks
        with deepspeed.zero.GatheredParameters(list(inner.parameters())):
            for param in inner.parameters():
                param.ds_active_sub_modules.clear()  # else the exit would keep them gathered
            # every hook, the pre-hook too: it checks, with a broadcast, that all ranks run alike
            offload._remove_module_hooks()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield inner
            finally:
                offload.setup_zero_stage3_hooks()
                parameter_offload.FWD_MODULE_STACK.pop()  # the setup pushes the module a second time


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, **truncation) -> torch.Tensor:
    """log q(labels[t]) ([B, T, V] -> [B, T]), q the distribution sampling drew from: softmax(logits[t] /
    temperature) over the tokens truncation's top_k / top_p / min_p keep (`truncate_scores`), renormalised over them, as
    vLLM's processed logprobs; the label always counts as kept (moved weights or the reference may rank it out).
    A chunk of positions at a time, the backward recomputing their softmax: an fp32 copy exists only of
    one chunk (of a 150k vocabulary x 2 x 1024 positions it would be 1.2 GB, kept for backward)."""
    return _SelectiveLogSoftmax.apply(logits, labels, temperature, truncation)


def _chunks(logits, elements: int = 2**21):
    """(row, positions) index pairs covering [B, T, V] logits, about `elements` logits each (8 MiB in fp32)."""
    size = max(1, elements // logits.shape[-1])
    return ((b, slice(t, t + size)) for b in range(logits.shape[0]) for t in range(0, logits.shape[1], size))


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, truncation):
        out = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        for c in _chunks(logits):
            # not div_: for fp32 logits .float() is the logits themselves
            z = truncate_scores(logits[c].float() / temperature, keep=labels[c], **truncation)
            out[c] = z.gather(-1, labels[c][:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
        ctx.save_for_backward(logits, labels)
        ctx.temperature, ctx.truncation = temperature, truncation
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, labels = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for c in _chunks(logits):  # d/dz (z_y / T - logsumexp(z / T)) = (onehot(y) - q(z / T)) / T, 0 off the kept
            z = truncate_scores(logits[c].float() / ctx.temperature, keep=labels[c], **ctx.truncation)
            g = torch.softmax(z, dim=-1).mul_(-grad[c][:, None])
            grad_logits[c] = g.scatter_add_(-1, labels[c][:, None], grad[c][:, None]).div_(ctx.temperature)
        return grad_logits, None, None, None


@torch.no_grad()
def token_entropy_no_grad(logits: torch.Tensor, temperature: float = 1.0, elements: int = 2**21) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position ([B, T, V] -> [B, T]), a chunk at a time, for the logs
    and masks: no gradient flows through it (an entropy bonus writes -(p * log p).sum(-1) out; README)."""
    out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    for c in _chunks(logits, elements):
        logp = torch.log_softmax(logits[c].float() / temperature, dim=-1)
        out[c] = -(logp.exp() * logp).sum(-1)
    return out


def real_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting real tokens only (0 on left padding): a padded row is placed as if alone."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def shifted_logits(model, input_ids, attention_mask, start: int = 0, share_prefix: bool = True) -> torch.Tensor:
    """Logits at positions start..T-2, aligned with the tokens they predict, `input_ids[:, start + 1:]`
    (start = prompt width - 1: the completion's); only those go through the LM head. Positions count
    real tokens, so left padding gives the values of right padding. Rows whose first `start` tokens
    agree (a prompt's samples, a pair's chosen and rejected) run them once and continue from that
    prefix's cache (gradients flow through it); share_prefix=False: one plain forward (PPO)."""
    position_ids = real_positions(attention_mask)
    cache = shared_prefix_cache(model, input_ids, attention_mask, start, logits_to_keep=1) if share_prefix else None
    if cache is not None:
        return model(input_ids=input_ids[:, start:], attention_mask=attention_mask,
                     position_ids=position_ids[:, start:], use_cache=True, **{CACHE: cache}).logits[:, :-1]
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                 logits_to_keep=input_ids.shape[1] - start).logits[:, :-1]


def completion_logps(policy, input_ids, attention_mask, prompt_width: int, temperature: float, entropy: bool = False,
                     **truncation):
    """Log-probability of each completion token, input_ids[:, prompt_width:] (prompts left-padded), under the
    distribution that drew it (logits / temperature, truncated); entropy=True: also each position's entropy."""
    logits = shifted_logits(policy, input_ids, attention_mask, prompt_width - 1)
    logps = token_logprobs(logits, input_ids[:, prompt_width:], temperature, **truncation)
    return (logps, token_entropy_no_grad(logits, temperature)) if entropy else logps


@torch.no_grad()
def rollout_logps(policy, input_ids, attention_mask, prompt_width: int, batch_size: int, temperature: float,
                  logps=completion_logps, **truncation):
    """completion_logps (or `logps`, a pass like it) without gradients, batch_size rows at a time (old, reference and
    behaviour logprobs)."""
    return torch.cat([logps(policy, input_ids[i:i + batch_size], attention_mask[i:i + batch_size], prompt_width,
                            temperature, **truncation) for i in range(0, len(input_ids), batch_size)])


def shared_prefix_cache(model, input_ids, attention_mask, length: int, **kwargs):
    """The key/value cache of the first `length` tokens per row, computed once per distinct prefix. None
    when length is 0 or there is no cache (gradient checkpointing in training): the caller runs whole
    rows. Every process makes the same model calls whatever its data (DDP and ZeRO-3 communicate in each)."""
    inner = getattr(model, "module", model)  # under DDP / DeepSpeed: the wrapped model
    # checkpointing: transformers' is_activation_checkpointing (is_gradient_checkpointing before 5.23) written out;
    # FSDP2 regathers weights for backward through module outputs only, and a cache is none
    checkpointing = inner.training and any(getattr(m, "gradient_checkpointing", False) for m in inner.modules())
    if checkpointing or torch.is_grad_enabled() and isinstance(inner, FSDPModule):
        return None
    if length <= 0:  # nothing to share (one-token prompts); a call all the same, as other ranks make one
        with torch.no_grad():
            model(input_ids=input_ids[:1, :1], attention_mask=attention_mask[:1, :1], use_cache=False)
        return None
    prefixes, owner = torch.unique(torch.cat([input_ids[:, :length], attention_mask[:, :length]], 1), dim=0,
                                   return_inverse=True)
    first = owner.new_zeros(len(prefixes)).scatter_(0, owner, torch.arange(len(owner), device=owner.device))
    ids, mask = input_ids[first, :length], attention_mask[first, :length]
    # kwargs: logits_to_keep=1 for a causal LM
    out = model(input_ids=ids, attention_mask=mask, position_ids=real_positions(mask), use_cache=True, **kwargs)
    cache = getattr(out, CACHE, None)
    if cache is not None:  # None: a model that keeps no cache
        cache.batch_select_indices(owner)
    return cache
