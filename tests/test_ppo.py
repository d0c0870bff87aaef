"""algos/ppo.py: GAE (hand-worked and against a vectorized form), the clipped losses, whitening,
reward shaping, and end-to-end runs including a learning test on a toy reward."""

import math
import os
import statistics

import pytest
import torch

from algos import ppo
from tests.conftest import run_script
from tests.test_sft import read_log


def test_gae_hand_worked():
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]])
    # t2: delta 1 - 0.7 = 0.3; t1: delta 0.7 - 0.6 = 0.1, A = 0.1 + 0.95 * 0.3 = 0.385;
    # t0: delta 0.6 - 0.5 = 0.1, A = 0.1 + 0.95 * 0.385 = 0.46575
    advantages, returns = ppo.gae(rewards, values, gamma=1.0, lam=0.95)
    assert advantages[0].tolist() == pytest.approx([0.46575, 0.385, 0.3], rel=1e-6)
    assert returns[0].tolist() == pytest.approx([0.96575, 0.985, 1.0], rel=1e-6)
    # discounted, gamma 0.9: t2 delta 0.3; t1 delta 0.9 * 0.7 - 0.6 = 0.03, A = 0.03 + 0.855 * 0.3 = 0.2865;
    # t0 delta 0.9 * 0.6 - 0.5 = 0.04, A = 0.04 + 0.855 * 0.2865 = 0.2849575
    advantages, returns = ppo.gae(rewards, values, gamma=0.9, lam=0.95)
    assert advantages[0].tolist() == pytest.approx([0.2849575, 0.2865, 0.3], rel=1e-6)
    assert returns[0].tolist() == pytest.approx([0.7849575, 0.8865, 1.0], rel=1e-6)


def test_gae_loop_matches_a_discount_matrix():
    torch.manual_seed(0)
    rewards, values, gamma, lam = torch.randn(3, 6), torch.randn(3, 6), 0.9, 0.8
    # A_t = sum_l (gamma lam)^l delta_{t+l}, with V past the end = 0
    next_values = torch.cat([values[:, 1:], torch.zeros(3, 1)], dim=1)
    deltas = rewards + gamma * next_values - values
    t = torch.arange(6)
    discount = torch.where(t[None, :] >= t[:, None], (gamma * lam) ** (t[None, :] - t[:, None]).float(),
                           torch.zeros(()))
    expected = deltas @ discount.T
    advantages, _ = ppo.gae(rewards, values, gamma, lam)
    assert torch.allclose(advantages, expected, atol=1e-5)


def test_policy_loss_hand_values():
    logps, old = torch.tensor([[0.0, -1.0]]), torch.tensor([[-0.5, -1.0]])
    advantages, mask = torch.tensor([[2.0, -1.0]]), torch.tensor([[1.0, 1.0]])
    loss, clipfrac, approxkl, _ = ppo.policy_loss(logps, old, advantages, mask, cliprange=0.2)
    # token 1: ratio e^0.5 = 1.65, A = 2: max(-3.30, -2.4) = -2.4 (clipped); token 2: ratio 1, A = -1: 1
    assert loss.item() == pytest.approx((-2.4 + 1.0) / 2, rel=1e-5)
    assert clipfrac.item() == 0.5 and approxkl.item() == pytest.approx(0.5 * 0.25 / 2)


def test_value_loss_hand_values():
    values, old, returns = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.1]]), torch.tensor([[2.0, 0.0]])
    loss, clipfrac = ppo.value_loss(values, old, returns, torch.ones(1, 2), cliprange_value=0.2)
    # token 1: V 1 clipped to 0.7: max(1, 1.69) = 1.69; token 2: V 0 (within 0.1 +- 0.2): max(0, 0) = 0
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.0) / 2, rel=1e-5)
    assert clipfrac.item() == 0.5


