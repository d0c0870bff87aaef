"""algos/dpo.py: every loss type against hand-derived formulas, logprob gathering, data handling,
and short end-to-end runs (overfitting, precomputed reference, TR-DPO)."""

import json
import math
import statistics

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from algos import dpo
from common.generation import pad, shifted_logits
from common.models import load_policy
from tests.conftest import FixedLogits, run_script
from tests.test_sft import read_log


def log1pexp(x):
    """-log sigmoid(-x) = log(1 + e^x), written without torch."""
    return math.log(1 + math.exp(x))


def sig(x):
    return 1 / (1 + math.exp(-x))


# policy / reference sequence logprobs of two pairs
POLICY_C, POLICY_R = [-1.0, -3.0], [-2.0, -1.5]
REF_C, REF_R = [-1.5, -2.0], [-1.0, -2.5]
BETA, EPS, DELTA, GAMMA = 0.5, 0.1, 0.2, 0.3

# loss of one pair from a = log-ratio of chosen, b = log-ratio of rejected (h = a - b), from the papers
EXPECTED = {
    "sigmoid": lambda a, b: (1 - EPS) * log1pexp(-BETA * (a - b)) + EPS * log1pexp(BETA * (a - b)),
    "robust": lambda a, b: ((1 - EPS) * log1pexp(-BETA * (a - b)) - EPS * log1pexp(BETA * (a - b))) / (1 - 2 * EPS),
    "hinge": lambda a, b: max(0.0, 1 - BETA * (a - b)),
    "ipo": lambda a, b: (a - b - 1 / (2 * BETA)) ** 2,
    "bco_pair": lambda a, b: log1pexp(-(BETA * a - DELTA)) + log1pexp(BETA * b - DELTA),
    "sppo_hard": lambda a, b: (a - 1 / (2 * BETA)) ** 2 + (b + 1 / (2 * BETA)) ** 2,
    "nca_pair": lambda a, b: log1pexp(-BETA * a) + 0.5 * log1pexp(BETA * a) + 0.5 * log1pexp(BETA * b),
    "apo_zero": lambda a, b: (1 - sig(BETA * a)) + sig(BETA * b),
    "apo_down": lambda a, b: sig(BETA * a) + (1 - sig(BETA * (a - b))),
}


@pytest.mark.parametrize("loss_type", sorted(EXPECTED))
def test_loss_types_match_hand_derived_formulas(loss_type):
    t = torch.tensor
    losses, reward_c, reward_r = dpo.dpo_loss(t(POLICY_C), t(POLICY_R), t(REF_C), t(REF_R), beta=BETA,
                                              loss_type=loss_type, label_smoothing=EPS, bco_delta=DELTA)
    ratios = [(pc - rc, pr - rr) for pc, pr, rc, rr in zip(POLICY_C, POLICY_R, REF_C, REF_R)]
    assert losses.tolist() == pytest.approx([EXPECTED[loss_type](a, b) for a, b in ratios], rel=1e-5)
    assert reward_c.tolist() == pytest.approx([BETA * a for a, _ in ratios])
    assert reward_r.tolist() == pytest.approx([BETA * b for _, b in ratios])


def test_simpo_uses_no_reference_and_a_target_margin():
    # mean logprobs -0.5 (chosen) and -0.9 (rejected): beta * 0.4 must beat gamma
    losses, reward_c, _ = dpo.dpo_loss(torch.tensor([-0.5]), torch.tensor([-0.9]), torch.zeros(1), torch.zeros(1),
                                       beta=2.0, loss_type="simpo", simpo_gamma=GAMMA)
    assert losses.item() == pytest.approx(log1pexp(-(2.0 * 0.4 - GAMMA)), rel=1e-5)
    assert reward_c.item() == pytest.approx(-1.0)


def test_sigmoid_hand_worked_example():
    # a = 1, b = -1, beta = 0.5: beta * h = 1, loss = log(1 + e^-1) = 0.31326
    losses, _, _ = dpo.dpo_loss(torch.tensor([0.0]), torch.tensor([-2.0]), torch.tensor([-1.0]), torch.tensor([-1.0]),
                                beta=0.5)
    assert losses.item() == pytest.approx(0.313262, abs=1e-6)


