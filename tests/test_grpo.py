"""algos/grpo.py: advantages and every loss type against independent computations, the
mu == 1 gradient, batch-size checks, reward plumbing end to end, and a learning test."""

import math
import os
import statistics

import pytest
import torch
from safetensors.torch import load_file

from algos import grpo
from common.runtime import UserError
from tests.conftest import run_script
from tests.test_sft import read_log


def test_group_advantages_hand_worked():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0])
    # groups (1, 2) and (3, 6): deviations -0.5, 0.5, -1.5, 1.5; sample stds 0.7071, 2.1213
    expected = [-0.5 / (math.sqrt(0.5) + 1e-4), 0.5 / (math.sqrt(0.5) + 1e-4),
                -1.5 / (math.sqrt(4.5) + 1e-4), 1.5 / (math.sqrt(4.5) + 1e-4)]
    assert grpo.group_advantages(rewards, 2, "group").tolist() == pytest.approx(expected, rel=1e-6)
    assert grpo.group_advantages(rewards, 2, "none").tolist() == [-0.5, 0.5, -1.5, 1.5]
    batch_std = statistics.stdev([1.0, 2.0, 3.0, 6.0])
    assert grpo.group_advantages(rewards, 2, "batch").tolist() == pytest.approx(
        [d / (batch_std + 1e-4) for d in (-0.5, 0.5, -1.5, 1.5)], rel=1e-6)


def test_unscorable_completions_leave_their_group_hand_worked():
    # G = 4, rewards [1, 2, None, 3]: the group is {1, 2, 3}, mean 2, sample std 1 -> [-1, 0, 0, 1]
    # (counting None as 0 would give mean 1.5, std 1.29 -> [-0.39, 0.39, -1.16, 1.16])
    rewards = torch.tensor([1.0, 2.0, math.nan, 3.0, 5.0, math.nan, math.nan, math.nan])
    out = grpo.group_advantages(rewards, 4, "group")
    assert out.tolist() == pytest.approx([-1 / (1 + 1e-4), 0.0, 0.0, 1 / (1 + 1e-4), 0.0, 0.0, 0.0, 0.0], abs=1e-7)
    assert grpo.group_advantages(rewards, 4, "none").tolist() == [-1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    batch_std = statistics.stdev([1.0, 2.0, 3.0, 5.0])  # over the scored rewards of the batch
    assert grpo.group_advantages(rewards, 4, "batch")[:4].tolist() == pytest.approx(
        [-1 / (batch_std + 1e-4), 0.0, 0.0, 1 / (batch_std + 1e-4)], abs=1e-7)


LOGPS = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]]
OLD = [[-1.2, -0.4, -2.0], [-0.3, -0.9, -1.5]]
REF = [[-1.1, -0.6, -1.0], [-0.2, -1.0, -0.7]]
ADV = [1.5, -0.8]
MASK = [[1, 1, 0], [1, 1, 1]]
EPS_LOW, EPS_HIGH, BETA, MAX_LEN, NUM_ITEMS = 0.2, 0.28, 0.1, 4, 7.0


def token_losses(sequence_level=False, weights=None):
    """-w min(r A, clip(r) A) + beta k3, token by token, from the formulas (w: importance weights)."""
    out = []
    weights = weights or [[1.0] * 3] * 2
    for lp, old, ref, a, m, w in zip(LOGPS, OLD, REF, ADV, MASK, weights):
        n = sum(m)
        seq_ratio = math.exp(sum((x - o) * k for x, o, k in zip(lp, old, m)) / n)
        row = []
        for x, o, r, wt in zip(lp, old, ref, w):
            ratio = seq_ratio if sequence_level else math.exp(x - o)
            surrogate = -min(ratio * a, min(max(ratio, 1 - EPS_LOW), 1 + EPS_HIGH) * a) * wt
            row.append(surrogate + BETA * (math.exp(r - x) - (r - x) - 1))
        out.append(row)
    return out


def aggregate(losses, loss_type):
    masked = [[l * k for l, k in zip(row, m)] for row, m in zip(losses, MASK)]
    if loss_type == "grpo":
        return sum(sum(row) / sum(m) for row, m in zip(masked, MASK)) / len(MASK)
    if loss_type == "bnpo":
        return sum(map(sum, masked)) / sum(map(sum, MASK))
    if loss_type == "dr_grpo":
        return sum(map(sum, masked)) / (len(MASK) * MAX_LEN)
    return sum(map(sum, masked)) / NUM_ITEMS  # dapo


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_types_against_the_formulas(loss_type, level):
    t = torch.tensor
    loss, _ = grpo.grpo_loss(t(LOGPS), t(OLD), t(REF), t(ADV), t(MASK, dtype=torch.float), loss_type, EPS_LOW,
                             EPS_HIGH, BETA, level, MAX_LEN, NUM_ITEMS)
    assert loss.item() == pytest.approx(aggregate(token_losses(level == "sequence"), loss_type), rel=1e-5)


