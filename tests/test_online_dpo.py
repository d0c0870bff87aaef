"""algos/online_dpo.py: pair selection (ties included), the losses against hand values, beta per
epoch, a pairwise judge, and a learning test."""

import json
import math
import random
import statistics

import pytest
import torch

from algos import online_dpo
from tests.conftest import run_script
from tests.test_sft import read_log


def test_chosen_is_the_higher_score_and_ties_go_to_the_first():
    scores = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]])
    assert online_dpo.select_chosen(scores).tolist() == [1, 0, 0]


def test_losses_hand_values():
    # log-ratios: chosen 0.5, rejected -1.5, h = 2
    args = (torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-1.5]), torch.tensor([-1.5]), 0.5)
    losses, reward_c, reward_r = online_dpo.online_dpo_loss(*args, "sigmoid")
    assert losses.item() == pytest.approx(math.log(1 + math.exp(-1.0)), rel=1e-6)
    assert (reward_c.item(), reward_r.item()) == pytest.approx((0.25, -0.75))
    losses, _, _ = online_dpo.online_dpo_loss(*args, "ipo")
    assert losses.item() == pytest.approx((2 - 1 / (2 * 0.5)) ** 2)


def test_each_process_takes_every_world_size_th_prompt_of_the_same_shuffled_global_batch():
    """8 rows, global batches of 4 on 2 processes: rank r gets positions r, r + 2 of each batch of the seeded
    shuffle; the third batch starts a new pass, shuffled again by the same generator."""
    rng, passes = random.Random(3), []
    for _ in range(2):
        order = list(range(8))
        rng.shuffle(order)
        passes.append(order)
    for rank in range(2):
        shares = online_dpo.prompt_batches(8, 4, seed=3, rank=rank, world_size=2)
        got = [next(shares) for _ in range(3)]
        assert got == [passes[0][rank:4:2], passes[0][4 + rank::2], passes[1][rank:4:2]], rank


def write_prompts(tmp_path, n=32):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"TITLE: post {i}\n\nTL;DR:"}) + "\n" for i in range(n)))
    return str(prompts)


@pytest.mark.long  # 17 s or more: in .ci/run's lane 1, out of the default suite
def test_online_dpo_with_a_judge_switches_beta_per_epoch(tmp_path, sft_model):
    out = str(tmp_path / "odpo")
    run_script("algos/online_dpo.py", "--model_name_or_path", sft_model, "--dataset_name", write_prompts(tmp_path),
               "--judge", "tests.toy_rewards:prefer_shorter", "--beta", "0.1", "0.2", "--max_steps", "6",
               "--per_device_train_batch_size", "8", "--max_new_tokens", "8",
               "--output_dir", out)
    log = read_log(out)
    names = {"objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
             "objective/scores", "objective/scores_margin", "rewards/chosen", "rewards/rejected",
             "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "val/contain_eos_token", "beta"}
    assert names <= set(log[0])
    assert [r["beta"] for r in log] == [0.1] * 4 + [0.2] * 2  # 32 prompts / 8 per step = 4 steps an epoch
    # a judge scores its pick 1 and the other 0: chosen must be the pick in every pair of every step
    assert all(r["objective/scores_margin"] == 1.0 for r in log), [r["objective/scores_margin"] for r in log]


@pytest.mark.long  # 17 s or more: in .ci/run's lane 1, out of the default suite
def test_online_dpo_learns_a_toy_reward(tmp_path, sft_model):
    out = str(tmp_path / "odpo")
    run_script("algos/online_dpo.py", "--model_name_or_path", sft_model, "--dataset_name", write_prompts(tmp_path, 64),
               "--reward_model_paths", "--reward_funcs", "tests.toy_rewards:short", "tests.toy_rewards:short_or_none",
               "--reward_weights", "1", "0", "--max_steps", "32", "--beta", "1.0",
               "--per_device_train_batch_size", "16", "--learning_rate", "2e-3", "--max_new_tokens", "16",
               "--temperature", "1.0", "--output_dir", out)
    log = read_log(out)
    first, last = [statistics.mean(r["objective/scores"] for r in rows) for rows in (log[:4], log[-4:])]
    assert last > first + 0.5, (first, last)  # half a word shorter on average (a flipped loss makes it longer)
    # short_or_none, at weight 0, is logged but neither summed nor able to leave a completion unscored
    for r in log:
        assert r["objective/scores"] == pytest.approx(r["rewards/short/mean"], abs=1e-5)
        assert r["completions/unscored_ratio"] == 0 and math.isfinite(r["rewards/short_or_none/mean"])


@pytest.mark.usefixtures("one_torch_thread")
def test_default_first_step_gradient_against_the_loss_written_out(tmp_path, tiny_model, monkeypatch):
    """online_dpo.py at its defaults (sigmoid, beta 0.1) on fixed samples (two per prompt), with a reward
    that leaves some unscored and a perturbed reference: the gradient of its first step against
    sum over ranked pairs of -log sigmoid(beta h) / pairs, chosen = the higher score (ties: the first),
    every sequence scored alone here at temperature 1; a pair with an unscored completion adds nothing but
    counts in the mean. The chosen and the rejected parts are each checked."""
    from tests.first_step import assert_gradient, gradient, grads_of, online_first_step, own_logprobs
    args = online_dpo.Args(model_name_or_path=tiny_model, reward_model_paths=[],
                           reward_funcs=["tests.toy_rewards:short_or_none"],
                           per_device_train_batch_size=8, max_new_tokens=8, output_dir=str(tmp_path / "odpo"))
    record, tokenizer, policy, ref, prompts, completions, _ = online_first_step(monkeypatch, online_dpo, args,
                                                                                tiny_model)
    words = [len(tokenizer.decode(c, skip_special_tokens=True).split()) for c in completions]
    scores = [None if w % 2 else -float(w) for w in words]  # short_or_none
    beta, n_pairs, ranked = args.beta[0], len(completions) // 2, 0
    chosen = rejected = 0.0
    for j in range(n_pairs):
        (s0, s1), (p, _) = scores[2 * j:2 * j + 2], prompts[2 * j:2 * j + 2]
        if s0 is None or s1 is None:
            continue
        ranked += 1
        c, r = completions[2 * j:2 * j + 2] if s0 >= s1 else completions[2 * j:2 * j + 2][::-1]
        lc, lr = own_logprobs(policy, p, c).sum(), own_logprobs(policy, p, r).sum()
        with torch.no_grad():
            h = (lc - own_logprobs(ref, p, c).sum()) - (lr - own_logprobs(ref, p, r).sum())
        weight = beta * torch.sigmoid(-beta * h) / n_pairs
        chosen, rejected = chosen - weight * lc, rejected + weight * lr
    assert 0 < ranked < n_pairs, scores  # some pairs left out
    assert_gradient(grads_of(record), {"chosen": gradient(chosen, policy), "rejected": gradient(rejected, policy)})
