"""algos/grpo.py: advantages and every loss type against independent computations, the
mu == 1 gradient, batch-size checks, reward plumbing end to end, and a learning test."""

import math
import os
import statistics

import pytest
import torch
import tyro
from safetensors.torch import load_file

from algos import grpo
from common.runtime import UserError
from tests.conftest import run_script, script_args
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
    masked = [[loss * k for loss, k in zip(row, m)] for row, m in zip(losses, MASK)]
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
    loss, _ = grpo.grpo_loss(t(LOGPS), t(OLD), t(REF), t(ADV), t(MASK, dtype=torch.float), loss_type=loss_type,
                             epsilon=EPS_LOW, epsilon_high=EPS_HIGH, beta=BETA, importance_sampling_level=level,
                             max_completion_length=MAX_LEN, num_items_in_batch=NUM_ITEMS)
    assert loss.item() == pytest.approx(aggregate(token_losses(level == "sequence"), loss_type), rel=1e-5)


STATS_LOGPS = [[-1.0, -0.5, -2.0, -0.1], [-0.3, -1.2, -0.7, -0.4]]
# token ratios 1.25, 1.49, 0.61 (masked: 20) | 0.74, 1.65, 0.9, 0.7
STATS_OLD = [[-1.223, -0.9, -1.5, -3.0], [0.0, -1.7, -0.6, -0.043]]
STATS_REF = [[-0.8, -0.5, -2.5, 0.0], [-0.1, -1.0, -0.7, -0.9]]
STATS_MASK = [[1, 1, 1, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_loss_statistics_kl_and_clipped_shares_hand_worked(level):
    """grpo_loss's statistics, from the formulas over the 7 masked tokens: a ratio below 1 - epsilon counts for a
    negative advantage only, above 1 + epsilon_high (here 1.28, so 1.25 is not) for a positive one."""
    t = torch.tensor
    adv = [1.0, -1.0]
    _, stats = grpo.grpo_loss(t(STATS_LOGPS, requires_grad=True), t(STATS_OLD), t(STATS_REF), t(adv),
                              t(STATS_MASK, dtype=torch.float), loss_type="bnpo", epsilon=0.2, epsilon_high=0.28,
                              beta=0.3, importance_sampling_level=level)
    low = high = kl = 0.0
    for lp, old, ref, a, m in zip(STATS_LOGPS, STATS_OLD, STATS_REF, adv, STATS_MASK):
        seq_ratio = math.exp(sum((x - o) * k for x, o, k in zip(lp, old, m)) / sum(m))
        for x, o, r, k in zip(lp, old, ref, m):
            ratio = seq_ratio if level == "sequence" else math.exp(x - o)
            low += k * (ratio < 0.8 and a < 0)
            high += k * (ratio > 1.28 and a > 0)
            kl += k * (math.exp(r - x) - (r - x) - 1)
    if level == "token":
        assert (low, high) == (2, 1)  # the data exercise both sides
    expected = {"clip_ratio/low_mean": low / 7, "clip_ratio/high_mean": high / 7,
                "clip_ratio/region_mean": (low + high) / 7, "kl": kl / 7}
    assert {k: v.item() for k, v in stats.items()} == pytest.approx(expected, rel=1e-5)
    assert not any(v.requires_grad for v in stats.values())


def test_importance_weights_scale_the_clipped_term_but_not_the_kl():
    t = torch.tensor
    weights = [[0.5, 2.0, 1.0], [1.5, 1.0, 0.25]]
    loss, _ = grpo.grpo_loss(t(LOGPS), t(OLD), t(REF), t(ADV), t(MASK, dtype=torch.float), loss_type="dapo",
                             epsilon=EPS_LOW, epsilon_high=EPS_HIGH, beta=BETA, max_completion_length=MAX_LEN,
                             num_items_in_batch=NUM_ITEMS, token_weights=t(weights))
    assert loss.item() == pytest.approx(aggregate(token_losses(weights=weights), "dapo"), rel=1e-5)


def test_with_one_iteration_the_ratio_is_one_and_the_gradient_is_the_policy_gradient():
    logps = torch.tensor(LOGPS, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.float)
    loss, stats = grpo.grpo_loss(logps, logps.detach(), None, torch.tensor(ADV), mask, loss_type="bnpo")
    loss.backward()
    assert set(stats) == {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}  # beta 0: no kl
    assert all(v == 0 for v in stats.values())  # ratio 1: nothing clipped
    # d/dlogp of -A * exp(logp - sg(logp)) at ratio 1 is -A, divided by the 5 tokens
    expected = [[-a * m / 5 for m in row] for a, row in zip(ADV, MASK)]
    assert torch.allclose(logps.grad, torch.tensor(expected))


def test_batch_not_divisible_by_num_generations_fails_before_loading(tmp_path):
    with pytest.raises(UserError, match="= 6 completions per generation batch, which must be a multiple of "
                                        "num_generations 4"):
        grpo.main(script_args(grpo.Args, model_name_or_path=str(tmp_path / "nothing-here"),
                              per_device_train_batch_size=3, gradient_accumulation_steps=2, num_generations=4,
                              output_dir=str(tmp_path / "out")))


def test_beta_zero_loads_no_reference(tmp_path, sft_model, monkeypatch):
    loaded = []
    real = grpo.load_policy
    monkeypatch.setattr(grpo, "load_policy", lambda *a, **k: loaded.append(a[0]) or real(*a, **k))
    for beta in (0.0, 0.1):
        loaded.clear()
        grpo.main(script_args(grpo.Args, model_name_or_path=sft_model, reward_model_paths=[],
                            reward_funcs=["tests.toy_rewards:zero"], beta=beta, max_steps=1,
                            per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                            output_dir=str(tmp_path / f"b{beta}")))
        assert len(loaded) == (1 if beta == 0 else 2)


def test_reward_functions_alone_are_the_whole_reward(tmp_path, sft_model):
    """`--reward_funcs` without `--reward_model_paths` loads no reward model (it used to add output/reward)."""
    grpo.main(tyro.cli(grpo.Args, args=["--model_name_or_path", sft_model, "--reward_funcs", "tests.toy_rewards:short",
                                        "--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations",
                                        "2", "--max_completion_length", "4", "--output_dir", str(tmp_path)]))
    assert [k for k in read_log(str(tmp_path))[0] if k.startswith("rewards/")] == ["rewards/short/mean"]


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
    before = load_file(os.path.join(sft_model, "model.safetensors"))
    after = load_file(os.path.join(out, "model.safetensors"))
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


@pytest.mark.long  # 17 s or more: in .ci/run's lane 1, out of the default suite
def test_grpo_learns_a_toy_reward_with_a_reward_model_beside_it(tmp_path, sft_model, rm_model):
    out = str(tmp_path / "grpo")
    proc = run_script("algos/grpo.py", "--model_name_or_path", sft_model, "--reward_model_paths", rm_model,
                      "--reward_funcs", "tests.toy_rewards:short", "--reward_weights", "0.0", "1.0",
                      "--max_steps", "40", "--per_device_train_batch_size", "32", "--num_generations", "4",
                      "--learning_rate", "2e-3", "--max_completion_length", "16", "--num_iterations", "2",
                      "--output_dir", out)
    # the key/value cache (sampling, old and reference logprobs, the reward model) by the installed transformers'
    # name: 5.2x renamed `past_key_values` to `cache` and warns on the old one
    assert "deprecated" not in proc.stderr, proc.stderr[-3000:]
    log = read_log(out)
    assert {k for k in log[0] if k.startswith("rewards/")} == {f"rewards/{os.path.basename(rm_model)}/mean",
                                                               "rewards/short/mean"}
    first, last = [statistics.mean(r["reward"] for r in rows) for rows in (log[:3], log[-3:])]
    assert last > first + 1.0, (first, last)  # at least one word shorter on average


# CISPO and SAPO on two sequences with A = +2 and -1, token log-ratios (0.5, 0) and (-0.5, masked)
NEW_LOGPS, NEW_OLD = [[-0.5, -1.0], [-2.0, -0.2]], [[-1.0, -1.0], [-1.5, -0.2]]
NEW_ADV, NEW_MASK = [2.0, -1.0], [[1.0, 1.0], [1.0, 0.0]]


def new_loss(loss_type, **kw):
    logps = torch.tensor(NEW_LOGPS, requires_grad=True)
    loss, _ = grpo.grpo_loss(logps, torch.tensor(NEW_OLD), None, torch.tensor(NEW_ADV), torch.tensor(NEW_MASK),
                             loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, num_items_in_batch=3.0, **kw)
    loss.backward()
    return loss.item(), logps.grad.tolist()


def test_cispo_hand_worked_value_and_gradient():
    # weights sg(min(r, 1.28)): e^0.5 = 1.65 -> 1.28 (clipped), 1, e^-0.5 = 0.6065 (no lower bound; 0.8 would be wrong)
    # loss = -(1.28 * 2 * -0.5 + 1 * 2 * -1.0 + 0.6065 * -1 * -2.0) / 3 tokens (dapo normaliser) = 0.68898
    # d/dlogp = -w * A / 3: the clipped token keeps -1.28 * 2 / 3 (the clipped PPO term would give it 0);
    # without the stop-gradient the r = 1 token would get -(1 + logp) * A / 3 = 0, not -2/3
    w = math.exp(-0.5)
    value, grad = new_loss("cispo")
    assert value == pytest.approx(-(1.28 * 2 * -0.5 + 2 * -1.0 + w * -1 * -2.0) / 3, rel=1e-6)
    assert value == pytest.approx(0.68898, abs=1e-5)
    assert sum(grad, []) == pytest.approx([-1.28 * 2 / 3, -2 / 3, w / 3, 0.0], rel=1e-6)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_hand_worked_value_and_gradient():
    # gate f(r) = 4 / tau * sigmoid(tau (r - 1)), tau_pos = 1 for A = 2, tau_neg = 2 for A = -1; loss -f(r) A,
    # averaged per sequence, then over the 2 sequences (grpo normaliser):
    #   row 0: -2 * 4 * sigmoid(0.6487) = -5.2538 and -2 * 4 * sigmoid(0) = -4 -> mean -4.6269
    #   row 1: +1 * 2 * sigmoid(2 * (0.6065 - 1)) = 0.6257                      -> loss (-4.6269 + 0.6257) / 2 = -2.0006
    # d/dlogp = -A * 4 s (1 - s) * r / (tokens of the row * 2): 1 at r = 1 (the policy gradient), smaller far off
    r0, r1 = math.exp(0.5), math.exp(-0.5)
    value, grad = new_loss("sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=2.0)
    expected = ((-2 * 4 * sigmoid(r0 - 1) - 4) / 2 + 2 * sigmoid(2 * (r1 - 1))) / 2
    assert value == pytest.approx(expected, rel=1e-6) and value == pytest.approx(-2.00062, abs=1e-5)

    def g(r, tau, a, n):
        s = sigmoid(tau * (r - 1))
        return -a * 4 * s * (1 - s) * r / n
    assert sum(grad, []) == pytest.approx([g(r0, 1, 2, 4), g(1, 1, 2, 4), g(r1, 2, -1, 2), 0.0], rel=1e-6)
    assert grad[0][1] == pytest.approx(-0.5) and grad[1][0] == pytest.approx(0.26077, abs=1e-5)


def test_overlong_penalty_at_the_buffer_edges():
    # L = 10, C = 4, factor 0.5: free up to 6 tokens, then -0.5 * (len - 6) / 4, -0.5 from 10 on
    lengths = torch.tensor([0, 6, 7, 8, 10, 12])
    assert grpo.overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    assert grpo.overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def test_top_entropy_mask_hand_worked():
    entropy = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.7, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # the 5 loss tokens sorted: 0.1 0.3 0.5 0.7 0.9; their 0.6 quantile is 0.5 + 0.4 * 0.2 = 0.58 -> keep 0.9, 0.7
    # (counting the padding's 0.0 too would give 0.5 and keep 3)
    assert grpo.top_entropy_mask(entropy, mask, 0.4).tolist() == [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
    assert grpo.top_entropy_mask(entropy, mask, 1.0).tolist() == mask.tolist()
    assert grpo.top_entropy_mask(entropy, torch.zeros(2, 3), 0.2).tolist() == [[0.0] * 3] * 2


def test_informative_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, math.nan, 3.0, 3.0, math.nan, math.nan])
    assert grpo.informative_groups(rewards, 3).tolist() == [False, True, False]  # NaN: unscored, not a difference


def test_dynamic_sampling_keeps_informative_groups_and_counts_its_rounds(tmp_path, sft_model):
    """8 completions a batch = 2 groups of 4; prompts of odd length get reward 0 (constant groups). Replaying
    the reward function's calls gives the rounds each rollout needs and the rewards of the batch it keeps."""
    from tests import toy_rewards
    toy_rewards.CALLS.clear()
    common = dict(model_name_or_path=sft_model, reward_model_paths=[], max_steps=3, per_device_train_batch_size=8,
                  num_generations=4, max_completion_length=8, logging_steps=1, dynamic_sampling=True)
    grpo.main(script_args(grpo.Args, **common, reward_funcs=["tests.toy_rewards:constant_for_odd_prompts"],
                        output_dir=str(tmp_path / "a")))
    log, calls = read_log(str(tmp_path / "a")), list(toy_rewards.CALLS)
    for row in log:
        kept, rounds = [], 0
        while len(kept) < 8:
            rounds, call = rounds + 1, calls.pop(0)
            kept += [r for g in (call[:4], call[4:]) if max(g) != min(g) for r in g]
        assert row["dynamic_sampling/rounds"] == rounds and row["frac_reward_zero_std"] == 0.0
        assert row["reward"] == pytest.approx(statistics.mean(kept[:8]), rel=1e-6)
    assert not calls and sum(r["dynamic_sampling/rounds"] for r in log) > 3  # some groups were dropped
    assert log[-1]["episode"] == 8 * sum(r["dynamic_sampling/rounds"] for r in log)
    # every group constant: each rollout stops at the cap and trains on constant groups
    grpo.main(script_args(grpo.Args, **common, reward_funcs=["tests.toy_rewards:zero"], max_dynamic_sampling_rounds=3,
                        output_dir=str(tmp_path / "b")))
    log = read_log(str(tmp_path / "b"))
    assert [r["dynamic_sampling/rounds"] for r in log] == [3, 3, 3] and log[-1]["episode"] == 3 * 3 * 8
    assert all(r["frac_reward_zero_std"] == 1.0 for r in log)


def test_sapo_entropy_mask_and_overlong_punishment_end_to_end(tmp_path, sft_model):
    out = str(tmp_path / "grpo")
    # 2 tokens are too few for any summary to stop: every completion is 2 = L tokens long, punished -factor
    run_script("algos/grpo.py", "--model_name_or_path", sft_model, "--reward_model_paths",
               "--reward_funcs", "tests.toy_rewards:zero", "--overlong_buffer_length", "2", "--overlong_penalty_factor",
               "0.5", "--loss_type", "sapo", "--top_entropy_quantile", "0.2", "--max_completion_length", "2",
               "--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4", "--output_dir", out)
    log = read_log(out)
    assert log[0]["reward"] == -0.5 and log[0]["completions/clipped_ratio"] == 1.0 and math.isfinite(log[-1]["loss"])


def test_top_entropy_quantile_reaches_the_loss(tmp_path, sft_model):
    """The mask must enter the update (not only top_entropy_mask): the same samples (same seed), rewards that
    differ, ratio 1 at step 1, so masking 80% of the tokens changes the step-1 loss."""
    common = dict(model_name_or_path=sft_model, reward_model_paths=[], reward_funcs=["tests.toy_rewards:short"],
                  max_steps=1, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  logging_steps=1)
    losses = []
    for quantile in (1.0, 0.2):
        out = str(tmp_path / f"q{quantile}")
        grpo.main(script_args(grpo.Args, **common, top_entropy_quantile=quantile, output_dir=out))
        losses.append(read_log(out)[0]["loss"])
    assert losses[0] != 0.0 and losses[1] != pytest.approx(losses[0], rel=1e-3), losses


@pytest.mark.usefixtures("one_torch_thread")
def test_default_first_step_gradient_is_policy_gradient_plus_kl_of_scored_rows(tmp_path, tiny_model, monkeypatch):
    """grpo.py at its defaults (dapo, beta 0.04, group scaling, num_iterations 1, temperature 1) on fixed
    samples: the gradient of its first step against the loss written out here, row by row, with a reward
    that leaves some completions unscored. At ratio 1 the clipped term's gradient is -A_i grad log pi; the
    k3 term's is not 0 because the reference is perturbed; both are summed over the scored rows' tokens
    only and divided by their count. Each term is checked: a vanished policy gradient fails, and so does
    an unscored row let back into the KL term (or into the token count)."""
    from tests.first_step import assert_gradient, gradient, grads_of, online_first_step, own_logprobs
    args = script_args(grpo.Args, model_name_or_path=tiny_model, reward_model_paths=[],
                     reward_funcs=["tests.toy_rewards:short_or_none"],
                     per_device_train_batch_size=16, max_completion_length=8, output_dir=str(tmp_path / "grpo"))
    record, tokenizer, policy, ref, prompts, completions, _ = online_first_step(monkeypatch, grpo, args, tiny_model)
    # short_or_none: -(words), None for an odd number of words; A = (r - mean) / (std + 1e-4) over each
    # group's scored rows (sample std), 0 for the unscored
    words = [len(tokenizer.decode(c, skip_special_tokens=True).split()) for c in completions]
    rewards = [None if w % 2 else -float(w) for w in words]
    advantages = []
    for g in range(0, len(rewards), args.num_generations):
        group = rewards[g:g + args.num_generations]
        scored = [r for r in group if r is not None]
        assert len(set(scored)) > 1 and len(scored) < len(group), group  # informative, and some unscored
        mean, std = statistics.mean(scored), statistics.stdev(scored)
        advantages += [0.0 if r is None else (r - mean) / (std + 1e-4) for r in group]
    tokens = sum(len(c) for c, r in zip(completions, rewards) if r is not None)
    pg = kl = 0.0
    for p, c, r, a in zip(prompts, completions, rewards, advantages):
        if r is None:
            continue
        logps = own_logprobs(policy, p, c, args.temperature)
        with torch.no_grad():
            ref_logps = own_logprobs(ref, p, c, args.temperature)
        q = ref_logps - logps
        pg = pg - a * logps.sum() / tokens
        kl = kl + args.beta * (q.exp() - q - 1).sum() / tokens
    assert_gradient(grads_of(record), {"policy gradient": gradient(pg, policy), "kl": gradient(kl, policy)})
