"""Padding-free passes (--padding_free, TRL's name; issue 57, work in progress on this branch): the real tokens of a
micro-batch's rows go into one sequence whose position ids restart at each row, so that no compute goes to padding.
transformers (5.x: `masking_utils.find_packed_sequence_indices`) builds the block-diagonal causal mask from position
ids that restart when the model is given no attention mask and no cache (SDPA, eager, and flash-attention's
variable-length kernels), so no row attends to another. The per-token values come back in the padded layout the
losses read; only the positions that predict a completion token go through the LM head."""

from dataclasses import dataclass

import torch
import tyro

from common.generation import token_entropy_no_grad, token_logprobs


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # --padding_free, not --packing.padding-free
@dataclass
class PackingArgs:
    """padding-free training (common/packing.py)"""
    padding_free: bool = False
    """each micro-batch's rows in one sequence, position ids restarting per row: no compute on padding (TRL's name)"""


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """[B, T] rows (padded on either side) -> their real tokens in one row [1, N], position ids [1, N] restarting at
    0 with each row, and each packed token's place in that row, [B, T] (-1 on padding)."""
    real = attention_mask.bool()
    place = torch.full(input_ids.shape, -1, dtype=torch.long, device=input_ids.device)
    place[real] = torch.arange(int(real.sum()), device=input_ids.device)
    return input_ids[real][None], (attention_mask.cumsum(-1) - 1)[real][None], place


def packed_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor):
    """A micro-batch's causal-LM forward as one packed row: (logits [1, N, V], input_ids [1, N], loss_mask [1, N],
    each packed token's row [N]) for a loss that reads logits[:, :-1] against input_ids[:, 1:] under
    loss_mask[:, 1:], each row's first token out of it (no token of its own row predicts it). No cache: with one,
    transformers does not read the restarting position ids as separate rows, and every row would attend to the rows
    before it."""
    ids, positions, _ = pack(input_ids, attention_mask)
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    real = attention_mask.bool()
    rows = torch.arange(len(input_ids), device=input_ids.device)[:, None].expand_as(real)[real]
    return logits, ids, loss_mask[real][None] * (positions > 0), rows


def packed_sequence_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          completion_mask: torch.Tensor):
    """Per row from one packed forward: the summed log-probabilities of its completion tokens, their count, and the
    mean logit over them (as dpo.py's and kto.py's padded passes give them)."""
    logits, ids, mask, rows = packed_forward(model, input_ids, attention_mask, completion_mask)
    mask, rows, n = mask[0, 1:], rows[1:], len(input_ids)
    logps = token_logprobs(logits[:, :-1], ids[:, 1:])[0] * mask
    counts = torch.zeros(n, dtype=mask.dtype, device=mask.device).index_add(0, rows, mask)
    mean_logits = logits[0, :-1].detach().float().mean(-1) * mask
    return (logps.new_zeros(n).index_add(0, rows, logps), counts,
            mean_logits.new_zeros(n).index_add(0, rows, mean_logits) / counts)


def _completion_logits(policy, input_ids, attention_mask, prompt_width: int):
    """From one packed forward: the logits before each completion token that is there, [1, M, V] (only those
    positions go through the LM head), those tokens [1, M], and where they sit in input_ids[:, prompt_width:]."""
    ids, positions, place = pack(input_ids, attention_mask)
    targets = attention_mask[:, prompt_width:].bool()  # completion tokens that are there
    before = place[:, prompt_width - 1:-1][targets]  # the packed position that predicts each of them
    logits = policy(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=before).logits
    return logits, input_ids[:, prompt_width:][targets][None], targets


def packed_completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """gkd.py's completion_logits from one packed forward: (logits before each completion token [1, M, V], those
    tokens [1, M], a mask of ones [1, M]), the M completion tokens of every row in a row."""
    logits, labels, _ = _completion_logits(model, torch.cat([prompt_ids, completion_ids], 1),
                                           torch.cat([prompt_mask, completion_mask], 1), prompt_ids.shape[1])
    return logits, labels, torch.ones(labels.shape, device=labels.device)


def packed_completion_logps(policy, input_ids, attention_mask, prompt_width: int, temperature: float,
                            entropy: bool = False, **truncation):
    """common.generation.completion_logps from one packed forward: the log-probability of each completion token
    input_ids[:, prompt_width:] (prompts left-padded, completions after them) under logits / temperature, truncated
    as sampling was; [B, T - prompt_width], 0 on padding (the padded pass gives padding a value the losses mask out).
    entropy=True: also each position's entropy (no gradient)."""
    logits, labels, targets = _completion_logits(policy, input_ids, attention_mask, prompt_width)
    logps = token_logprobs(logits, labels, temperature, **truncation)[0]
    out = torch.zeros(targets.shape, dtype=logps.dtype, device=logps.device).masked_scatter(targets, logps)
    if not entropy:
        return out
    h = token_entropy_no_grad(logits, temperature)[0]
    return out, torch.zeros(targets.shape, dtype=h.dtype, device=h.device).masked_scatter(targets, h)
