"""algos/reward.py: the Bradley-Terry loss against hand-computed values, batching, end to end."""

import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from algos import reward
from algos.reward import Args, collate, reward_loss, rewards_of, tokenize
from benchmarks import tiny_tldr
from common.data import load_split
from common.models import load_tokenizer
from tests.conftest import run_script
from tests.test_sft import read_log


def test_bradley_terry_loss_hand_computed():
    chosen, rejected = torch.tensor([2.0, 0.5]), torch.tensor([1.0, 1.0])
    # -log sigmoid(1) and -log sigmoid(-0.5), averaged (not symmetric: swapping the two changes it)
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(0.5))) / 2
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
    assert skipped == {"chosen == rejected": 1}  # it carries no signal
    input_ids, attention_mask, margin, width = collate(examples, tokenizer.pad_token_id)
    assert input_ids.shape[0] == 2 and margin.tolist() == [2.0]
    # left-padded: every row's last position is its EOS, where the score is read
    assert (input_ids[:, -1] == tokenizer.eos_token_id).all() and attention_mask[:, -1].all()
    # the pair's rows hold the same prompt block, then their completions, the shorter padded at its start
    assert torch.equal(input_ids[0, :width], input_ids[1, :width]) and attention_mask[0, width] == 0
    assert tokenizer.decode(input_ids[1][attention_mask[1].bool()], skip_special_tokens=True).endswith(" bad one")


def test_pair_scores_equal_each_row_scored_alone(tokenizer, rm_model):
    """The prompt block runs once per pair (shared cache): each score must still be the one the
    classifier gives the row alone, unpadded."""
    rows = [{"prompt": f"TITLE: {t}\n\nPOST: {p}\n\nTL;DR:", "chosen": c, "rejected": r}
            for t, p, c, r in [("a", "my cat ate my cake", " cat ate cake", " cake"),
                               ("bb", "we went to the park", " park trip with friends today", " we"),
                               ("c", "x", " y", " z z")]]
    examples, _ = tokenize(rows, tokenizer, max_length=128)
    model = AutoModelForSequenceClassification.from_pretrained(rm_model).eval()
    chosen, rejected, _ = rewards_of(model, collate(examples, tokenizer.pad_token_id), "cpu")
    for (p, c, r, _), got_c, got_r in zip(examples, chosen, rejected):
        for completion, got in ((c, got_c), (r, got_r)):
            alone = model(input_ids=torch.tensor([p + completion])).logits[0, 0]
            assert torch.allclose(got, alone, atol=1e-5)


@pytest.mark.long  # 17 s or more: in .ci/run's lane 1, out of the default suite
def test_reward_end_to_end_saves_a_loadable_classifier(tmp_path, sft_model):
    out = str(tmp_path / "rm")
    proc = run_script("algos/reward.py", "--model_name_or_path", sft_model, "--max_steps", "3",
                      "--per_device_train_batch_size", "4", "--eval_steps", "3", "--output_dir", out)
    assert "held-out preference accuracy" in proc.stdout
    log = read_log(out)
    assert len(log) == 3
    assert {"loss", "accuracy", "rewards/chosen", "rewards/rejected", "rewards/margins"} <= set(log[0])
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    # the logged accuracy (evaluated after step 3, the saved weights) against the saved model scoring
    # each held-out sequence alone, unpadded, at its last token (EOS): chosen must beat rejected
    tokenizer = load_tokenizer(out)
    examples, _ = tokenize(load_split(tiny_tldr.TINY_PREFERENCE_DATA, "validation"), tokenizer,
                           Args.max_length)
    backbone = getattr(model, model.base_model_prefix)
    with torch.no_grad():
        def score(ids):
            return model.score(backbone(torch.tensor([ids])).last_hidden_state[0, -1]).item()
        margins = torch.tensor([score(p + c) - score(p + r) for p, c, r, _ in examples])
    near = (margins.abs() < 1e-4).sum().item()  # a pair this close may fall either way in a padded batch
    correct = (margins > 0).sum().item()
    assert abs(log[-1]["eval_accuracy"] * len(examples) - correct) <= near + 1e-6, (log[-1]["eval_accuracy"], correct)


@pytest.mark.long  # 17 s or more: in .ci/run's lane 1, out of the default suite
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


@pytest.mark.usefixtures("one_torch_thread")
def test_default_first_step_gradient_against_the_loss_written_out(tmp_path, tiny_model, monkeypatch):
    """reward.py at its defaults (Bradley-Terry, no centering, a fresh head) on 4 fixed pairs in one batch:
    the gradient of its first step against mean -log sigmoid(r_chosen - r_rejected), every sequence scored
    alone here by the classifier at its last token (EOS); the chosen and the rejected parts are each checked."""
    from tests.first_step import (PAIRS, assert_gradient, encode, gradient, gradients_before_clipping, grads_of,
                                  weights_of, write_splits)
    args = Args(model_name_or_path=tiny_model, dataset_name=write_splits(tmp_path / "pairs", PAIRS),
                per_device_train_batch_size=4, output_dir=str(tmp_path / "rm"))
    (record,) = gradients_before_clipping(monkeypatch, reward.main, args)
    tokenizer = load_tokenizer(tiny_model)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1).eval()
    model.load_state_dict(weights_of(record))  # the head the script drew

    def score(prompt, completion):
        return model(input_ids=torch.tensor([sum(encode(tokenizer, prompt, completion), [])])).logits[0, 0]

    chosen = rejected = 0.0
    for row in PAIRS:
        rc, rr = score(row["prompt"], row["chosen"]), score(row["prompt"], row["rejected"])
        weight = torch.sigmoid(rr - rc).detach() / len(PAIRS)  # d(-log sigmoid(rc - rr)) / d rc, averaged
        chosen, rejected = chosen - weight * rc, rejected + weight * rr
    assert_gradient(grads_of(record), {"chosen": gradient(chosen, model), "rejected": gradient(rejected, model)})
