"""Padding, sampling completions, cutting them at the stop token, and per-token logprobs."""

import torch
import torch.nn.functional as F
from transformers import GenerationConfig


def pad(seqs: list[list[int]], pad_id: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of a batch of token lists, padded on `side`."""
    ids = [torch.tensor(s, dtype=torch.long) for s in seqs]
    ones = [torch.ones(len(s), dtype=torch.long) for s in seqs]
    return (torch.nn.utils.rnn.pad_sequence(ids, True, pad_id, padding_side=side),
            torch.nn.utils.rnn.pad_sequence(ones, True, 0, padding_side=side))


def truncate_at_stop(ids: torch.Tensor, stop_id: int, pad_id: int):
    """Keep each row up to and including its first stop token and pad the rest.
    Returns (ids, mask of kept tokens, whether the row contains the stop token)."""
    is_stop = ids == stop_id
    finished = is_stop.any(dim=1)
    first_stop = torch.where(finished, is_stop.int().argmax(dim=1), ids.shape[1])
    keep = torch.arange(ids.shape[1], device=ids.device)[None, :] <= first_stop[:, None]
    return ids.masked_fill(~keep, pad_id), keep.long(), finished


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
             batch_size: int = 64):
    """Sample completions with HF `generate` (temperature 0: greedy) for left-padded prompts.

    Returns (prompt_ids, prompt_mask, completion_ids, completion_mask, finished); completions are cut
    after the first EOS, so `completion_mask` covers exactly the tokens the policy emitted up to and
    including EOS, and `finished` says which completions stopped by themselves."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=temperature > 0, temperature=temperature or None,
        top_p=top_p if temperature > 0 else None, top_k=top_k if temperature > 0 else None,
        min_p=(min_p or None) if temperature > 0 else None, repetition_penalty=repetition_penalty,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    prompt_ids, prompt_mask = pad(prompts, tokenizer.pad_token_id, side="left")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    chunks = []
    for i in range(0, len(prompts), batch_size):
        ids, mask = prompt_ids[i:i + batch_size].to(device), prompt_mask[i:i + batch_size].to(device)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        chunks.append(F.pad(out[:, ids.shape[1]:], (0, max_new_tokens - (out.shape[1] - ids.shape[1])),
                            value=tokenizer.pad_token_id))
    model.train(was_training)
    completion_ids, completion_mask, finished = truncate_at_stop(
        torch.cat(chunks), tokenizer.eos_token_id, tokenizer.pad_token_id)
    return prompt_ids.to(device), prompt_mask.to(device), completion_ids, completion_mask, finished


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels[t]) under logits[t] / temperature, per position (shapes [B, T, V] -> [B, T]).
    Sampling used the same temperature, so training logprobs must too."""
    logits = logits.float() / temperature
    return torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def shifted_logits(model, input_ids, attention_mask) -> torch.Tensor:
    """Logits at positions 0..T-2, aligned with the tokens they predict, `input_ids[:, 1:]`.
    Positions count real tokens only, so left padding (as in generation) gives the same values as right."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, :-1]

