"""The per-token passes between the sampler and the losses, each against values computed here row by
row: every sequence alone, unpadded, in one plain forward, read at the positions before its
completion tokens. Batches mix prompt lengths (left-padded as the sampler returns them; KTO's
right-padded), completions of different lengths and a temperature other than 1, so that a label
off by one, a position counted over padding, a value read one step late or a dropped temperature
each change the numbers."""

import contextlib

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from algos import kto, online_dpo, ppo
from common.generation import completion_logps, generate
from common.models import load_policy
from tests.conftest import sampling_logprobs

TEMPERATURE = 0.7
# two rows share a prompt (the shared-prefix path of shifted_logits); lengths differ everywhere
PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]
COMPLETIONS = [[20, 21, 22, 23], [24, 25], [26, 27, 28], [29]]


def left_padded(prompts, completions, pad_id):
    """input_ids / attention_mask as the sampler returns them: prompts left-padded to one width,
    completions right-padded; and that width."""
    width, length = max(map(len, prompts)), max(map(len, completions))
    ids = [[pad_id] * (width - len(p)) + p + c + [pad_id] * (length - len(c)) for p, c in zip(prompts, completions)]
    mask = [[0] * (width - len(p)) + [1] * (len(p) + len(c)) + [0] * (length - len(c))
            for p, c in zip(prompts, completions)]
    return torch.tensor(ids), torch.tensor(mask), width


def own_logits(model, prompt, completion, temperature=1.0):
    """Logits / T before each completion token, from the row's own unpadded forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return logits[len(prompt) - 1:-1] / temperature


def own_logprobs(model, prompt, completion, temperature=1.0):
    logps = torch.log_softmax(own_logits(model, prompt, completion, temperature), -1)
    return logps.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def perturbed(model, seed=1):
    """Another network of the same shape: a reference that differs from the policy."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture()
def policy(tiny_model, tokenizer):
    return load_policy(tiny_model, tokenizer).eval()


def test_completion_logps_and_entropy_equal_each_rows_own_forward(policy, tokenizer):
    input_ids, attention_mask, width = left_padded(PROMPTS, COMPLETIONS, tokenizer.pad_token_id)
    with torch.no_grad():
        logps, entropy = completion_logps(policy, input_ids, attention_mask, width, TEMPERATURE, entropy=True)
        assert torch.equal(completion_logps(policy, input_ids, attention_mask, width, TEMPERATURE), logps)
    assert logps.shape == (len(PROMPTS), max(map(len, COMPLETIONS)))
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        torch.testing.assert_close(logps[i, :len(c)], own_logprobs(policy, p, c, TEMPERATURE), atol=2e-5, rtol=0)
        probs = torch.softmax(own_logits(policy, p, c, TEMPERATURE), -1)
        torch.testing.assert_close(entropy[i, :len(c)], -(probs * probs.log()).sum(-1), atol=2e-5, rtol=0)
    # at temperature 1 the numbers are others (the temperature is applied, not ignored)
    at_one = completion_logps(policy, input_ids, attention_mask, width, 1.0)
    assert (at_one[0, :4] - logps[0, :4]).abs().max() > 1e-2


