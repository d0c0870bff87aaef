"""The vLLM sampler-mismatch corrections (`importance_weights` in common/sampler_correction.py, which grpo.py, rloo.py
and ppo.py call): token_truncate (TIS), token_mask (IcePop), sequence_mask
(MIS, by the geometric-mean ratio), against ratios worked out by hand. The end-to-end run with a real
vLLM engine is in tests/test_vllm.py."""


import math

import pytest
import torch

from algos import grpo, online_dpo, ppo, rloo
from common.runtime import flags
from common.sampler_correction import importance_weights

LN2 = math.log(2.0)
# three completions, ratios pi_train / pi_vllm as powers of 2 (exponents below); 0: padding
#   row 0: 0.25, 1, 2, 8    geometric mean 2^((-2 + 0 + 1 + 3) / 4) = sqrt(2)   (arithmetic mean 2.8125)
#   row 1: 2, 8             geometric mean 2^((1 + 3) / 2) = 4                  (arithmetic 5; over all 4 places: 2)
#   row 2: 1                geometric mean 1
EXPONENTS = [[-2, 0, 1, 3], [1, 3, 0, 0], [0, 0, 0, 0]]
MASK = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
REAL_RATIOS = [0.25, 1, 2, 8, 2, 8, 1]


def logps_pair():
    """(trainer logps, sampler logps) with log ratio = exponent * ln 2 on real tokens; on padding the
    trainer says 0 and the sampler -50 (ratio e^50), so any padding that leaks into a weight or a
    statistic shows."""
    sampler = -1.0 - torch.arange(12, dtype=torch.float64).view(3, 4) / 10  # some negative logprobs
    train = sampler + torch.tensor(EXPONENTS, dtype=torch.float64) * LN2
    sampler = torch.where(MASK.bool(), sampler, torch.tensor(-50.0, dtype=torch.float64))
    train = torch.where(MASK.bool(), train, torch.tensor(0.0, dtype=torch.float64))
    return train, sampler


SCRIPTS = pytest.mark.parametrize("script", [grpo, rloo, ppo], ids=["grpo", "rloo", "ppo"])


def weights_and_stats(mode, low, high):
    train, sampler = logps_pair()
    weights, stats = importance_weights(train, sampler, MASK.double(), mode=mode, low=low, high=high)
    return weights, {k: v.item() for k, v in stats.items()}


def check(weights, expected):
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_token_truncate_clamps_each_ratio_and_leaves_padding_alone():
    # catches: the ratio upside down (pi_vllm / pi_train), padding weighted e^50 or counted in the statistics
    weights, stats = weights_and_stats("token_truncate", low=0.0, high=3.0)
    check(weights, [[0.25, 1, 2, 3], [2, 3, 1, 1], [1, 1, 1, 1]])
    assert stats == pytest.approx(dict(mean=sum(REAL_RATIOS) / 7, min=0.25, max=8.0, masked_fraction=2 / 7))
    weights, stats = weights_and_stats("token_truncate", low=0.5, high=3.0)  # TRL clamps from below too
    check(weights, [[0.5, 1, 2, 3], [2, 3, 1, 1], [1, 1, 1, 1]])
    assert stats["masked_fraction"] == pytest.approx(3 / 7)


def test_token_truncate_is_the_truncated_importance_sampling_grpo_had_before():
    """With no lower bound the weights on real tokens are bit for bit min(exp(old - sampler), cap): turning
    the mode flag on did not change what --vllm_importance_sampling_cap alone does."""
    train, sampler = (t.float() for t in logps_pair())
    weights, _ = importance_weights(train, sampler, MASK, mode="token_truncate", low=0.0, high=2.0)
    before = torch.exp(train - sampler).clamp(max=2.0)
    assert torch.equal(weights[MASK.bool()], before[MASK.bool()])


def test_token_mask_zeroes_tokens_outside_the_band():
    # IcePop band [0.4, 5]: 0.25 and both 8s are masked, the rest keep their ratio
    # catches: the mask inverted, truncation instead of masking, padding masked or counted
    weights, stats = weights_and_stats("token_mask", low=0.4, high=5.0)
    check(weights, [[0, 1, 2, 0], [2, 0, 1, 1], [1, 1, 1, 1]])
    assert stats == pytest.approx(dict(mean=sum(REAL_RATIOS) / 7, min=0.25, max=8.0, masked_fraction=3 / 7))


def test_the_band_edges_are_kept():
    """A ratio equal to a bound stays (the band is closed): with [1, 1] only the ratios that are exactly
    1 (log ratio 0, so exact in floating point) survive, in both masking modes."""
    weights, stats = weights_and_stats("token_mask", low=1.0, high=1.0)
    check(weights, [[0, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1]])
    assert stats["masked_fraction"] == pytest.approx(5 / 7)
    weights, stats = weights_and_stats("sequence_mask", low=1.0, high=1.0)
    check(weights, [[0, 0, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1]])
    assert stats["masked_fraction"] == pytest.approx(2 / 3)


def test_sequence_mask_weighs_each_sequence_by_its_geometric_mean_ratio():
    # band [0.5, 2]: row 0 (sqrt 2) and row 2 (1) are kept, row 1 (4) is masked whole
    # catches: the arithmetic mean (row 0 would be 2.81, masked), a mean over padding places (row 1 would
    # be 2, kept), the mask inverted, statistics over tokens instead of sequences
    weights, stats = weights_and_stats("sequence_mask", low=0.5, high=2.0)
    r2 = math.sqrt(2)
    check(weights, [[r2, r2, r2, r2], [0, 0, 1, 1], [1, 1, 1, 1]])
    assert stats == pytest.approx(dict(mean=(r2 + 4 + 1) / 3, min=1.0, max=4.0, masked_fraction=1 / 3))
    weights, stats = weights_and_stats("sequence_mask", low=0.5, high=5.0)  # a wider band keeps row 1
    check(weights, [[r2, r2, r2, r2], [4, 4, 1, 1], [1, 1, 1, 1]])
    assert stats["masked_fraction"] == 0.0


def test_an_unknown_mode_fails():
    train, sampler = logps_pair()
    with pytest.raises(ValueError, match="sequence_truncate"):
        importance_weights(train, sampler, MASK, mode="sequence_truncate", low=0.0, high=2.0)


@SCRIPTS
def test_the_flags_default_to_no_correction(script):
    """Nothing changes unless a cap is given; the mode and lower bound then default to TIS as before."""
    fields = flags(script.Args())
    assert fields["vllm_importance_sampling_cap"] is None
    assert fields["vllm_importance_sampling_mode"] == "token_truncate"
    assert fields["vllm_importance_sampling_clip_min"] == 0.0


def test_online_dpo_has_no_correction_flags():
    """Its DPO loss is not importance-weighted (docs/scaling.md): a flag that did nothing would mislead."""
    assert not [name for name in flags(online_dpo.Args()) if name.startswith("vllm_importance")]
