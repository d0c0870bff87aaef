"""algos/kto.py: the KTO and APO-zero losses against hand-derived values, the KL reference point,
pair conversion, the mismatched KL batch, and short end-to-end runs."""

import json
import math
import statistics

import pytest
import torch

from algos import kto
from tests.conftest import run_script
from tests.test_sft import read_log


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_kto_loss_hand_derived():
    logps, ref = torch.tensor([-2.0, -5.0, -3.0]), torch.tensor([-3.0, -4.0, -3.5])
    labels = torch.tensor([True, False, False])
    beta, z0, w_d, w_u = 0.5, 0.2, 1.5, 0.8
    losses, rewards = kto.kto_loss(logps, ref, labels, z0, beta=beta, desirable_weight=w_d, undesirable_weight=w_u)
    # r = log-ratio: 1, -1, 0.5; desirable: w_d (1 - sig(beta (r - z0))); undesirable: w_u (1 - sig(beta (z0 - r)))
    expected = [w_d * (1 - sig(0.5 * 0.8)), w_u * (1 - sig(0.5 * 1.2)), w_u * (1 - sig(0.5 * -0.3))]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert rewards.tolist() == pytest.approx([0.5, -0.5, 0.25])


def test_kto_hand_worked_example():
    # r = 0 and z0 = 0: every completion is worth sigmoid(0) = 1/2, so the loss is 1/2
    losses, _ = kto.kto_loss(torch.zeros(2), torch.zeros(2), torch.tensor([True, False]), 0.0, beta=0.1)
    assert losses.tolist() == [0.5, 0.5]


def test_apo_zero_unpaired_ignores_the_reference_point():
    logps, ref, labels = torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -2.0]), torch.tensor([True, False])
    losses, _ = kto.kto_loss(logps, ref, labels, kl=5.0, beta=2.0, loss_type="apo_zero_unpaired")
    # r = 1: desirable 1 - sig(2), undesirable sig(2)
    assert losses.tolist() == pytest.approx([1 - sig(2.0), sig(2.0)], rel=1e-6)


def test_kl_reference_point_is_a_clamped_detached_mean():
    logps = torch.tensor([-1.0, -2.0, -4.0], requires_grad=True)
    z0 = kto.kl_reference_point(logps, torch.tensor([-2.0, -2.0, -2.0]))
    assert z0.item() == 0.0 and not z0.requires_grad  # mean log-ratio (1 + 0 - 2) / 3 < 0 -> clamped
    z0 = kto.kl_reference_point(torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -4.0]))
    assert z0.item() == pytest.approx(2.0)


def test_pairs_become_one_desirable_and_one_undesirable_row():
    rows = [{"prompt": "p", "chosen": " good", "rejected": " bad"}]
    assert list(kto.unpaired_rows(rows, "preference")) == [("p", " good", True), ("p", " bad", False)]
    rows = [{"prompt": "p", "completion": " ok", "label": False}]
    assert list(kto.unpaired_rows(rows, "unpaired")) == [("p", " ok", False)]


def test_kl_batch_pairs_each_prompt_with_the_previous_completion():
    examples = [([1, 2], [10, 0], True), ([3], [11, 12, 0], False), ([4, 5, 6], [13, 0], True)]
    (ids, mask, cmask), (kl_ids, kl_mask, kl_cmask), labels = kto.collate(examples, pad_id=9, max_length=4)
    assert labels.tolist() == [True, False, True]
    assert ids[1].tolist() == [3, 11, 12, 0, 9] and cmask[1].tolist() == [0, 1, 1, 1, 0]
    # row 0 takes the last completion, row 2 the second, cut to max_length
    assert kl_ids.tolist() == [[1, 2, 13, 0], [3, 10, 0, 9], [4, 5, 6, 11]]
    assert kl_cmask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 0], [0, 0, 0, 1]]


def test_labels_and_empty_completions(tokenizer):
    limits = type("A", (), {"max_prompt_length": 64, "max_completion_length": 64, "max_length": 128})
    rows = [("p", " fine", True), ("p", " fine", 1), ("p", "  ", True), ("p", " x", "yes")]
    examples, skipped = kto.tokenize(rows, tokenizer, limits)
    assert [label for _, _, label in examples] == [True, True]
    assert skipped == {"empty completion": 1, "label not true/false": 1}


