"""common/packing.py (issue 57, in progress): a packed pass gives the padded pass's per-token values and gradient,
and no row sees another."""

import json

import pytest
import torch

from common.generation import completion_logps
from common.models import load_policy
from common.packing import pack, packed_completion_logps
from tests.test_per_token_passes import COMPLETIONS, PROMPTS, TEMPERATURE, left_padded


def test_pack_keeps_the_real_tokens_in_order_with_positions_restarting_per_row():
    ids = torch.tensor([[0, 0, 5, 6, 7], [0, 8, 9, 0, 0], [1, 2, 3, 4, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    packed, positions, place = pack(ids, mask)
    assert packed.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert place.tolist() == [[-1, -1, 0, 1, 2], [-1, 3, 4, -1, -1], [5, 6, 7, 8, -1]]


@pytest.mark.parametrize("truncation", [{}, dict(top_k=3)], ids=["full", "top_k"])
def test_packed_logps_entropy_and_gradient_equal_the_padded_pass(tiny_model, tokenizer, truncation):
    input_ids, attention_mask, width = left_padded(PROMPTS, COMPLETIONS, tokenizer.pad_token_id)
    real = attention_mask[:, width:].bool()
    results = []
    for fn in (completion_logps, packed_completion_logps):
        policy = load_policy(tiny_model, tokenizer).eval()
        logps, entropy = fn(policy, input_ids, attention_mask, width, TEMPERATURE, entropy=True, **truncation)
        (logps * real * torch.arange(1, real.shape[1] + 1)).sum().backward()  # weights differ per position
        results.append((logps[real], entropy[real], [p.grad.clone() for p in policy.parameters()]))
    (lp_a, h_a, g_a), (lp_b, h_b, g_b) = results
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(h_b, h_a, atol=1e-5, rtol=0)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_a_rows_tokens_change_no_other_rows_packed_logps(tiny_model, tokenizer):
    policy = load_policy(tiny_model, tokenizer).eval()
    input_ids, attention_mask, width = left_padded(PROMPTS, COMPLETIONS, tokenizer.pad_token_id)
    with torch.no_grad():
        before = packed_completion_logps(policy, input_ids, attention_mask, width, TEMPERATURE)
        changed = input_ids.clone()
        changed[2, width:width + 2] += 7  # row 2's completion (it sits between rows 1 and 3 in the packed row)
        after = packed_completion_logps(policy, changed, attention_mask, width, TEMPERATURE)
    others = [0, 1, 3]
    assert torch.equal(after[others], before[others])
    assert not torch.equal(after[2], before[2])


@pytest.mark.parametrize("rows", ["text", "prompt-completion"])
def test_an_sft_step_padding_free_gives_the_padded_steps_loss_and_gradient(tmp_path, tiny_model, rows):
    """One step of sft.py on rows of very different lengths, padded and padding-free: the logged loss and gradient
    norm agree to 1e-5. Text rows learn every token, so a row's first token must stay out of the packed loss (the
    last token of the row before it would predict it)."""
    from algos import sft
    from tests.conftest import script_args
    from tests.test_sft import read_log
    words = ["one", "two three four five six seven eight nine ten eleven twelve", "a b",
             "c d e f g h i j k l m n o p q", "r", "s t u v", "w x y z " * 6, "alpha beta gamma"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": w} if rows == "text" else
                                       {"prompt": w + " TL;DR:", "completion": " " + w[:9]}) + "\n" for w in words))
    logged = []
    for padding_free in (False, True):
        out = tmp_path / f"out_{padding_free}"
        sft.main(script_args(sft.Args, model_name_or_path=tiny_model, dataset_name=str(data), dataset_test_split="",
                             per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1,
                             logging_steps=1, num_sample_generations=0, padding_free=padding_free,
                             output_dir=str(out)))
        logged.append(read_log(str(out))[0])
    padded, packed_run = logged
    assert packed_run["loss"] == pytest.approx(padded["loss"], rel=1e-5)
    assert packed_run["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)


def test_dpo_pairs_padding_free_give_the_padded_logps_counts_mean_logits_and_gradient(tiny_model, tokenizer):
    """dpo.py's forward_pairs, padded and padding-free, on pairs whose prompts and completions differ in length."""
    from algos import dpo
    examples = [([5, 6, 7, 8, 9, 10], [20, 21, 22], [23]), ([11, 12], [24, 25, 26, 27, 28, 29], [30, 31]),
                ([13, 14, 15], [32], [33, 34, 35, 36])]
    batch = dpo.collate(examples, tokenizer.pad_token_id)
    results = []
    for padding_free in (False, True):
        policy = load_policy(tiny_model, tokenizer).eval()
        chosen, rejected, counts, mean_logits = dpo.forward_pairs(policy, batch, False, padding_free)
        (chosen * torch.tensor([1.0, 2.0, 3.0]) - rejected * torch.tensor([0.5, 1.5, 2.5])).sum().backward()
        results.append((chosen, rejected, torch.stack(counts), torch.stack(mean_logits),
                        [p.grad.clone() for p in policy.parameters()]))
    for a, b in zip(*results):
        for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            torch.testing.assert_close(y.detach(), x.detach(), atol=1e-5, rtol=1e-4)
    assert results[0][2].tolist() == [[3, 6, 1], [1, 2, 4]]  # the completions' lengths, chosen then rejected


@pytest.mark.parametrize("script", ["kto", "dpo"])
def test_a_preference_step_padding_free_gives_the_padded_steps_loss_and_gradient(tmp_path, tiny_model, script):
    """One step of kto.py (its KL reference point from mismatched pairs too) and of dpo.py on the tiny task's
    preference pairs, padded and padding-free: the logged loss, the kl or reward margin, and the gradient norm agree
    to 1e-5."""
    import importlib
    from tests.conftest import script_args
    from tests.test_sft import read_log
    module = importlib.import_module(f"algos.{script}")
    logged = []
    for padding_free in (False, True):
        out = tmp_path / f"out_{padding_free}"
        module.main(script_args(module.Args, model_name_or_path=tiny_model, dataset_name="tiny_tldr/tldr-preference",
                                per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1,
                                logging_steps=1, num_sample_generations=0, eval_steps=10, dataset_test_split="",
                                padding_free=padding_free, output_dir=str(out)))
        logged.append(read_log(str(out))[0])
    padded, packed_run = logged
    keys = ["loss", "grad_norm", "kl" if script == "kto" else "rewards/margins"]
    assert {k: packed_run[k] for k in keys} == pytest.approx({k: padded[k] for k in keys}, rel=1e-5, abs=1e-5)


def test_an_rloo_step_padding_free_gives_the_padded_steps_values(tmp_path, tiny_model):
    """rloo.py's first step, padded and padding-free (the old, reference and training passes packed): the same
    samples, and the logged policy loss, kl, entropy and gradient norm agree to 1e-5."""
    from algos import rloo
    from tests.conftest import script_args
    from tests.test_sft import read_log
    logged = []
    for padding_free in (False, True):
        out = tmp_path / f"out_{padding_free}"
        rloo.main(script_args(rloo.Args, model_name_or_path=tiny_model, reward_model_paths=[],
                              reward_funcs=["tests.toy_rewards:short"], per_device_train_batch_size=4, rloo_k=2,
                              max_steps=1, max_completion_length=12, num_ppo_epochs=2, temperature=0.7,
                              padding_free=padding_free, output_dir=str(out)))
        logged.append(read_log(str(out))[0])
    padded, packed_run = logged
    keys = ["loss/policy_avg", "objective/kl", "objective/entropy", "grad_norm", "completions/mean_length"]
    assert {k: packed_run[k] for k in keys} == pytest.approx({k: padded[k] for k in keys}, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("loss_type", ["jsd", "token_reward"])
def test_a_gkd_step_padding_free_gives_the_padded_steps_values(tmp_path, tiny_model, sft_model, loss_type):
    """gkd.py's first step on its own samples and the dataset's completions, padded and padding-free (the student's
    and the teacher's logits on the completion tokens of one packed row): loss, kl, the student's and teacher's
    log-probs and the gradient norm agree to 1e-5."""
    from algos import gkd
    from tests.conftest import script_args
    from tests.test_sft import read_log
    logged = []
    for padding_free in (False, True):
        out = tmp_path / f"out_{padding_free}"
        gkd.main(script_args(gkd.Args, model_name_or_path=tiny_model, teacher_model_name_or_path=sft_model,
                             per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1,
                             lmbda=1.0 if loss_type == "token_reward" else 0.5,
                             max_new_tokens=8, loss_type=loss_type, padding_free=padding_free, output_dir=str(out)))
        logged.append(read_log(str(out))[0])
    padded, packed_run = logged
    keys = ["loss", "objective/kl", "logps/student", "logps/teacher", "grad_norm", "on_policy_ratio"]
    assert {k: packed_run[k] for k in keys} == pytest.approx({k: padded[k] for k in keys}, rel=1e-5, abs=1e-6)
    assert abs(padded["objective/kl"]) > 1e-3 and padded["grad_norm"] > 1e-3  # the teacher differs: values to match


def test_an_online_dpo_step_padding_free_gives_the_padded_steps_values(tmp_path, tiny_model, sft_model):
    """online_dpo.py's first step, padded and padding-free (policy and reference passes packed; a reference that
    differs from the policy): loss, reward margin and gradient norm agree to 1e-5."""
    from algos import online_dpo
    from tests.conftest import script_args
    from tests.test_sft import read_log
    logged = []
    for padding_free in (False, True):
        out = tmp_path / f"out_{padding_free}"
        online_dpo.main(script_args(online_dpo.Args, model_name_or_path=sft_model, reward_model_paths=[],
                                    reward_funcs=["tests.toy_rewards:short"], per_device_train_batch_size=4,
                                    max_steps=2, max_new_tokens=12, padding_free=padding_free, output_dir=str(out)))
        logged.append(read_log(str(out))[-1])
    padded, packed_run = logged
    keys = ["loss", "grad_norm", "rewards/margins"]
    assert {k: packed_run[k] for k in keys} == pytest.approx({k: padded[k] for k in keys}, rel=1e-5, abs=1e-6)
    assert abs(padded["rewards/margins"]) > 1e-6  # step 2: the policy has moved from its reference


def test_grpo_steps_padding_free_give_the_padded_steps_values(tmp_path, tiny_model):
    """grpo.py's two steps on one generation batch (num_iterations 2: the sampling-time pass, the reference's with
    beta 0.3 and the training passes packed), padded and padding-free: loss, kl, entropy, clipped shares and the
    gradient norm agree to 1e-5."""
    from algos import grpo
    from tests.conftest import script_args
    from tests.test_sft import read_log
    logged = []
    for padding_free in (False, True):
        out = tmp_path / f"out_{padding_free}"
        grpo.main(script_args(grpo.Args, model_name_or_path=tiny_model, reward_model_paths=[],
                              reward_funcs=["tests.toy_rewards:short"], per_device_train_batch_size=4,
                              gradient_accumulation_steps=2, num_generations=4, max_completion_length=12,
                              num_iterations=2, beta=0.3, temperature=0.7, learning_rate=1e-2, max_steps=2,
                              padding_free=padding_free, output_dir=str(out)))
        logged.append(read_log(str(out)))
    keys = ["loss", "kl", "entropy", "grad_norm", "clip_ratio/region_mean"]
    for padded, packed_run in zip(*logged):
        assert {k: packed_run[k] for k in keys} == pytest.approx({k: padded[k] for k in keys}, rel=1e-5, abs=1e-6)
    assert logged[0][1]["kl"] > 1e-6  # the second step's policy has moved from its reference
