"""algos/rloo.py: leave-one-out advantages (a loop over prompts vs the vectorized form), token-level
returns, the clipped surrogate, whitening, and end-to-end runs including a learning test."""

import math
import os
import statistics

import pytest
import torch

from algos import rloo
from common.runtime import UserError
from tests.conftest import ROOT, run_script, script_args
from tests.test_sft import read_log


def test_leave_one_out_baseline_matches_a_loop_over_prompts():
    torch.manual_seed(0)
    k, rewards = 4, torch.randn(12)
    expected = []
    for p in range(3):  # each prompt's k samples are consecutive
        group = rewards[p * k:(p + 1) * k].tolist()
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1:]
            expected.append(r - sum(others) / len(others))
    assert rloo.rloo_advantages(rewards, k).tolist() == pytest.approx(expected, abs=1e-6)


def test_unscorable_samples_are_in_no_baseline_and_get_zero():
    nan = float("nan")
    # k = 4: [1, 2, None, 3] -> each scored sample against the mean of its two scored siblings;
    # [4, None, None, None]: no sibling to compare with -> 0
    rewards = torch.tensor([1.0, 2.0, nan, 3.0, 4.0, nan, nan, nan])
    expected = [1 - 2.5, 2 - 2.0, 0.0, 3 - 1.5, 0.0, 0.0, 0.0, 0.0]
    assert rloo.rloo_advantages(rewards, 4).tolist() == pytest.approx(expected, abs=1e-6)
    # token level, k = 3: sample 1 unscorable; samples 0 and 2 are each other's baseline
    scores = torch.tensor([1.0, nan, 3.0])
    kl, mask = torch.zeros(3, 2), torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    advantages = rloo.token_level_advantages(scores, kl, mask, kl_coef=0.1, k=3)
    assert torch.allclose(advantages, torch.tensor([[1 - 3.0, 1 - 3.0], [0.0, 0.0], [3 - 1.0, 3 - 1.0]]), atol=1e-6)