def test_kto_end_to_end_on_unpaired_data_prints_the_weight_hint(tmp_path, sft_model):
    rows = [{"prompt": f"TITLE: post {i}\n\nTL;DR:", "completion": f" summary {i}" if i % 4 else f" bad bad {i}",
             "label": bool(i % 4)} for i in range(32)]
    data = tmp_path / "unpaired.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "kto")
    proc = run_script("algos/kto.py", "--model_name_or_path", sft_model, "--dataset_name", str(data),
                      "--dataset_test_split", "train", "--max_steps", "30", "--per_device_train_batch_size", "8",
                      "--learning_rate", "1e-3", "--eval_steps", "30", "--num_sample_generations", "1",
                      "--output_dir", out)
    # 24 desirable vs 8 undesirable at equal weights: ratio 3, the paper wants [1, 4/3]
    assert "hint: desirable_weight" in proc.stdout and "between 0.33 and 0.44" in proc.stdout
    log = read_log(out)
    assert {"loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl"} <= set(log[0])
    assert log[0]["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    # trained and evaluated on the same rows: desirable completions gain, undesirable ones lose
    assert log[-1]["eval_rewards/chosen"] > 0.1 > -0.1 > log[-1]["eval_rewards/rejected"]
    assert log[-1]["eval_loss"] < log[0]["loss"]


@pytest.mark.usefixtures("one_torch_thread")
def test_default_first_step_gradient_against_the_loss_written_out(tmp_path, tiny_model, monkeypatch):
    """kto.py at its defaults (kto, beta 0.1, weights 1) on 4 fixed preference pairs, i.e. 8 rows in one
    batch, with a perturbed reference: the gradient of its first step against the loss written out here,
    every sequence scored alone. z0 = max(0, mean over rows of log pi / pi_ref of prompt i with the
    completion of the row before it in the batch), no gradient through it; the desirable rows' part
    1 - sigmoid(beta (r - z0)) and the undesirable rows' 1 - sigmoid(beta (z0 - r)) are each checked."""
    from common.models import load_tokenizer
    from tests.first_step import (PAIRS, assert_gradient, encode, gradient, gradients_before_clipping, grads_of,
                                  own_logprobs, perturbed_reference, policy_with, weights_of, write_splits)
    loaded, batches, collate = perturbed_reference(monkeypatch, kto), [], kto.collate
    monkeypatch.setattr(kto, "collate", lambda examples, *a: batches.append(list(examples)) or collate(examples, *a))
    args = kto.Args(model_name_or_path=tiny_model, dataset_name=write_splits(tmp_path / "pairs", PAIRS),
                    per_device_train_batch_size=8, output_dir=str(tmp_path / "kto"))
    (record,) = gradients_before_clipping(monkeypatch, kto.main, args)
    tokenizer = load_tokenizer(tiny_model)
    policy, ref, rows = policy_with(tiny_model, tokenizer, weights_of(record)), loaded[1], batches[0]
    # the batch holds the pairs' rows (in the order the script drew them: it decides the KL rows)
    assert sorted(rows) == sorted((*encode(tokenizer, r["prompt"], r[k]), k == "chosen")
                                  for r in PAIRS for k in ("chosen", "rejected"))

    def ratio(model, p, c):
        return own_logprobs(model, p, c).sum() - own_logprobs(ref, p, c).sum().detach()

    with torch.no_grad():
        z0 = max(0.0, statistics.mean(ratio(policy, p, rows[i - 1][1]).item() for i, (p, _, _) in enumerate(rows)))
    assert z0 > 0.1  # the reference point is in play
    desirable = undesirable = 0.0
    for p, c, label in rows:
        r = ratio(policy, p, c)
        if label:
            desirable = desirable + (1 - torch.sigmoid(args.beta * (r - z0))) / len(rows)
        else:
            undesirable = undesirable + (1 - torch.sigmoid(args.beta * (z0 - r))) / len(rows)
    assert_gradient(grads_of(record), {"desirable": gradient(desirable, policy),
                                       "undesirable": gradient(undesirable, policy)})
