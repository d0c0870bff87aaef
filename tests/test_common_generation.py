"""Padding, stop-token truncation, generation and logprob gathering."""

import math

import pytest

import torch

from common.generation import (SeededSampler, generate, pad, shared_prefix_cache, shifted_logits, token_entropy_no_grad,
                               token_logprobs, truncate_at_stop)
from common.models import load_policy
from tests.conftest import FixedLogits, sampling_logprobs


def test_pad_left_and_right():
    ids, mask = pad([[5, 6, 7], [8]], pad_id=0, side="left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = pad([[5, 6, 7], [8]], pad_id=0, side="right")
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_truncate_at_first_stop_token():
    ids = torch.tensor([[4, 2, 5, 2, 6],    # stops at index 1; the later 2 is dropped
                        [4, 5, 6, 7, 8],    # never stops
                        [2, 9, 9, 9, 9]])   # stops at once
    out, mask, finished = truncate_at_stop(ids, stop_ids=2, pad_id=0)
    assert out.tolist() == [[4, 2, 0, 0, 0], [4, 5, 6, 7, 8], [2, 0, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert finished.tolist() == [True, False, True]


def test_token_logprobs_match_softmax_with_temperature():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[2, 0]])
    # hand-computed: softmax([0.5, 1, 1.5])[2] and 1/3
    z = torch.exp(torch.tensor([0.5, 1.0, 1.5]))
    expected = torch.log(torch.tensor([[z[2] / z.sum(), 1 / 3]]))
    assert torch.allclose(token_logprobs(logits, labels, temperature=2.0), expected, atol=1e-6)


# Probabilities at the temperature, three positions, worked out by hand below; the labels' are 0.3, 0.2, 0.15.
TABLE = [[0.15, 0.45, 0.03, 0.3, 0.07], [0.6, 0.03, 0.2, 0.07, 0.1], [0.08, 0.12, 0.3, 0.35, 0.15]]
LABELS = [3, 2, 4]
# (truncation, tokens kept at each position, the label's probability renormalised over them). top_p 0.5 keeps a
# token while the more probable ones hold < 0.5 (vLLM and HF: drop where the ascending cumulative sum <= 0.5);
# min_p 0.25 keeps p >= 0.25 max p. Two labels fall outside (0.2 at position 1, 0.15 at 2): kept all the same.
HAND_WORKED = [
    (dict(top_k=2), [{1, 3}, {0, 2}, {3, 2}], [0.3 / 0.75, 0.2 / 0.8, 0.15 / 0.8]),
    (dict(top_p=0.5), [{1, 3}, {0}, {3, 2}], [0.3 / 0.75, 0.2 / 0.8, 0.15 / 0.8]),
    (dict(min_p=0.25), [{1, 3, 0}, {0, 2}, {1, 2, 3, 4}], [0.3 / 0.9, 0.2 / 0.8, 0.15 / 0.92]),
    # min-p first, then top-p over what it keeps (vLLM's order): at position 0, 0.45, 0.3, 0.15 -> 0.5, 0.33,
    # 0.17, and top-p 0.8 drops 0.17 (<= 0.2); top-p first (HF's order before) kept 0.15 (ascending sum 0.25)
    (dict(min_p=0.25, top_p=0.8), [{1, 3}, {0, 2}, {2, 3, 4}], [0.3 / 0.75, 0.2 / 0.8, 0.15 / 0.8]),
]


@pytest.mark.parametrize("truncation, kept, expected", HAND_WORKED, ids=["top_k", "top_p", "min_p", "min_p+top_p"])
def test_token_logprobs_of_the_truncated_distribution_hand_worked(truncation, kept, expected):
    """token_logprobs under top-k / top-p / min-p: log of the label's probability over the kept tokens (the
    distribution sampling drew from), finite for a label outside them, and its gradient against autograd of
    the same formula on the hand-worked kept sets."""
    temperature = 0.7
    logits = (temperature * torch.tensor(TABLE).log())[None].requires_grad_()  # softmax(logits / T) = TABLE
    labels = torch.tensor([LABELS])
    got = token_logprobs(logits, labels, temperature=temperature, **truncation)
    torch.testing.assert_close(got, torch.tensor([expected]).log(), atol=1e-6, rtol=0)
    keep = torch.zeros(1, 3, 5, dtype=torch.bool)
    for t, tokens in enumerate(kept):
        keep[0, t, list(tokens | {LABELS[t]})] = True
    z = (logits / temperature).masked_fill(~keep, -math.inf)
    formula = z.gather(-1, labels[..., None]).squeeze(-1) - torch.logsumexp(z, -1)
    weights = torch.tensor([[1.0, -2.0, 0.5]])
    (grad,) = torch.autograd.grad((got * weights).sum(), logits)
    (expected_grad,) = torch.autograd.grad((formula * weights).sum(), logits)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=0)
    assert (grad[~keep] == 0).all()  # the dropped tokens take no gradient
    # the seeded sampler (HF path) draws from the same kept tokens, and the tests' own rule keeps them too
    n, off = 2000, dict(top_k=0, top_p=1.0, min_p=0.0)
    for t, tokens in enumerate(kept):
        sampler = SeededSampler(list(range(n)), "cpu", temperature=temperature, max_new_tokens=1,
                                **{**off, **truncation})
        assert set(sampler(None, logits[0, t].detach().repeat(n, 1)).argmax(-1).tolist()) == tokens, (t, truncation)
        own = sampling_logprobs(logits[0, t].detach() / temperature, **truncation, label=LABELS[t])
        torch.testing.assert_close(own[LABELS[t]], got[0, t].detach(), atol=1e-6, rtol=0)


