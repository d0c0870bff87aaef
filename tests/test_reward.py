"""algos/reward.py: the Bradley-Terry loss against hand-computed values, batching, end to end."""

import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from algos.reward import collate, reward_loss, tokenize
from tests.conftest import run_script
from tests.test_sft import read_log


def test_bradley_terry_loss_hand_computed():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    # -log sigmoid(1) and -log sigmoid(-1), averaged
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1))) / 2
    assert reward_loss(chosen, rejected).item() == pytest.approx(expected, rel=1e-6)


def test_margin_and_centering_hand_computed():
    chosen, rejected, margin = torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([0.5])
    # -log sigmoid(2 - 1 - 0.5) + 0.1 * (2 + 1)^2
    expected = math.log(1 + math.exp(-0.5)) + 0.1 * 9
    assert reward_loss(chosen, rejected, margin, 0.1).item() == pytest.approx(expected, rel=1e-6)


def test_pairs_batch_chosen_then_rejected(tokenizer):
    rows = [{"prompt": "TITLE: a\n\nTL;DR:", "chosen": " good", "rejected": " bad one", "margin": 2.0},
            {"prompt": "TITLE: b\n\nTL;DR:", "chosen": " same", "rejected": " same"}]
    examples, skipped = tokenize(rows, tokenizer, max_length=64)
    assert skipped == 1  # chosen == rejected carries no signal
    input_ids, attention_mask, margin = collate(examples, tokenizer.pad_token_id)
    assert input_ids.shape[0] == 2 and margin.tolist() == [2.0]
    # left-padded: every row's last position is its EOS, where the score is read
    assert (input_ids[:, -1] == tokenizer.eos_token_id).all() and attention_mask[:, -1].all()
    assert attention_mask[0, 0] == 0  # the shorter chosen row is padded at the start
    assert tokenizer.decode(input_ids[1][attention_mask[1].bool()], skip_special_tokens=True).endswith(" bad one")


def test_reward_end_to_end_saves_a_loadable_classifier(tmp_path, sft_model):
    out = str(tmp_path / "rm")
    proc = run_script("algos/reward.py", "--model_name_or_path", sft_model, "--max_steps", "3",
                      "--per_device_train_batch_size", "4", "--eval_steps", "3", "--output_dir", out)
    assert "held-out preference accuracy" in proc.stdout
    log = read_log(out)
    assert len(log) == 3 and 0.0 <= log[-1]["eval_accuracy"] <= 1.0
    assert {"loss", "accuracy", "rewards/chosen", "rewards/rejected", "rewards/margins"} <= set(log[0])
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None


def test_reward_learns_a_small_preference_set(tmp_path, sft_model):
    """Trained and evaluated on the same small set, the model must separate chosen from rejected."""
    out = str(tmp_path / "rm")
    run_script("algos/reward.py", "--model_name_or_path", sft_model, "--max_steps", "30",
               "--per_device_train_batch_size", "8", "--dataset_train_split", "validation",
               "--dataset_test_split", "validation", "--eval_steps", "30", "--learning_rate", "1e-3",
               "--output_dir", out)
    log = read_log(out)
    # an indifferent reward model has loss log 2 and accuracy 0.5 (chance)
    assert log[-1]["eval_loss"] < math.log(2) - 0.05 and log[-1]["eval_accuracy"] > 0.6, log[-1]
