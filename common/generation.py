"""Padding, sampling completions, cutting them at the stop token, and per-token logprobs."""

import contextlib
import math

import torch
import torch.nn.functional as F
from transformers import (GenerationConfig, LogitsProcessor, MinPLogitsWarper, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from common.models import deepspeed_stage


def pad(seqs: list[list[int]], pad_id: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of a batch of token lists, padded on `side`."""
    ids = [torch.tensor(s, dtype=torch.long) for s in seqs]
    ones = [torch.ones(len(s), dtype=torch.long) for s in seqs]
    return (torch.nn.utils.rnn.pad_sequence(ids, True, pad_id, padding_side=side),
            torch.nn.utils.rnn.pad_sequence(ones, True, 0, padding_side=side))


def stop_token_ids(model_or_generation_config, tokenizer) -> list[int]:
    """The tokens a completion ends at: the tokenizer's EOS and the generation config's (chat models
    list their end-of-turn token there too, e.g. Llama 3 and Qwen instruct). vLLM stops at all of
    them, so HF generate and the truncation must too."""
    config = getattr(model_or_generation_config, "generation_config", model_or_generation_config)
    eos = getattr(config, "eos_token_id", None)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return list(dict.fromkeys([tokenizer.eos_token_id, *eos]))


def truncate_at_stop(ids: torch.Tensor, stop_ids: int | list[int], pad_id: int):
    """Keep each row up to and including its first stop token (any of `stop_ids`) and pad the rest.
    Returns (ids, mask of kept tokens, whether the row contains a stop token)."""
    is_stop = torch.isin(ids, torch.tensor(stop_ids, device=ids.device))
    finished = is_stop.any(dim=1)
    first_stop = torch.where(finished, is_stop.int().argmax(dim=1), ids.shape[1])
    keep = torch.arange(ids.shape[1], device=ids.device)[None, :] <= first_stop[:, None]
    return ids.masked_fill(~keep, pad_id), keep.long(), finished


class SeededSampler(LogitsProcessor):
    """Draws each row's next token from that row's own random stream, after temperature / top-k /
    top-p / min-p, and returns scores on which greedy decoding picks the drawn token. A completion
    then depends only on its prompt and seed, not on the rest of its batch or on how many processes
    share the batch (HF sampling draws all rows from one global generator), so runs on 1 and on N
    processes sample the same completions. Each row's uniforms, one per decoding step, are drawn up
    front from a generator seeded with its seed; every step then picks all rows' tokens at once by
    inverse CDF (one multinomial call per row and token cost 16x more on the tiny model)."""

    def __init__(self, seeds: list[int], device, temperature: float, top_k: int, top_p: float, min_p: float,
                 max_new_tokens: int):
        self.uniforms = torch.stack([torch.rand(max_new_tokens, generator=torch.Generator(device).manual_seed(s),
                                                device=device) for s in seeds])
        self.step = 0
        self.warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else []) + (
            [TopPLogitsWarper(top_p)] if top_p < 1 else []) + ([MinPLogitsWarper(min_p)] if min_p else [])

    def __call__(self, input_ids, scores):
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        cdf = torch.softmax(scores.float(), dim=-1).cumsum(dim=-1)
        u = self.uniforms[:, self.step, None] * cdf[:, -1:]  # scaled by the total, which rounding moves off 1
        self.step += 1
        # the first token whose cumulative probability exceeds u (right=True: never a token of probability 0)
        tokens = torch.searchsorted(cdf, u, right=True).clamp(max=scores.shape[-1] - 1)
        return torch.full_like(scores, -math.inf).scatter_(1, tokens, 0.0)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
             batch_size: int = 64, seeds: list[int] | None = None):
    """Sample completions with HF `generate` (temperature 0: greedy) for left-padded prompts; row i
    is sampled with seed seeds[i] (default: drawn from torch's global generator).

    Returns (prompt_ids, prompt_mask, completion_ids, completion_mask, finished); completions are cut
    after the first stop token (`stop_token_ids`), so `completion_mask` covers exactly the tokens the
    policy emitted up to and including it, and `finished` says which completions stopped by themselves."""
    stop_ids = stop_token_ids(model, tokenizer)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, repetition_penalty=repetition_penalty,
                              eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id)
    if temperature > 0 and seeds is None:
        seeds = torch.randint(2**62, (len(prompts),)).tolist()
    prompt_ids, prompt_mask = pad(prompts, tokenizer.pad_token_id, side="left")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    synced = is_partitioned(model) and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    chunks = []
    for i in range(0, len(prompts), batch_size):
        ids, mask = prompt_ids[i:i + batch_size].to(device), prompt_mask[i:i + batch_size].to(device)
        sampler = ([SeededSampler(seeds[i:i + batch_size], device, temperature, top_k, top_p, min_p, max_new_tokens)]
                   if temperature > 0 else [])
        # the samples of one prompt share its prefill: generate continues from the prompt's cache
        cache = shared_prefix_cache(model, ids, mask, ids.shape[1] - 1, logits_to_keep=1)
        # synced_gpus: only a sharded model needs every rank to decode in step (HF would turn it on
        # whenever ZeRO-3 is configured, and one rank sampling alone would then wait forever)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, logits_processor=sampler,
                             synced_gpus=synced, **({"past_key_values": cache} if cache is not None else {}))
        chunks.append(F.pad(out[:, ids.shape[1]:], (0, max_new_tokens - (out.shape[1] - ids.shape[1])),
                            value=tokenizer.pad_token_id))
    model.train(was_training)
    completion_ids, completion_mask, finished = truncate_at_stop(torch.cat(chunks), stop_ids, tokenizer.pad_token_id)
    return prompt_ids.to(device), prompt_mask.to(device), completion_ids, completion_mask, finished


@contextlib.contextmanager
def unwrapped_for_generation(accelerator, model, gather: bool = True):
    """The bare model to call `generate` (or any forward) on. Under ZeRO-3 its full weights are
    gathered on every rank first (all ranks must enter), and DeepSpeed's per-module hooks come off
    while they are: left on, each module would release its weights after its first forward and
    gather them again for every token. Inside, the model runs without communicating, so one rank
    alone may use it (a sample table). gather=False, for a model too large to gather, decodes
    sharded: every rank must then generate, and HF keeps them in step."""
    unwrapped = accelerator.unwrap_model(model)
    if deepspeed_stage(accelerator) != 3 or not gather:
        yield unwrapped
        return
    import deepspeed
    from deepspeed.runtime.zero import parameter_offload

    offload = model.optimizer.parameter_offload  # the engine's ZeRO-3 optimizer holds the hooks
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for param in model.parameters():
            param.ds_active_sub_modules.clear()  # else the exit would keep them gathered
        for hook in offload.forward_hooks + offload.backward_hooks + [offload.fwd_pre_hook]:
            hook.remove()  # the pre-hook too: it checks, with a broadcast, that all ranks run alike
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield unwrapped
        finally:
            offload.setup_zero_stage3_hooks()
            parameter_offload.FWD_MODULE_STACK.pop()  # the setup pushes the module a second time


def is_partitioned(model) -> bool:
    """Whether some weight of the model is a ZeRO-3 shard, not whole, on this rank."""
    return any(getattr(p, "ds_status", None) is not None and p.ds_status.name == "NOT_AVAILABLE"
               for p in model.parameters())


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels[t]) under logits[t] / temperature, per position (shapes [B, T, V] -> [B, T]).
    Sampling used the same temperature, so training logprobs must too. Computed a chunk of positions
    at a time (about 2^21 logits), and the backward pass recomputes their softmax: an fp32 copy of the
    logits exists only for the chunk being worked on (the whole batch's, at a 150k vocabulary and
    2 x 1024 positions, would be 1.2 GB, and autograd would keep it until backward)."""
    return _SelectiveLogSoftmax.apply(logits, labels, temperature)


def _chunks(logits, elements: int = 2**21):
    """(row, positions) index pairs covering [B, T, V] logits, each about `elements` logits (8 MiB in fp32)."""
    size = max(1, elements // logits.shape[-1])
    return ((b, slice(t, t + size)) for b in range(logits.shape[0]) for t in range(0, logits.shape[1], size))


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature):
        out = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        for c in _chunks(logits):
            z = logits[c].float() / temperature  # not div_: for fp32 logits .float() is the logits themselves
            out[c] = z.gather(-1, labels[c][:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
        ctx.save_for_backward(logits, labels)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, labels = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for c in _chunks(logits):  # d/dz (z_y / T - logsumexp(z / T)) = (onehot(y) - softmax(z / T)) / T
            g = torch.softmax(logits[c].float() / ctx.temperature, dim=-1).mul_(-grad[c][:, None])
            grad_logits[c] = g.scatter_add_(-1, labels[c][:, None], grad[c][:, None]).div_(ctx.temperature)
        return grad_logits, None, None


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0, elements: int = 2**21) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at each position ([B, T, V] -> [B, T]), for logging:
    a chunk of positions at a time, so no fp32 copy of the whole [B, T, V] exists."""
    out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    for c in _chunks(logits, elements):
        logp = torch.log_softmax(logits[c].float() / temperature, dim=-1)
        out[c] = -(logp.exp() * logp).sum(-1)
    return out


def real_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only (0 on left padding), so a padded row is placed as it
    would be alone."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def shifted_logits(model, input_ids, attention_mask, start: int = 0, share_prefix: bool = True) -> torch.Tensor:
    """Logits at positions start..T-2, aligned with the tokens they predict, `input_ids[:, start + 1:]`
    (start = prompt width - 1: the completion's). Only those positions go through the LM head
    (`logits_to_keep`), which saves its [B, T, V] output for the prompt. Positions count real tokens
    only, so left padding (as in generation) gives the same values as right.

    Rows whose first `start` tokens are the same (the num_generations samples of one prompt, the
    chosen and rejected of one pair) share them: a causal model's states there depend on nothing
    after, so those tokens go through the model once per distinct prefix, and the rest of every row
    continues from that prefix's key/value cache (gradients flow back through it). share_prefix=False
    (one sample per prompt, as in PPO): one plain forward, cheaper when no prefix repeats."""
    position_ids = real_positions(attention_mask)
    cache = shared_prefix_cache(model, input_ids, attention_mask, start if share_prefix else 0, logits_to_keep=1)
    if cache is not None:
        return model(input_ids=input_ids[:, start:], attention_mask=attention_mask, position_ids=position_ids[:, start:],
                     past_key_values=cache, use_cache=True).logits[:, :-1]
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                 logits_to_keep=input_ids.shape[1] - start).logits[:, :-1]


def shared_prefix_cache(model, input_ids, attention_mask, length: int, **kwargs):
    """The key/value cache of the first `length` tokens, one row per input row, computed once per
    distinct prefix (a causal model's states there depend on nothing after them). None when length
    is 0 or the model gives no cache (gradient checkpointing in training turns it off): the caller
    then runs the full rows. The prefix pass runs even when no two rows share one, so that every
    process makes the same number of model calls whatever its data (DDP and ZeRO-3 communicate inside
    each call)."""
    inner = getattr(model, "module", model)  # under DDP / DeepSpeed: the wrapped model
    checkpointing = getattr(inner, "is_activation_checkpointing", None)  # transformers >= 5.23; older:
    if checkpointing is None:
        checkpointing = getattr(inner, "is_gradient_checkpointing", False)
    if inner.training and checkpointing:
        return None
    if length <= 0:  # nothing to share (one-token prompts); a call all the same, as other ranks make one
        with torch.no_grad():
            model(input_ids=input_ids[:1, :1], attention_mask=attention_mask[:1, :1], use_cache=False)
        return None
    prefixes, owner = torch.unique(torch.cat([input_ids[:, :length], attention_mask[:, :length]], 1), dim=0,
                                   return_inverse=True)
    # a row holding each prefix (any of them: their prefixes are equal)
    first = owner.new_zeros(len(prefixes)).scatter_(0, owner, torch.arange(len(owner), device=owner.device))
    ids, mask = input_ids[first, :length], attention_mask[first, :length]
    out = model(input_ids=ids, attention_mask=mask, position_ids=real_positions(mask), use_cache=True,
                **kwargs)  # kwargs: logits_to_keep=1 for a causal LM
    cache = getattr(out, "past_key_values", None)
    if cache is not None:  # None: a model that keeps no cache
        cache.batch_select_indices(owner)
    return cache