def test_only_ipo_and_simpo_average_logprobs():
    assert {t for t in dpo.LossType.__args__ if dpo.uses_mean_logps(t)} == {"ipo", "simpo"}


TABLE = torch.log(torch.tensor([[0.1, 0.2, 0.7, 0.0 + 1e-9], [0.5, 0.25, 0.2, 0.05],
                                [0.6, 0.3, 0.05, 0.05], [0.25, 0.25, 0.25, 0.25]]))


def test_pair_logprobs_known_values_prompt_excluded():
    # pair 1: prompt [0, 1], chosen [2, 3], rejected [1]; pair 2: prompt [3], chosen [0], rejected [2, 2, 1]
    examples = [([0, 1], [2, 3], [1]), ([3], [0], [2, 2, 1])]
    batch = dpo.collate(examples, pad_id=3)
    chosen, rejected, (chosen_counts, _), _ = dpo.forward_pairs(FixedLogits(TABLE), batch, mean_logps=False)
    p = TABLE.exp()
    # each completion token is scored given the token before it (the last prompt token for the first)
    expected_c = [math.log(p[1, 2] * p[2, 3]), math.log(p[3, 0])]
    expected_r = [math.log(p[1, 1]), math.log(p[3, 2] * p[2, 2] * p[2, 1])]
    assert chosen.tolist() == pytest.approx(expected_c, rel=1e-5)
    assert rejected.tolist() == pytest.approx(expected_r, rel=1e-5)
    assert chosen_counts.tolist() == [2, 1]
    mean_c, mean_r, _, _ = dpo.forward_pairs(FixedLogits(TABLE), batch, mean_logps=True)
    assert mean_r.tolist() == pytest.approx([expected_r[0], expected_r[1] / 3], rel=1e-5)


def test_left_and_right_padded_pairs_give_the_same_logprobs(tiny_model, tokenizer):
    torch.manual_seed(0)
    model = load_policy(tiny_model, tokenizer).eval()
    examples = [([10, 11, 12], [13, 14, 0], [15, 0]), ([20], [21, 0], [22, 23, 24, 25, 0])]
    right = dpo.forward_pairs(model, dpo.collate(examples, tokenizer.pad_token_id), mean_logps=False)
    seqs = [p + c for p, c, _ in examples] + [p + r for p, _, r in examples]
    ids, mask = pad(seqs, tokenizer.pad_token_id, side="left")
    starts = (ids.shape[1] - mask.sum(1)) + torch.tensor([len(p) for p, _, _ in examples] * 2)
    completion_mask = (torch.arange(ids.shape[1])[None, :] >= starts[:, None]).long()
    left = dpo.sequence_logps(shifted_logits(model, ids, mask), ids, completion_mask)[0].chunk(2)
    assert torch.allclose(right[0], left[0], atol=1e-5) and torch.allclose(right[1], left[1], atol=1e-5)


def limits(max_prompt_length, max_completion_length, max_length):
    return type("Args", (), dict(max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
                                 max_length=max_length))


def test_truncation_order_and_skipped_rows(tokenizer):
    prompt = " ".join(f"w{i}" for i in range(20))
    rows = [{"prompt": prompt, "chosen": " a b c d e f g h", "rejected": " x"},
            {"prompt": "p", "chosen": " same", "rejected": " same"},
            {"prompt": "p", "chosen": " ", "rejected": " x"}]
    examples, skipped = dpo.tokenize(rows, tokenizer, limits(6, 4, 20))
    assert skipped == {"chosen == rejected": 1, "empty completion": 1}
    (prompt_ids, chosen_ids, rejected_ids), = examples
    assert prompt_ids == tokenizer(prompt).input_ids[-6:]  # the end of the prompt is kept
    assert chosen_ids == tokenizer(" a b c d e f g h").input_ids[:4]  # the start of the completion is kept
    assert rejected_ids == tokenizer(" x").input_ids + [tokenizer.eos_token_id]
    (_, chosen_ids, rejected_ids), = dpo.tokenize(rows[:1], tokenizer, limits(6, 4, 9))[0]
    assert len(chosen_ids) == len(rejected_ids) == 3  # then max_length: 9 - 6 prompt tokens
    assert dpo.tokenize(rows[:1], tokenizer, limits(8, 4, 8))[1] == {"prompt leaves no room under max_length=8": 1}