def test_whiten_masked_and_keeping_the_mean():
    values, mask = torch.tensor([[1.0, 3.0, 50.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    white = ppo.whiten(values, mask)
    assert white[0].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0], rel=1e-4)
    assert ppo.whiten(values, mask, shift_mean=False)[0].tolist() == pytest.approx(
        [2 - 1 / math.sqrt(2), 2 + 1 / math.sqrt(2), 0.0], rel=1e-4)


def test_reward_shaping_puts_the_score_on_the_last_real_token():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -3.0], [-1.0, -2.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards, kl = ppo.shape_rewards(logps, ref, torch.tensor([5.0, 7.0]), mask, kl_coef=0.1)
    assert kl.tolist() == [[0.5, -1.0, 0.0], [0.0, 1.0, 0.0]]
    assert torch.allclose(rewards, torch.tensor([[-0.05, 0.1 + 5.0, 0.0], [0.0, -0.1, 7.0]]))
    _, k3 = ppo.shape_rewards(logps, ref, torch.zeros(2), mask, kl_coef=0.1, kl_estimator="k3")
    assert k3[0].tolist() == pytest.approx([math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1, 0.0], rel=1e-5)


@pytest.mark.long  # 17 s or more: in .ci/run's lane 1, out of the default suite
def test_ppo_learns_a_toy_reward(tmp_path, sft_model, rm_model):
    out = str(tmp_path / "ppo")
    # the reward model (here the SFT model with a fresh head) is weighted 0: the toy reward decides
    run_script("algos/ppo.py", "--model_name_or_path", sft_model, "--reward_model_path", rm_model,
               "--reward_funcs", "tests.toy_rewards:short", "--reward_weights", "0.0", "1.0", "--max_steps", "24",
               "--per_device_train_batch_size", "16", "--num_ppo_epochs", "2", "--learning_rate", "2e-3",
               "--response_length", "16", "--temperature", "1.0", "--missing_eos_penalty", "1.0",
               "--output_dir", out)
    log = read_log(out)
    names = {"objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
             "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
             "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "lr",
             "episode", "eps"}
    assert names <= set(log[0]) and log[0]["objective/kl"] == pytest.approx(0.0, abs=1e-4)
    first, last = [statistics.mean(r["objective/scores"] for r in rows) for rows in (log[:4], log[-4:])]
    assert last > first + 1.0, (first, last)
    # the reward model, at weight 0, is scored and logged but not summed: the score is the toy reward
    # minus the EOS penalty of the responses that did not stop (16 per rollout)
    scored_by_rm = f"rewards/{os.path.basename(os.path.normpath(rm_model))}/mean"
    for r in log:
        assert math.isfinite(r[scored_by_rm])
        assert r["objective/scores"] == pytest.approx(r["rewards/short/mean"] - (1 - r["val/num_eos_tokens"] / 16),
                                                      abs=1e-5)


@pytest.mark.usefixtures("one_torch_thread")
def test_default_first_step_gradient_against_gae_and_whitening_written_out(tmp_path, tiny_model, monkeypatch):
    """ppo.py at its defaults (k1 KL 0.05, gamma 1, lam 0.95, whitened advantages, vf_coef 0.1, temperature
    0.7) on fixed samples, most of them stopped by an EOS before response_length: the gradient of its first
    step against the losses written out here, row by row. Rewards, values, GAE and whitening run over each
    response's real tokens only: A_t = sum_l (gamma lam)^l delta_{t+l} up to its EOS, with V = 0 after it.
    At ratio 1 the policy's gradient is -A_t grad log pi / tokens; at V = V_old the value model's is
    vf_coef (V_t - R_t) grad V / tokens; each is checked."""
    from transformers import AutoModelForSequenceClassification

    from common.models import load_tokenizer
    from tests.first_step import (assert_gradient, gradient, grads_of, online_first_step, own_logprobs,
                                  weights_of)
    rm = str(tmp_path / "rm")  # the value model starts from it; at weight 0 a toy reward decides
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1).save_pretrained(rm)
    load_tokenizer(tiny_model).save_pretrained(rm)
    args = ppo.Args(model_name_or_path=tiny_model, reward_model_path=rm, reward_funcs=["tests.toy_rewards:short"],
                    reward_weights=[0.0, 1.0], per_device_train_batch_size=8, response_length=8,
                    output_dir=str(tmp_path / "ppo"))
    record, tokenizer, policy, ref, prompts, completions, finished = online_first_step(monkeypatch, ppo, args,
                                                                                        tiny_model, "policy.")
    value_model = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    value_model.load_state_dict(weights_of(record, "value_model."))
    backbone = getattr(value_model, value_model.base_model_prefix)
    assert 0 < sum(finished) < len(finished) and min(map(len, completions)) < args.response_length  # padding after EOS
    gamma, lam, tokens = args.gamma, args.lam, sum(map(len, completions))
    logps, values, advantages = [], [], []
    for p, c in zip(prompts, completions):
        logps.append(own_logprobs(policy, p, c, args.temperature))
        hidden = backbone(torch.tensor([p + c])).last_hidden_state[0]
        values.append(value_model.score(hidden[len(p) - 1:-1]).squeeze(-1))  # V(s_t): the state before token t
        with torch.no_grad():
            rewards = -args.kl_coef * (logps[-1] - own_logprobs(ref, p, c, args.temperature))
        rewards[-1] += -len(tokenizer.decode(c, skip_special_tokens=True).split())  # short, at the last real token
        v = values[-1].detach().tolist() + [0.0]
        deltas = [rewards[t].item() + gamma * v[t + 1] - v[t] for t in range(len(c))]
        advantages.append(torch.tensor([sum((gamma * lam) ** (s - t) * deltas[s] for s in range(t, len(c)))
                                        for t in range(len(c))]))
    returns = [a + v.detach() for a, v in zip(advantages, values)]
    real = torch.cat(advantages)
    white = [(a - real.mean()) / (real.var() + 1e-8).sqrt() for a in advantages]
    pg = sum(-(a * lp).sum() for a, lp in zip(white, logps)) / tokens
    vf = args.vf_coef * sum(0.5 * ((v - r) ** 2).sum() for v, r in zip(values, returns)) / tokens
    assert_gradient(grads_of(record), {"policy gradient": gradient(pg, policy, "policy."),
                                       "value": gradient(vf, value_model, "value_model.")})