def test_without_truncation_token_logprobs_are_unchanged_bit_for_bit():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 7, 50).requires_grad_(), torch.randint(50, (2, 7))
    weights = torch.randn(2, 7)
    plain = token_logprobs(logits, labels, temperature=0.7)
    off = token_logprobs(logits, labels, temperature=0.7, top_k=0, top_p=1.0, min_p=0.0)
    assert torch.equal(plain, off)
    z = logits.detach() / 0.7  # the formula before truncation existed
    assert torch.equal(plain.detach(), z.gather(-1, labels[..., None]).squeeze(-1) - torch.logsumexp(z, -1))
    grads = [torch.autograd.grad((out * weights).sum(), logits)[0] for out in (plain, off)]
    assert torch.equal(*grads)


def test_shifted_logprobs_known_values_and_prompt_excluded():
    table = torch.log(torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25], [0.6, 0.3, 0.1]]))
    model = FixedLogits(table)
    input_ids = torch.tensor([[0, 1, 2, 2]])  # prompt = [0, 1], completion = [2, 2]
    attention_mask = torch.ones_like(input_ids)
    completion_mask = torch.tensor([[0, 0, 1, 1]])
    out = token_logprobs(shifted_logits(model, input_ids, attention_mask), input_ids[:, 1:]) * completion_mask[:, 1:]
    # p(2 | 1) = 0.25, p(2 | 2) = 0.1; the prompt token 1 (p(1 | 0) = 0.2) must not count
    assert torch.allclose(out, torch.log(torch.tensor([[1.0, 0.25, 0.1]])) * torch.tensor([[0, 1, 1]]))


def test_left_and_right_padding_give_the_same_logprobs(tiny_model, tokenizer):
    torch.manual_seed(0)
    model = load_policy(tiny_model, tokenizer).eval()
    seqs, prompt_lens = [[10, 11, 12, 13, 14], [20, 21, 22]], [3, 2]
    results = []
    for side in ("left", "right"):
        ids, mask = pad(seqs, tokenizer.pad_token_id, side)
        positions = torch.arange(ids.shape[1])[None, :]
        start = (ids.shape[1] - mask.sum(1)) if side == "left" else torch.zeros(2, dtype=torch.long)
        completion_mask = ((positions >= (start + torch.tensor(prompt_lens))[:, None]) & (mask == 1)).long()
        logps = token_logprobs(shifted_logits(model, ids, mask), ids[:, 1:]) * completion_mask[:, 1:]
        results.append(logps.sum(1))
    assert torch.allclose(results[0], results[1], atol=1e-5)