def test_implicit_prompt_from_conversations(tokenizer):
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    system, user = {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}
    good, bad = {"role": "assistant", "content": "hello"}, {"role": "assistant", "content": "go away"}
    assert dpo.split_implicit_prompt([system, user, good], [system, user, bad]) == ([system, user], [good], [bad])
    examples, skipped = dpo.tokenize([{"chosen": [system, user, good], "rejected": [system, user, bad]}], tokenizer,
                                     limits(64, 64, 128))
    (prompt_ids, chosen_ids, _), = examples
    assert tokenizer.decode(prompt_ids) == "system: be brief\nuser: hi\nassistant:"
    assert tokenizer.decode(chosen_ids) == " hello<|endoftext|>"


def write_pairs(path, n):
    """A small preference set (prompt/chosen/rejected) in train and validation files."""
    rows = [{"prompt": f"TITLE: post {i}\n\nTL;DR:", "chosen": f" good summary {i}", "rejected": f" bad bad text {i}"}
            for i in range(n)]
    for split in ("train", "validation"):
        path.mkdir(exist_ok=True)
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dpo_overfits_a_small_set_and_saves_a_loadable_model(tmp_path, sft_model):
    data, out = write_pairs(tmp_path / "pairs", 16), str(tmp_path / "dpo")
    run_script("algos/dpo.py", "--model_name_or_path", sft_model, "--dataset_name", data, "--max_steps", "25",
               "--per_device_train_batch_size", "8", "--learning_rate", "1e-3", "--eval_steps", "25",
               "--rpo_alpha", "0.1", "--num_sample_generations", "1", "--output_dir", out)
    log = read_log(out)
    names = {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss"}
    assert names <= set(log[0]) and {f"eval_{n}" for n in names} <= set(log[-1])
    assert log[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert log[-1]["eval_rewards/accuracies"] > 0.9 and log[-1]["eval_loss"] < log[0]["loss"]
    AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.long  # 17 s or more: in .ci/run's lane 1, out of the default suite
def test_precomputed_reference_gives_the_same_first_loss(tmp_path, sft_model, tiny_model):
    data = write_pairs(tmp_path / "pairs", 16)
    losses = []
    for flag in ([], ["--precompute_ref_logps"]):
        out = str(tmp_path / f"dpo{len(flag)}")
        # start from a policy that differs from the reference, so that the first loss is not log 2
        run_script("algos/dpo.py", "--model_name_or_path", sft_model, "--ref_model_name_or_path",
                   tiny_model, "--dataset_name", data, "--max_steps", "2",
                   "--per_device_train_batch_size", "8", "--dataset_test_split", "", "--output_dir", out, *flag)
        losses.append([row["loss"] for row in read_log(out)])
    assert losses[0][0] != pytest.approx(math.log(2), abs=1e-3)
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)


@pytest.mark.long  # 17 s or more: in .ci/run's lane 1, out of the default suite
def test_tr_dpo_sync_with_alpha_one_makes_the_reference_the_policy(tmp_path, sft_model):
    data = write_pairs(tmp_path / "pairs", 16)
    margins = {}
    for flag in ([], ["--sync_ref_model", "--ref_model_sync_steps", "1", "--ref_model_mixup_alpha", "1.0"]):
        out = str(tmp_path / f"dpo{len(flag)}")
        run_script("algos/dpo.py", "--model_name_or_path", sft_model, "--dataset_name", data, "--max_steps", "2",
                   "--per_device_train_batch_size", "8", "--learning_rate", "1e-3", "--warmup_ratio", "0",
                   "--dataset_test_split", "", "--output_dir", out, *flag)
        margins[bool(flag)] = [abs(row["rewards/chosen"]) + abs(row["rewards/rejected"]) for row in read_log(out)]
    # step 2 starts from the updated policy: its rewards are 0 only if the reference was replaced by it
    assert margins[True][1] == pytest.approx(0.0, abs=1e-6) and margins[False][1] > 1e-3


def test_tr_dpo_checkpoint_holds_the_reference_once_over_the_ranks(tiny_model):
    """Without sharding every rank holds the same full reference: rank r writes tensors r, r + world, ...
    (each once, none twice over the ranks' files), and a rank loads back the tensors it wrote."""
    import types

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    names = list(model.state_dict())
    parts = [dpo.reference_state(model, types.SimpleNamespace(process_index=r, num_processes=3)) for r in range(3)]
    assert sorted(n for part in parts for n in part) == sorted(names)
    assert list(parts[1]) == names[1::3]
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        for t in fresh.state_dict().values():
            t.zero_()
    one = types.SimpleNamespace(process_index=0, num_processes=1)
    dpo.load_reference_state(fresh, dpo.reference_state(model, one), one)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_ipo_logs_beta_times_summed_log_ratios_as_every_loss_type(tmp_path, sft_model, tiny_model):
    # one pair, repeated: the logged rewards of step 1 are those of this pair, before any update
    row = {"prompt": "TITLE: post\n\nTL;DR:", "chosen": " good summary here", "rejected": " bad"}
    data = tmp_path / "pair.jsonl"
    data.write_text((json.dumps(row) + "\n") * 4)
    logged = {}
    for loss_type in ("ipo", "sigmoid"):
        out = str(tmp_path / loss_type)
        dpo.main(dpo.Args(model_name_or_path=sft_model, ref_model_name_or_path=tiny_model, dataset_name=str(data),
                          loss_type=loss_type, beta=0.5, max_steps=1, per_device_train_batch_size=2,
                          dataset_test_split="", num_sample_generations=0, output_dir=out))
        logged[loss_type] = read_log(out)[0]
    # independent: beta x (summed completion logprob under the policy - under the reference), with HF
    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    prompt = tokenizer(row["prompt"]).input_ids

    def summed(path, completion):
        ids = prompt + tokenizer(completion).input_ids + [tokenizer.eos_token_id]
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(path)(input_ids=torch.tensor([ids])).logits[0, :-1]
        return sum(torch.log_softmax(logits, -1)[t - 1, ids[t]].item() for t in range(len(prompt), len(ids)))

    chosen = 0.5 * (summed(sft_model, row["chosen"]) - summed(tiny_model, row["chosen"]))
    rejected = 0.5 * (summed(sft_model, row["rejected"]) - summed(tiny_model, row["rejected"]))
    for loss_type in ("ipo", "sigmoid"):
        assert logged[loss_type]["rewards/chosen"] == pytest.approx(chosen, abs=1e-4)
        assert logged[loss_type]["rewards/rejected"] == pytest.approx(rejected, abs=1e-4)
        assert logged[loss_type]["rewards/margins"] == pytest.approx(chosen - rejected, abs=1e-4)
        assert logged[loss_type]["rewards/accuracies"] == float(chosen > rejected)


def first_step_setup(tmp_path, tiny_model, monkeypatch, **overrides):
    """dpo.py on the 4 fixed pairs (one batch of 4, so every step sees all of them) with a perturbed
    reference; its recorded steps, the reference and, per pair, the tokens of prompt, chosen, rejected."""
    from common.models import load_tokenizer
    from tests.first_step import PAIRS, encode, gradients_before_clipping, perturbed_reference, write_splits
    loaded = perturbed_reference(monkeypatch, dpo)
    args = dpo.Args(model_name_or_path=tiny_model, dataset_name=write_splits(tmp_path / "pairs", PAIRS),
                    per_device_train_batch_size=4, output_dir=str(tmp_path / "dpo"), **overrides)
    records = gradients_before_clipping(monkeypatch, dpo.main, args, steps=overrides.get("max_steps", 1))
    tokenizer = load_tokenizer(tiny_model)
    pairs = [(*encode(tokenizer, r["prompt"], r["chosen"]), encode(tokenizer, r["prompt"], r["rejected"])[1])
             for r in PAIRS]
    return args, records, loaded[1], tokenizer, pairs


@pytest.mark.usefixtures("one_torch_thread")
def test_default_first_step_gradient_against_the_loss_written_out(tmp_path, tiny_model, monkeypatch):
    """dpo.py at its defaults (sigmoid, beta 0.1): the gradient of its first step against
    mean -log sigmoid(beta h), h = (log pi - log pi_ref)(chosen) - (...)(rejected), every sequence scored
    alone here; the chosen and the rejected parts of the gradient are each checked."""
    from tests.first_step import assert_gradient, gradient, grads_of, own_logprobs, policy_with, weights_of
    args, (record,), ref, tokenizer, pairs = first_step_setup(tmp_path, tiny_model, monkeypatch)
    policy = policy_with(tiny_model, tokenizer, weights_of(record))
    chosen = rejected = 0.0
    for p, c, r in pairs:
        lc, lr = own_logprobs(policy, p, c).sum(), own_logprobs(policy, p, r).sum()
        with torch.no_grad():
            h = (lc - own_logprobs(ref, p, c).sum()) - (lr - own_logprobs(ref, p, r).sum())
        weight = args.beta * torch.sigmoid(-args.beta * h) / len(pairs)  # d(-log sigmoid(beta h)) / dh, averaged
        chosen, rejected = chosen - weight * lc, rejected + weight * lr
    assert_gradient(grads_of(record), {"chosen": gradient(chosen, policy), "rejected": gradient(rejected, policy)})


@pytest.mark.usefixtures("one_torch_thread")
def test_bco_pair_running_mean_of_the_rewards_of_earlier_steps(tmp_path, tiny_model, monkeypatch):
    """bco_pair's delta is the mean of every implicit reward beta log(pi / pi_ref), chosen and rejected,
    of the training steps before (0 at the first; evaluations, here after every step, do not count).
    Three steps at a learning rate that moves the policy: each step's gradient against
    -log sigmoid(beta a - delta) - log sigmoid(-(beta b - delta)) with delta worked out from the earlier
    steps' recorded weights."""
    from tests.first_step import assert_gradient, gradient, grads_of, own_logprobs, policy_with, weights_of
    args, records, ref, tokenizer, pairs = first_step_setup(
        tmp_path, tiny_model, monkeypatch, loss_type="bco_pair", max_steps=3, learning_rate=1e-3, warmup_ratio=0.0,
        eval_steps=1, num_sample_generations=0)
    with torch.no_grad():
        ref_logps = [(own_logprobs(ref, p, c).sum(), own_logprobs(ref, p, r).sum()) for p, c, r in pairs]
    seen, deltas = [], []
    for record in records:
        policy = policy_with(tiny_model, tokenizer, weights_of(record))
        delta = statistics.mean(seen) if seen else 0.0
        loss = 0.0
        for (p, c, r), (ref_c, ref_r) in zip(pairs, ref_logps):
            a, b = own_logprobs(policy, p, c).sum() - ref_c, own_logprobs(policy, p, r).sum() - ref_r
            loss = loss + (-F.logsigmoid(args.beta * a - delta) - F.logsigmoid(-(args.beta * b - delta))) / len(pairs)
            seen += [args.beta * a.item(), args.beta * b.item()]
        assert_gradient(grads_of(record), {"bco": gradient(loss, policy)})
        deltas.append(delta)
    assert deltas[0] == 0 and abs(deltas[2] - deltas[1]) > 1e-3 * abs(deltas[1]) > 0, deltas  # the policy moved