def test_token_level_advantages_hand_worked():
    scores = torch.tensor([1.0, 3.0])
    kl = torch.tensor([[0.5, 1.0, 9.0], [0.0, 2.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # token rewards (kl_coef 0.1): [-0.05, -0.1 + 1] and [0, -0.2, -0.1 + 3]; returns-to-go
    # [0.85, 0.9, 0] and [2.7, 2.7, 2.9]; baselines (k = 2): the other sample's first return
    advantages = rloo.token_level_advantages(scores, kl, mask, kl_coef=0.1, k=2)
    expected = [[0.85 - 2.7, 0.9 - 2.7, 0.0], [2.7 - 0.85, 2.7 - 0.85, 2.9 - 0.85]]
    assert torch.allclose(advantages, torch.tensor(expected), atol=1e-6)


def test_token_level_advantages_score_the_last_trained_token_across_tool_gaps():
    """Multi-turn: the mask has 0s at tool results between the model's turns. The score goes on the last 1 (the
    answer's end), not at the count of 1s minus one (which lands inside the tool result: the answer would get none)."""
    scores = torch.tensor([1.0, 2.0, 0.5, 4.0])
    kl = torch.tensor([[0.5, 0.0, 1.0, 9.0, 9.0, 9.0, 2.0, 1.0, 0.0],
                       [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                       [0.0, 3.0, 9.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0],
                       [1.0, 9.0, 9.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0],  # turn, tool result, answer, padding
                         [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # one turn
                         [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
                         [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    # token rewards (kl_coef 0.1) on the 1s only, the score added at the last 1:
    # row 0: [-.05, 0, -.1, ., ., ., -.2, -.1 + 1, 0] -> returns [.55, .6, .6, .7, .7, .7, .7, .9, 0]
    # row 1: [-.1, -.1 + 2] -> [1.8, 1.9]; row 2: [0, -.3, ., -.1, -.2 + .5] -> [-.1, -.1, .2, .2, .3]
    # row 3: [-.1, ., ., -.1 + 4] -> [3.8, 3.9, 3.9, 3.9]; baselines (k = 2): the other sample's first return
    advantages = rloo.token_level_advantages(scores, kl, mask, kl_coef=0.1, k=2)
    returns = torch.tensor([[.55, .6, .6, .7, .7, .7, .7, .9, 0], [1.8, 1.9, 0, 0, 0, 0, 0, 0, 0],
                            [-.1, -.1, .2, .2, .3, 0, 0, 0, 0], [3.8, 3.9, 3.9, 3.9, 0, 0, 0, 0, 0]])
    baselines = torch.tensor([1.8, .55, 3.8, -.1])[:, None]
    assert torch.allclose(advantages, (returns - baselines) * mask, atol=1e-6)
    assert advantages[0, 6:8].tolist() == pytest.approx([0.7 - 1.8, 0.9 - 1.8])  # the answer after the tool result


def test_clipped_surrogate_against_hand_values():
    logps = torch.tensor([[0.0, -1.0], [-2.0, -1.0]])
    old = torch.tensor([[-0.5, -1.0], [-1.0, -1.0]])
    advantages, mask = torch.tensor([2.0, -1.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, ratio, clipped = rloo.rloo_loss(logps, old, advantages, mask, cliprange=0.2)
    e = 2.718281828459045
    # token 1: ratio e^0.5 = 1.6487 > 1.2, A = 2: max(-3.297, -2.4) = -2.4 (clipped)
    # token 2: ratio 1: -2; token 3: ratio e^-1 = 0.368 < 0.8, A = -1: max(0.368, 0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-2.4 - 2.0 + 0.8) / 3, rel=1e-5)
    assert ratio[0, 0].item() == pytest.approx(e ** 0.5) and clipped.tolist() == [[True, False], [True, False]]


def new_loss(loss_type, **kw):
    """The cispo / sapo losses on the data above (ratios e^0.5 = 1.6487 with A = 2, 1 with A = 2, e^-1 with A = -1)."""
    logps = torch.tensor([[0.0, -1.0], [-2.0, -1.0]], requires_grad=True)
    loss, _, clipped = rloo.rloo_loss(logps, torch.tensor([[-0.5, -1.0], [-1.0, -1.0]]), torch.tensor([2.0, -1.0]),
                                      torch.tensor([[1.0, 1.0], [1.0, 0.0]]), cliprange=0.2, loss_type=loss_type, **kw)
    loss.backward()
    return loss.item(), sum(logps.grad.tolist(), []), clipped.tolist()


def test_cispo_hand_worked_value_and_gradient():
    # weights sg(min(r, 1.2)) = 1.2 (clipped), 1, e^-1 (no lower bound); loss -w A logp over 3 tokens:
    # -(1.2 * 2 * 0 + 2 * -1 + e^-1 * -1 * -2) / 3 = 0.42141; d/dlogp = -w A / 3 (stop-gradient: the
    # r = 1 token would otherwise get -(1 + logp) A / 3 = 0), so the clipped token keeps -0.8
    w = math.exp(-1)
    value, grad, clipped = new_loss("cispo")
    assert value == pytest.approx(-(2 * -1 + w * -1 * -2) / 3, rel=1e-6) and value == pytest.approx(0.42141, abs=1e-5)
    assert grad == pytest.approx([-1.2 * 2 / 3, -2 / 3, w / 3, 0.0], rel=1e-6)
    assert clipped == [[True, False], [False, False]]


def test_sapo_hand_worked_value_and_gradient():
    # -4 / tau * sigmoid(tau (r - 1)) * A, tau 1 for A = 2 and 2 for A = -1, mean over 3 tokens:
    # (-8 sigmoid(0.6487) - 4 + 2 sigmoid(2 (e^-1 - 1))) / 3 = (-5.2538 - 4 + 0.4405) / 3 = -2.9378
    def sig(x):
        return 1 / (1 + math.exp(-x))

    def g(r, tau, a):  # -A * 4 s (1 - s) * r / 3
        s = sig(tau * (r - 1))
        return -a * 4 * s * (1 - s) * r / 3
    r0, r2 = math.exp(0.5), math.exp(-1)
    value, grad, clipped = new_loss("sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=2.0)
    assert value == pytest.approx((-8 * sig(r0 - 1) - 4 + 2 * sig(2 * (r2 - 1))) / 3, rel=1e-6)
    assert value == pytest.approx(-2.93776, abs=1e-5)
    assert grad == pytest.approx([g(r0, 1, 2), g(1, 1, 2), g(r2, 2, -1), 0.0], rel=1e-6)
    assert grad[1] == pytest.approx(-2 / 3)
    assert clipped == [[False, False], [False, False]]


def test_whiten():
    values = torch.tensor([1.0, 2.0, 3.0, 10.0])
    white = rloo.whiten(values)
    assert white.mean().item() == pytest.approx(0, abs=1e-6) and white.std().item() == pytest.approx(1, rel=1e-5)
    masked = rloo.whiten(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    # mean 2, std sqrt(2) over the two real entries; the padding stays 0
    assert masked[0].tolist() == pytest.approx([-1 / 2 ** 0.5, 1 / 2 ** 0.5, 0.0], rel=1e-5)


def test_rollout_not_divisible_by_k_fails_before_loading(tmp_path):
    with pytest.raises(UserError, match="= 10 completions per rollout, which must be a multiple of rloo_k 4"):
        rloo.main(rloo.Args(model_name_or_path=str(tmp_path / "nothing"), per_device_train_batch_size=5,
                            num_mini_batches=2, output_dir=str(tmp_path / "out")))


@pytest.mark.long  # 17 s or more: in .ci/run's lane 1, out of the default suite
def test_rloo_learns_a_toy_reward(tmp_path, sft_model):
    out = str(tmp_path / "rloo")
    run_script("algos/rloo.py", "--model_name_or_path", sft_model, "--reward_model_paths",
               "--reward_funcs", "tests.toy_rewards:short", "--max_steps", "10", "--per_device_train_batch_size", "8",
               "--num_mini_batches", "2", "--rloo_k", "4", "--learning_rate", "2e-3", "--max_completion_length", "16",
               "--token_level_kl", "--normalize_advantages", "--missing_eos_penalty", "1.0",
               "--output_dir", out)
    log = read_log(out)
    names = {"objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
             "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "val/ratio",
             "val/ratio_var", "val/num_eos_tokens", "lr", "episode", "eps"}
    assert names <= set(log[0]) and log[0]["objective/kl"] == pytest.approx(0.0, abs=1e-4)
    first, last = [statistics.mean(r["objective/scores"] for r in rows) for rows in (log[:3], log[-3:])]
    assert last > first + 1.0, (first, last)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("token_level", [False, True], ids=["default", "token_level_kl_whitened"])
def test_first_step_gradient_against_the_advantages_written_out(tmp_path, tiny_model, monkeypatch, token_level):
    """rloo.py on fixed samples, with a reward that leaves some unscored and a perturbed reference: the
    gradient of its first step (ratio 1: -A grad log pi over the scored rows' tokens, divided by their
    count) against the advantages worked out here, row by row. default: its defaults, A_i = R_i - the
    mean R of the other scored rows of its prompt, R = score - kl_coef * sum_t KL_t; the score's part and
    the KL penalty's part are each checked. token_level_kl_whitened (--token_level_kl
    --normalize_advantages): A_it = return-to-go minus the leave-one-out mean of the others' whole
    returns, whitened over the scored rows' real tokens only (no padding, no unscored row)."""
    from tests.first_step import assert_gradient, gradient, grads_of, online_first_step, own_logprobs
    args = rloo.Args(model_name_or_path=tiny_model, reward_model_paths=[],
                     reward_funcs=["tests.toy_rewards:short_or_none"],
                     per_device_train_batch_size=12, max_completion_length=8, token_level_kl=token_level,
                     normalize_advantages=token_level, temperature=0.7, output_dir=str(tmp_path / "rloo"))
    record, tokenizer, policy, ref, prompts, completions, _ = online_first_step(monkeypatch, rloo, args, tiny_model)
    assert len({len(c) for c in completions}) > 1  # padding in the batch
    words = [len(tokenizer.decode(c, skip_special_tokens=True).split()) for c in completions]
    scores = [None if w % 2 else -float(w) for w in words]  # short_or_none
    assert None in scores
    logps = [own_logprobs(policy, p, c, args.temperature) for p, c in zip(prompts, completions)]
    with torch.no_grad():
        kl = [lp.detach() - own_logprobs(ref, p, c, args.temperature) for lp, p, c in zip(logps, prompts, completions)]
    k, n = args.rloo_k, len(completions)

    def others(i):  # the other scored rows of row i's prompt
        return [j for j in range(i - i % k, i - i % k + k) if j != i and scores[j] is not None]

    tokens = sum(len(c) for c, s in zip(completions, scores) if s is not None)
    if not token_level:  # -A_i grad sum_t log pi, A_i split into the score's and the KL penalty's parts
        terms = {"score": 0.0, "kl penalty": 0.0}
        for i in range(n):
            if scores[i] is None or not others(i):
                continue
            a_score = scores[i] - statistics.mean(scores[j] for j in others(i))
            a_kl = -args.kl_coef * (kl[i].sum().item() - statistics.mean(kl[j].sum().item() for j in others(i)))
            terms["score"] = terms["score"] - a_score * logps[i].sum() / tokens
            terms["kl penalty"] = terms["kl penalty"] - a_kl * logps[i].sum() / tokens
    else:  # token rewards -kl_coef KL_t, the score on the last token; returns to go; whole returns' baseline
        returns = [None if s is None else (-args.kl_coef * kl[i]).flip(0).cumsum(0).flip(0) + s
                   for i, s in enumerate(scores)]
        advantages = [returns[i] - statistics.mean(returns[j][0].item() for j in others(i)) if others(i)
                      else torch.zeros(len(completions[i])) for i in range(n) if scores[i] is not None]
        real = torch.cat(advantages)  # the scored rows' real tokens (a row with no scored sibling: 0)
        assert len(real) == tokens < n * args.max_completion_length
        white = [(a - real.mean()) / (real.std() + 1e-8) for a in advantages]
        scored_logps = [lp for lp, s in zip(logps, scores) if s is not None]
        terms = {"whitened token advantages": sum(-(a * lp).sum() for a, lp in zip(white, scored_logps)) / tokens}
    assert_gradient(grads_of(record), {name: gradient(t, policy) for name, t in terms.items()})


RECORDED = []  # what tests.test_rloo:recorded was given, call by call


def recorded(prompts, completions, **columns):
    """A reward function that records its arguments; the words of each completion's one message."""
    RECORDED.append(dict(prompts=prompts, completions=completions, **columns))
    return [float(len(c[0]["content"].split())) for c in completions]


@pytest.mark.usefixtures("one_torch_thread")
def test_the_base_path_seeds_each_completion_by_its_place_and_scores_conversations_as_messages(tmp_path, tiny_model,
                                                                                               monkeypatch):
    """The rollout rloo.py writes out for a run without features (issue 56; tests/test_base_path.py: it enters no
    feature module): HF generate with a seed per completion from its place in the run (seed x 10^9 + completions
    before it + j, as common/rollouts.py numbers them), each conversational completion given to reward functions
    as one assistant message holding its decoded text, with the data's other columns; no feature's metric logged."""
    from common.models import load_tokenizer
    from tests.first_step import write_splits

    calls, generate = [], rloo.generate

    def recording(*a, **k):
        calls.append((k["seeds"], generate(*a, **k)))
        return calls[-1][1]
    monkeypatch.setattr(rloo, "generate", recording)
    template = tmp_path / "template.jinja"
    template.write_text(open(os.path.join(ROOT, "configs", "chatml_tools.jinja")).read().replace(
        "<|im_end|>", "<|endoftext|>"))
    rows = [{"prompt": [{"role": "user", "content": f"Say {a}."}], "answer": a} for a in ("one", "two", "three", "4")]
    args = rloo.Args(model_name_or_path=tiny_model, dataset_name=write_splits(tmp_path / "data", rows), seed=3,
                     chat_template_path=str(template), reward_model_paths=[], reward_funcs=["tests.test_rloo:recorded"],
                     per_device_train_batch_size=3, num_mini_batches=2, rloo_k=2, max_steps=2,
                     max_completion_length=6, temperature=0.7, output_dir=str(tmp_path / "out"))
    RECORDED.clear()
    rloo.main(args)
    assert [seeds for seeds, _ in calls] == [[3 * 10**9 + 6 * step + j for j in range(6)] for step in range(2)]
    tokenizer = load_tokenizer(tiny_model)
    assert len(RECORDED) == 2
    for (_, samples), given in zip(calls, RECORDED):
        texts = tokenizer.batch_decode(samples.completion_ids, skip_special_tokens=True)
        assert given["completions"] == [[{"role": "assistant", "content": t}] for t in texts]
        assert given["answer"] == [p[0]["content"][4:-1] for p in given["prompts"]]
    log = read_log(args.output_dir)
    features = ("vllm", "async", "tools", "episodes", "sampling")
    assert len(log) == 2 and not [k for k in log[0] if k.split("/")[0] in features]


@pytest.mark.usefixtures("one_torch_thread")
def test_max_staleness_alone_draws_each_rollout_ahead(tmp_path, tiny_model):
    """--max_staleness 1 without vLLM or tools still leaves the base path: the second rollout was drawn by the
    weights before the first update (staleness 0, then 1; tests/test_async.py has the numbers)."""
    out = str(tmp_path / "out")
    rloo.main(script_args(rloo.Args, model_name_or_path=tiny_model, reward_model_paths=[],
                          reward_funcs=["tests.toy_rewards:short"], per_device_train_batch_size=4, rloo_k=2,
                          max_steps=2, max_completion_length=4, max_staleness=1, num_ppo_epochs=1, temperature=0.9,
                          output_dir=out))
    assert [r["async/staleness"] for r in read_log(out)] == [0, 1]