TRUNCATIONS = [dict(top_k=2), dict(top_p=0.5), dict(min_p=0.1, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("truncation", TRUNCATIONS, ids=["top_k", "top_p", "min_p+top_k+top_p"])
def test_completion_logps_under_truncation_equal_each_rows_own_forward(truncation, policy, tokenizer):
    """The old, new and reference passes share completion_logps: with the sampling's truncation each
    token's log-probability is over the tokens it keeps (the tests' own rule, conftest.sampling_logprobs);
    these fixed completions mostly lie outside them, and count as kept."""
    input_ids, attention_mask, width = left_padded(PROMPTS, COMPLETIONS, tokenizer.pad_token_id)
    with torch.no_grad():
        logps = completion_logps(policy, input_ids, attention_mask, width, TEMPERATURE, **truncation)
    outside = 0
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        z = own_logits(policy, p, c, TEMPERATURE)
        expected = torch.stack([sampling_logprobs(z[t], **truncation, label=y)[y] for t, y in enumerate(c)])
        torch.testing.assert_close(logps[i, :len(c)], expected, atol=2e-5, rtol=0)
        outside += sum(sampling_logprobs(z[t], **truncation)[y].isinf().item() for t, y in enumerate(c))
    assert outside and logps.isfinite().all()
    full = completion_logps(policy, input_ids, attention_mask, width, TEMPERATURE)
    assert (logps - full)[:, 0].min() > 1e-3  # renormalised over fewer tokens: each probability higher


@pytest.mark.parametrize("truncation", TRUNCATIONS[:2], ids=["top_k", "top_p"])
def test_a_sampled_rollouts_logprobs_are_those_of_the_distribution_it_was_drawn_from(truncation, policy, tokenizer):
    """HF path: each token generate drew under top-k / top-p is among the tokens the tests' own rule keeps,
    and grpo's per-token pass gives it its probability there (not over the whole vocabulary), so the
    ratio exp(new - old) of the first pass and pi / pi_sampler are 1."""
    prompts = [p for p in PROMPTS[1:] for _ in range(2)]
    out = generate(policy, tokenizer, prompts, 6, temperature=TEMPERATURE, seeds=list(range(len(prompts))),
                   **truncation)
    p_ids, p_mask, c_ids, c_mask = out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask
    with torch.no_grad():
        logps = completion_logps(policy, torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1),
                                      p_ids.shape[1], TEMPERATURE, **truncation)
    for i, p in enumerate(prompts):
        c = c_ids[i, :int(c_mask[i].sum())].tolist()
        z = own_logits(policy, p, c, TEMPERATURE)
        expected = torch.stack([sampling_logprobs(z[t], **truncation)[y] for t, y in enumerate(c)])
        assert expected.isfinite().all(), "the sampler drew a token the truncation drops"
        torch.testing.assert_close(logps[i, :len(c)], expected, atol=2e-5, rtol=0)


def test_ppo_rollout_pass_reads_policy_reference_and_value_before_each_response_token(policy, tiny_model, tokenizer):
    torch.manual_seed(0)
    value_model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1).eval()
    ref = perturbed(load_policy(tiny_model, tokenizer).eval())
    prompts, completions = PROMPTS[1:], COMPLETIONS[1:]  # PPO: one sample per prompt
    input_ids, attention_mask, width = left_padded(prompts, completions, tokenizer.pad_token_id)
    model = ppo.PolicyAndValue(policy, value_model)
    old, ref_logps, values = ppo.rollout_pass(model, ref, input_ids, attention_mask, prompt_width=width,
                                              temperature=TEMPERATURE, chunk_size=2)
    backbone = getattr(value_model, value_model.base_model_prefix)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        torch.testing.assert_close(old[i, :len(c)], own_logprobs(policy, p, c, TEMPERATURE), atol=2e-5, rtol=0)
        torch.testing.assert_close(ref_logps[i, :len(c)], own_logprobs(ref, p, c, TEMPERATURE), atol=2e-5, rtol=0)
        with torch.no_grad():  # V(s_t): the state ending at the token before response token t
            hidden = backbone(torch.tensor([p + c])).last_hidden_state[0]
            expected = value_model.score(hidden[len(p) - 1:-1]).squeeze(-1)
        torch.testing.assert_close(values[i, :len(c)], expected, atol=2e-5, rtol=0)
    assert (old - ref_logps).abs().max() > 1e-3  # the reference is another network, and is read as one


def test_kto_kl_logratios_score_each_prompt_with_the_previous_rows_completion(policy, tiny_model, tokenizer):
    ref = perturbed(load_policy(tiny_model, tokenizer).eval())
    examples = [(p, c, label) for p, c, label in zip(PROMPTS[1:], COMPLETIONS[1:], [True, False, True])]
    kl, ref_own = kto.kl_logratios(policy, contextlib.nullcontext(ref), examples, pad_id=tokenizer.pad_token_id,
                                   max_length=64, device="cpu")
    for i, (p, c, _) in enumerate(examples):
        other = examples[i - 1][1]  # row 0 takes the last row's completion
        expected = own_logprobs(policy, p, other).sum() - own_logprobs(ref, p, other).sum()
        torch.testing.assert_close(kl[i], expected, atol=5e-5, rtol=0)
        torch.testing.assert_close(ref_own[i], own_logprobs(ref, p, c).sum(), atol=5e-5, rtol=0)
    # max_length cuts the borrowed completion: prompt [11, 12] keeps 1 token of row 0's [24, 25]
    kl_short, _ = kto.kl_logratios(policy, contextlib.nullcontext(ref), examples, pad_id=tokenizer.pad_token_id,
                                   max_length=3, device="cpu")
    p, other = examples[1][0], examples[0][1][:1]
    torch.testing.assert_close(kl_short[1], own_logprobs(policy, p, other).sum() - own_logprobs(ref, p, other).sum(),
                               atol=5e-5, rtol=0)


def test_online_dpo_pairs_take_the_judges_pick_and_the_higher_score_as_chosen():
    chosen, rejected, ranked = online_dpo.pair_rows(online_dpo.judge_scores([1, 0, 1]))
    assert chosen.tolist() == [1, 2, 5] and rejected.tolist() == [0, 3, 4] and ranked.all()
    nan = float("nan")
    scores = torch.tensor([0.2, 0.9, 3.0, -1.0, 0.5, 0.5, nan, 2.0])
    chosen, rejected, ranked = online_dpo.pair_rows(scores)
    assert chosen.tolist() == [1, 2, 4, 7]  # the higher score; a tie goes to the first; NaN counts as 0
    assert rejected.tolist() == [0, 3, 5, 6]
    assert ranked.tolist() == [True, True, True, False]  # a pair with an unscored completion stays out