def test_importance_weights_scale_the_clipped_term_but_not_the_kl():
    t = torch.tensor
    weights = [[0.5, 2.0, 1.0], [1.5, 1.0, 0.25]]
    loss, _ = grpo.grpo_loss(t(LOGPS), t(OLD), t(REF), t(ADV), t(MASK, dtype=torch.float), "dapo", EPS_LOW,
                             EPS_HIGH, BETA, "token", MAX_LEN, NUM_ITEMS, t(weights))
    assert loss.item() == pytest.approx(aggregate(token_losses(weights=weights), "dapo"), rel=1e-5)


def test_with_one_iteration_the_ratio_is_one_and_the_gradient_is_the_policy_gradient():
    logps = torch.tensor(LOGPS, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.float)
    loss, ratio = grpo.grpo_loss(logps, logps.detach(), None, torch.tensor(ADV), mask, "bnpo")
    loss.backward()
    assert torch.all(ratio == 1)
    # d/dlogp of -A * exp(logp - sg(logp)) at ratio 1 is -A, divided by the 5 tokens
    expected = [[-a * m / 5 for m in row] for a, row in zip(ADV, MASK)]
    assert torch.allclose(logps.grad, torch.tensor(expected))


def test_batch_not_divisible_by_num_generations_fails_before_loading(tmp_path):
    with pytest.raises(UserError, match="= 6 completions per generation batch, which must be a multiple of num_generations 4"):
        grpo.main(grpo.Args(model_name_or_path=str(tmp_path / "nothing-here"), per_device_train_batch_size=3,
                            gradient_accumulation_steps=2, num_generations=4, output_dir=str(tmp_path / "out")))


def test_beta_zero_loads_no_reference(tmp_path, sft_model, monkeypatch):
    loaded = []
    real = grpo.load_policy
    monkeypatch.setattr(grpo, "load_policy", lambda *a, **k: loaded.append(a[0]) or real(*a, **k))
    for beta in (0.0, 0.1):
        loaded.clear()
        grpo.main(grpo.Args(model_name_or_path=sft_model, reward_model_paths=[], reward_funcs=["tests.toy_rewards:zero"],
                            beta=beta, max_steps=1, per_device_train_batch_size=4, num_generations=2,
                            max_completion_length=4, output_dir=str(tmp_path / f"b{beta}")))
        assert len(loaded) == (1 if beta == 0 else 2)


def test_with_every_completion_unscored_the_weights_do_not_move(tmp_path, sft_model):
    """A reward function that applies to nothing: no advantage anywhere, and the KL term has no
    gradient while the policy equals the reference, so 2 steps of 2 iterations change no weight."""
    out = str(tmp_path / "grpo")
    run_script("algos/grpo.py", "--model_name_or_path", sft_model, "--reward_model_paths",
               "--reward_funcs", "tests.toy_rewards:none", "--beta", "0.1", "--num_iterations", "2",
               "--gradient_accumulation_steps", "2", "--max_completion_length", "6", "--max_steps", "2",
               "--per_device_train_batch_size", "4", "--num_generations", "4", "--logging_steps", "1",
               "--output_dir", out)
    log = read_log(out)
    assert len(log) == 2 and all(r["completions/unscored_ratio"] == 1.0 for r in log)
    before, after = load_file(os.path.join(sft_model, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_missing_eos_penalty_and_reward_metrics(tmp_path, sft_model):
    out = str(tmp_path / "grpo")
    # 2 tokens are too few for any summary to stop: every completion is penalised
    run_script("algos/grpo.py", "--model_name_or_path", sft_model, "--reward_model_paths",
               "--reward_funcs", "tests.toy_rewards:zero", "--missing_eos_penalty", "1.5",
               "--max_completion_length", "2", "--max_steps", "2", "--per_device_train_batch_size", "8",
               "--num_generations", "4", "--output_dir", out)
    log = read_log(out)
    assert log[0]["reward"] == -1.5 and log[0]["completions/clipped_ratio"] == 1.0
    assert log[0]["rewards/zero/mean"] == 0.0 and log[0]["frac_reward_zero_std"] == 1.0
    assert {"reward_std", "completions/mean_length", "entropy", "kl", "clip_ratio/low_mean",
            "clip_ratio/high_mean", "clip_ratio/region_mean", "lr", "episode", "eps"} <= set(log[0])


def test_grpo_learns_a_toy_reward_with_a_reward_model_beside_it(tmp_path, sft_model, rm_model):
    out = str(tmp_path / "grpo")
    run_script("algos/grpo.py", "--model_name_or_path", sft_model, "--reward_model_paths", rm_model,
               "--reward_funcs", "tests.toy_rewards:short", "--reward_weights", "0.0", "1.0", "--max_steps", "40",
               "--per_device_train_batch_size", "32", "--num_generations", "4", "--learning_rate", "2e-3",
               "--max_completion_length", "16", "--num_iterations", "2", "--output_dir", out)
    log = read_log(out)
    assert {k for k in log[0] if k.startswith("rewards/")} == {f"rewards/{os.path.basename(rm_model)}/mean",
                                                               "rewards/short/mean"}
    first, last = [statistics.mean(r["reward"] for r in rows) for rows in (log[:3], log[-3:])]
    assert last > first + 1.0, (first, last)  # at least one word shorter on average