def test_left_padded_rows_give_their_own_logprobs_on_a_model_with_absolute_positions():
    """RoPE models (the tiny one, Llama, Qwen) give the same values whatever a row's first position, so
    only a model with learned absolute positions (GPT-2, OPT) shows positions counted over padding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2)).eval()
    seqs = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    ids, mask = pad(seqs, 0, side="left")
    with torch.no_grad():
        batched = token_logprobs(shifted_logits(model, ids, mask), ids[:, 1:])
        for row, seq in zip(batched, seqs):
            alone = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1], -1)
            expected = alone.gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)
            assert torch.allclose(row[-len(seq) + 1:], expected, atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_rows_sharing_a_prefix_give_each_rows_own_logprobs_and_gradients(tiny_model, tokenizer, side):
    """shifted_logits runs a prefix shared by several rows once and continues each row from its
    cache: every row's completion logprobs must equal that row's own forward without padding or
    neighbours, and the gradient that of the plain forward over the padded batch."""
    torch.manual_seed(0)
    model = load_policy(tiny_model, tokenizer).train()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [5, 6, 7, 8, 9, 10]]  # rows 0 and 2 hold the same prompt
    completions = [[20, 21], [22, 23, 24, 25], [26], [27, 28, 29]]
    owners = [0, 0, 1, 2]  # prompt of each row: rows 0, 1 share prompt 0; row 3's prompt equals it too
    seqs = [prompts[o] + c for o, c in zip(owners, completions)]
    if side == "left":  # generation's layout: left-padded prompts, completions from one column on
        width = max(len(p) for p in prompts)
        p_ids, p_mask = pad([prompts[o] for o in owners], tokenizer.pad_token_id, "left")
        c_ids, c_mask = pad(completions, tokenizer.pad_token_id, "right")
        ids, mask, start = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1), width - 1
        labels_mask = torch.cat([torch.zeros_like(p_mask), c_mask], 1)
    else:  # dpo's layout: right-padded rows, logits from the column before the shortest prompt's end
        ids, mask = pad(seqs, tokenizer.pad_token_id, "right")
        lens = torch.tensor([len(prompts[o]) for o in owners])
        labels_mask = (torch.arange(ids.shape[1])[None, :] >= lens[:, None]).long() * mask
        start = int(lens.min()) - 1
    shared = token_logprobs(shifted_logits(model, ids, mask, start), ids[:, start + 1:]) * labels_mask[:, start + 1:]
    for row, (o, c) in enumerate(zip(owners, completions)):
        alone = torch.tensor([prompts[o] + c])
        own = torch.log_softmax(model(input_ids=alone).logits[0, len(prompts[o]) - 1:-1], -1)
        expected = own.gather(-1, torch.tensor(c)[:, None]).sum()
        assert torch.allclose(shared[row].sum(), expected, atol=1e-5), row
    grads = torch.autograd.grad(shared.sum(), list(model.parameters()))
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    plain = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, :-1]
    plain = token_logprobs(plain, ids[:, 1:]) * labels_mask[:, 1:]
    for g, h in zip(grads, torch.autograd.grad(plain.sum(), list(model.parameters()))):
        assert torch.allclose(g, h, atol=1e-5, rtol=1e-4)


def test_generate_returns_masked_completions_cut_at_the_first_stop_token(tiny_model, tokenizer):
    model = load_policy(tiny_model, tokenizer)
    prompts = [tokenizer("TITLE: a").input_ids, tokenizer("TITLE: a longer prompt here").input_ids] * 2
    sample = dict(max_new_tokens=6, temperature=1.0, batch_size=2, seeds=[0, 1, 2, 3])
    free = generate(model, tokenizer, prompts, **sample).completion_ids
    # the tiny model rarely samples EOS in 6 tokens: make row 0's third token a stop token too (as a
    # chat model's generation_config adds <|im_end|> to the tokenizer's EOS), so that rows do finish
    stop = free[0, 2].item()
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
    out = generate(model, tokenizer, prompts, **sample)
    prompt_ids, prompt_mask, ids, mask, finished = (out.prompt_ids, out.prompt_mask, out.completion_ids,
                                                    out.completion_mask, out.finished)
    assert prompt_ids.shape[0] == 4 and prompt_mask[0, 0] == 0  # left-padded
    assert ids.shape == (4, 6) and mask.shape == (4, 6)
    assert ids[0, :3].tolist() == free[0, :3].tolist() and mask[0].tolist() == [1, 1, 1, 0, 0, 0] and finished[0]
    for row, m, f, sampled in zip(ids, mask, finished, free):
        hits = [j for j, t in enumerate(sampled.tolist()) if t in (stop, tokenizer.eos_token_id)]
        n = hits[0] + 1 if hits else 6  # up to and including the first stop token; the seeds fix the samples
        assert bool(f) == bool(hits) and m.tolist() == [1] * n + [0] * (6 - n)
        assert row[:n].tolist() == sampled[:n].tolist() and (row[n:] == tokenizer.pad_token_id).all()
    assert not finished.all()  # both kinds of row are checked


def test_seeded_sampler_draws_from_the_warped_distribution():
    from common.generation import SeededSampler

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n, temperature = 4000, 0.7
    scores = logits.repeat(n, 1)
    sampler = SeededSampler(list(range(n)), "cpu", temperature=temperature, top_k=0, top_p=1.0, min_p=0.0,
                            max_new_tokens=1)
    picks = sampler(None, scores).argmax(-1)
    expected = [math.exp(x / temperature) for x in logits.tolist()]
    expected = [e / sum(expected) for e in expected]
    observed = torch.bincount(picks, minlength=4).float() / n
    assert all(abs(o - e) < 0.03 for o, e in zip(observed.tolist(), expected)), (observed, expected)
    # top-k 2 leaves only the two largest logits
    sampler = SeededSampler(list(range(n)), "cpu", temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, max_new_tokens=1)
    picks = sampler(None, scores).argmax(-1)
    assert set(picks.tolist()) == {0, 1}


def test_seeded_samples_do_not_depend_on_the_batch(tiny_model, tokenizer):
    model = load_policy(tiny_model, tokenizer)
    a, b = tokenizer("TITLE: a").input_ids, tokenizer("TITLE: a longer prompt here").input_ids
    together = generate(model, tokenizer, [a, b, b], 8, temperature=1.0, seeds=[11, 22, 33]).completion_ids
    alone = generate(model, tokenizer, [b], 8, temperature=1.0, seeds=[22]).completion_ids
    split = generate(model, tokenizer, [a, b, b], 8, temperature=1.0, seeds=[11, 22, 33], batch_size=1).completion_ids
    assert torch.equal(together[1], alone[0]) and torch.equal(together, split)
    assert not torch.equal(together[1], together[2])  # same prompt, other seed: another sample


def test_every_rank_makes_the_same_model_calls_whatever_its_prompt_width(tiny_model, tokenizer):
    """DDP and ZeRO-3 communicate inside each model call, so a rank whose prompts are one token wide
    (nothing to share) must call the model as often as a rank with wider prompts: twice per
    shifted_logits (the prefix pass, then the rest)."""
    model = load_policy(tiny_model, tokenizer)
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    for width in (1, 3):
        ids = torch.arange(2 * (width + 2)).view(2, width + 2) % 50 + 10
        calls.clear()
        with torch.no_grad():
            shifted_logits(model, ids, torch.ones_like(ids), start=width - 1)
        assert len(calls) == 2, (width, len(calls))
        calls.clear()  # share_prefix=False (PPO, the same on every rank): one plain forward, no 1-token pass
        with torch.no_grad():
            shifted_logits(model, ids, torch.ones_like(ids), start=width - 1, share_prefix=False)
        assert len(calls) == 1, (width, len(calls))
    assert shared_prefix_cache(model, ids, torch.ones_like(ids), 0) is None  # length 0: the caller runs full rows


@pytest.mark.parametrize("shape", [(3, 5, 11), (2, 30, 2**19)])  # 2^19 vocabulary: chunks of 4 positions, the last of 2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_and_entropy_equal_the_whole_tensor_formula(dtype, shape):
    """Values and gradients of the chunked log-softmax (its own backward) against log_softmax of the
    whole fp32 tensor, at a temperature other than 1; a dropped temperature, or logits changed in
    place (fp32 .float() is no copy), would fail it."""
    torch.manual_seed(0)
    logits = (torch.randn(*shape) * 3).to(dtype).requires_grad_()
    labels = torch.randint(shape[2], shape[:2])
    weights = torch.randn(shape[:2])  # a loss that weighs positions differently
    full = torch.log_softmax(logits.float() / 0.7, dim=-1)
    expected = full.gather(-1, labels[..., None]).squeeze(-1)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), logits)
    got = token_logprobs(logits, labels, temperature=0.7)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), logits)
    assert got.dtype == torch.float32 and torch.allclose(got, expected, atol=1e-6)
    assert got_grad.dtype == dtype
    assert torch.allclose(got_grad.float(), expected_grad.float(), atol=1e-6 if dtype == torch.float32 else 1e-2)
    entropy = -(full.exp() * full).sum(-1)
    got = token_entropy_no_grad(logits, 0.7, elements=4 * shape[2])  # 4 positions a chunk
    assert torch.allclose(got, entropy, atol=1e-6) and not got.requires_grad
