"""gkd.py: the divergence and the token-reward loss against values and gradients worked out here (plain Python
floats over a 3-token vocabulary, closed-form gradients; autograd of D_beta written out in float64, under a mask,
weights and chunks, and from fp32 logits near beta 0 and 1), the per-token pass against each row's own forward, the
on/off-policy draw (alone, and which prompts a run samples), and the script's one-line refusals."""

import math
import random

import pytest
import torch

from algos import gkd
from common.data import encode_completion
from common.models import load_policy
from common.tracking import TrackingArgs
from tests.conftest import run_script
from tests.test_bad_input import CHAT_TEMPLATE, PROMPT, write_jsonl
from tests.test_per_token_passes import COMPLETIONS, PROMPTS, own_logits, perturbed

STUDENT = [0.5, -1.0, 2.0]  # logits over a 3-token vocabulary
TEACHER = [1.5, 0.0, -0.5]


def softmax(z):
    e = [math.exp(x) for x in z]
    return [x / sum(e) for x in e]


def kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b))


def expected(beta, student=STUDENT, teacher=TEACHER):
    """D_beta from its definition, in probabilities: [beta KL(P||M) + (1-beta) KL(Q||M)] / (beta (1-beta))."""
    q, p = softmax(student), softmax(teacher)
    if beta == 0:
        return kl(p, q)
    if beta == 1:
        return kl(q, p)
    m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
    return (beta * kl(p, m) + (1 - beta) * kl(q, m)) / (beta * (1 - beta))


def divergence(beta, student=STUDENT, teacher=TEACHER, elements=2**21):
    s = torch.tensor([[student]], dtype=torch.float64, requires_grad=True)
    d = gkd.token_divergence(s, torch.tensor([[teacher]], dtype=torch.float64), beta, elements=elements)
    return d, s


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.2])
def test_divergence_against_its_definition(beta):
    d, _ = divergence(beta)
    assert d.item() == pytest.approx(expected(beta), rel=1e-12)


def test_divergence_is_continuous_at_both_ends():
    """Undivided, the generalised JSD tends to 0 at the ends; divided by beta (1 - beta) it tends to the KLs."""
    assert divergence(1e-6)[0].item() == pytest.approx(expected(0.0), rel=1e-5)
    assert divergence(1 - 1e-6)[0].item() == pytest.approx(expected(1.0), rel=1e-5)
    assert expected(0.0) != pytest.approx(expected(1.0), rel=1e-2)  # the ends differ: the test can tell them apart


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_divergence_gradient(beta):
    """beta 0: d KL(P||Q) / dz = q - p; beta 1: d KL(Q||P) / dz_i = q_i (log(q_i / p_i) - KL(Q||P));
    beta 0.5: central differences of the definition."""
    d, s = divergence(beta)
    d.sum().backward()
    q, p = softmax(STUDENT), softmax(TEACHER)
    if beta == 0:
        want = [a - b for a, b in zip(q, p)]
    elif beta == 1:
        want = [a * (math.log(a / b) - kl(q, p)) for a, b in zip(q, p)]
    else:
        h = 1e-6
        want = [(expected(beta, [z + h * (j == i) for j, z in enumerate(STUDENT)]) -
                 expected(beta, [z - h * (j == i) for j, z in enumerate(STUDENT)])) / (2 * h) for i in range(3)]
    assert s.grad[0, 0].tolist() == pytest.approx(want, abs=1e-8)


def reference(student, teacher, beta):
    """D_beta written out in float64 from probabilities, M = beta P + (1 - beta) Q ([..., V] -> [...]), for autograd."""
    q, p = student.double().log_softmax(-1), teacher.double().log_softmax(-1)
    if beta in (0, 1):
        return (p.exp() * (p - q)).sum(-1) if beta == 0 else (q.exp() * (q - p)).sum(-1)
    m = (beta * p.exp() + (1 - beta) * q.exp()).log()
    return (beta * (p.exp() * (p - m)).sum(-1) + (1 - beta) * (q.exp() * (q - m)).sum(-1)) / (beta * (1 - beta))


MASK = [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]  # rows of 3, 1 and 5 completion tokens


@pytest.mark.parametrize("beta", [0.3, 0.85])
def test_backward_under_a_mask_and_weights_is_autograd_of_the_definition(beta):
    """At a beta where swapping beta and 1 - beta shows, positions weighted (an incoming gradient that is not 1)
    and masked, 2 positions a chunk (8 chunks, the last of 1): token_divergence's hand-written backward and
    gkd_loss's value and gradient equal autograd of `reference`; masked positions get no gradient."""
    torch.manual_seed(1)
    student, teacher = torch.randn(3, 5, 7, dtype=torch.float64) * 2, torch.randn(3, 5, 7, dtype=torch.float64) * 2
    mask, w = torch.tensor(MASK, dtype=torch.float64), torch.rand(3, 5, dtype=torch.float64) + 0.5
    s, want = student.clone().requires_grad_(), student.clone().requires_grad_()
    (gkd.token_divergence(s, teacher, beta, elements=14) * mask * w).sum().backward()
    (reference(want, teacher, beta) * mask * w).sum().backward()
    assert torch.allclose(s.grad, want.grad, rtol=1e-10, atol=1e-12)
    assert not s.grad[mask == 0].any() and s.grad[mask == 1].abs().min() > 0
    s, want = student.clone().requires_grad_(), student.clone().requires_grad_()
    loss, _ = gkd.gkd_loss(s, teacher, torch.zeros(3, 5, dtype=torch.long), mask, beta=beta, loss_type="jsd",
                           num_tokens=7.5)
    loss.backward()
    want_loss = (reference(want, teacher, beta) * mask).sum() / 7.5
    want_loss.backward()
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-12)
    assert torch.allclose(s.grad, want.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("beta", [1e-4, 1e-6, 1 - 1e-4, 1 - 1e-6])
def test_float32_logits_near_the_ends_give_the_float64_values(beta):
    """D_beta divides sums that cancel to O(beta) (or O(1 - beta)) by beta (1 - beta): from fp32 chunks these rows'
    values were up to 5e-3 off at 1e-4 and 0.5 at 1e-6 (either end), the gradient 5e-2 at 1e-6; within 0.05 of
    the ends the chunks are taken in float64, and the fp32 results are float64's rounded."""
    torch.manual_seed(0)
    student = torch.randn(3, 5, 11) * 2
    teacher, w = student + torch.randn(3, 5, 11), torch.rand(3, 5) + 0.5
    s, want = student.clone().requires_grad_(), student.double().requires_grad_()
    d = gkd.token_divergence(s, teacher, beta, elements=22)
    (d * w).sum().backward()
    (reference(want, teacher, beta) * w).sum().backward()
    assert d.dtype == s.grad.dtype == torch.float32
    assert d.flatten().tolist() == pytest.approx(reference(student, teacher, beta).flatten().tolist(), rel=1e-6)
    assert torch.allclose(s.grad.double(), want.grad, rtol=1e-6, atol=1e-6 * want.grad.abs().max().item())


def test_beta_0_1_and_the_middle_keep_their_fp32_values():
    """float64 only strictly within 0.05 of an end: beta 1 (the main job's), 0 and the paper's 0.1 / 0.5 / 0.9 are
    taken in fp32 as before, bit for bit (here the KLs written with the same fp32 operations)."""
    torch.manual_seed(0)
    s, t = torch.randn(4, 50), torch.randn(4, 50)
    q, p = s.log_softmax(-1), t.log_softmax(-1)
    assert torch.equal(gkd.token_divergence(s, t, 1.0), (q.exp() * (q - p)).sum(-1))
    assert torch.equal(gkd.token_divergence(s, t, 0.0), (p.exp() * (p - q)).sum(-1))
    for beta in (0.0, 0.1, 0.3, 0.5, 0.9, 1.0):
        for dtype in (torch.float32, torch.bfloat16):
            assert gkd._chunk_dtype(dtype, beta) == torch.float32
    assert all(gkd._chunk_dtype(torch.float32, beta) == torch.float64 for beta in (1e-9, 0.049, 0.951, 1 - 1e-9))


def test_chunks_give_the_values_and_gradients_of_one_pass():
    torch.manual_seed(0)
    student, teacher = torch.randn(3, 5, 7, dtype=torch.float64), torch.randn(3, 5, 7, dtype=torch.float64)
    results = []
    for elements in (7, 2**21):  # one position a chunk; everything at once
        s = student.clone().requires_grad_()
        d = gkd.token_divergence(s, teacher, 0.3, elements=elements)
        (d * torch.arange(15.0, dtype=torch.float64).view(3, 5)).sum().backward()
        results.append((d.detach(), s.grad))
    assert torch.allclose(results[0][0], results[1][0]) and torch.allclose(results[0][1], results[1][1])


def test_a_padded_head_is_cut_to_the_shorter_vocabulary():
    """Two sizes of one family share a tokenizer but not always a head size (Qwen2.5: 151936 and 152064)."""
    d, s = divergence(0.5, STUDENT + [9.0], TEACHER)
    assert d.item() == pytest.approx(expected(0.5), rel=1e-12)
    d.backward()
    d, unpadded = divergence(0.5)
    d.backward()
    assert s.grad[0, 0].tolist() == pytest.approx(unpadded.grad[0, 0].tolist() + [0.0], abs=1e-12)


def test_loss_sums_the_masked_tokens_over_the_step_token_count():
    """Positions under mask 0 (padding after the completion) change nothing, whatever their logits."""
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    ids = torch.zeros(2, 3, dtype=torch.long)
    loss, per_token = gkd.gkd_loss(student, teacher, ids, mask, beta=1.0, loss_type="jsd", num_tokens=5.0)
    want = sum(expected(1.0, student[b, t].tolist(), teacher[b, t].tolist()) for b, t in [(0, 0), (0, 1), (1, 0)]) / 5
    assert loss.item() == pytest.approx(want, rel=1e-5)
    student[0, 2], student[1, 1:] = 100.0, -100.0
    assert gkd.gkd_loss(student, teacher, ids, mask, beta=1.0, loss_type="jsd", num_tokens=5.0)[0].item() == \
        pytest.approx(want, rel=1e-5)


def test_token_reward_gradient_is_the_reverse_kl_estimate_times_the_score():
    """loss = k log Q(y), k = log Q(y) - log P(y) detached: d/dz = k (onehot(y) - q) / num_tokens."""
    s = torch.tensor([[STUDENT]], requires_grad=True)
    loss, k = gkd.gkd_loss(s, torch.tensor([[TEACHER]]), torch.tensor([[2]]), torch.ones(1, 1), beta=1.0,
                           loss_type="token_reward", num_tokens=2.0)
    loss.backward()
    q, p = softmax(STUDENT), softmax(TEACHER)
    k_want = math.log(q[2] / p[2])
    assert k.item() == pytest.approx(k_want, rel=1e-5)
    assert s.grad[0, 0].tolist() == pytest.approx([k_want * ((i == 2) - q[i]) / 2 for i in range(3)], abs=1e-6)


def test_completion_logits_are_each_rows_own(tiny_model, tokenizer):
    """Prompts left-padded, completions right-padded, two rows sharing a prompt: the logits before each
    completion token equal the row's own unpadded forward (temperature 1), for the student and the teacher."""
    from common.generation import pad

    student = load_policy(tiny_model, tokenizer).eval()
    teacher = perturbed(load_policy(tiny_model, tokenizer)).eval()
    p_ids, p_mask = pad(PROMPTS, tokenizer.pad_token_id, side="left")
    c_ids, c_mask = pad(COMPLETIONS, tokenizer.pad_token_id)
    for model in (student, teacher):
        with torch.no_grad():
            logits = gkd.completion_logits(model, p_ids, p_mask, c_ids, c_mask)
        for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
            assert torch.allclose(logits[i, :len(c)].float(), own_logits(model, p, c), atol=1e-4), i


def test_on_policy_draw_is_per_prompt_seeded_and_shares_lmbda():
    draws = [gkd.on_policy(1, place, 0.3) for place in range(4000)]
    assert sum(draws) / len(draws) == pytest.approx(0.3, abs=0.03)
    assert draws == [gkd.on_policy(1, place, 0.3) for place in range(4000)]  # the same on every process, resumed
    assert draws != [gkd.on_policy(2, place, 0.3) for place in range(4000)]
    assert all(gkd.on_policy(1, place, 1.0) for place in range(100)) and not any(
        gkd.on_policy(1, place, 0.0) for place in range(100))
    random.random()  # the draw uses its own stream, not the global one


def test_a_micro_batch_pads_prompts_left_completions_right_and_cuts_only_the_datasets(tokenizer):
    """pad_micro_batch: a place the student sampled keeps its completion whole; the others get the dataset's, cut to
    max_new_tokens (4); prompts left-padded, completions right-padded; finished: the completion ends in EOS."""
    rows = [{"prompt": "a", "completion": " one two three four five six"}, {"prompt": "b", "completion": " x"}]
    long, short = (encode_completion(tokenizer, r["prompt"], r["completion"]) for r in rows)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert len(long) > 5 and len(short) == 3 and short[-1] == eos != pad
    student = [9, 10, 12, 13, 14, 15]  # no EOS, longer than 4: kept whole
    batch = [(0, 10), (1, 12), (1, 11)]  # (row, place in the run); place 11 was sampled
    (p_ids, p_mask, c_ids, c_mask), finished = gkd.pad_micro_batch(tokenizer, batch, [[5, 6, 7], [8]], {11: student},
                                                                   rows, 4)
    assert p_ids.tolist() == [[5, 6, 7], [pad, pad, 8], [pad, pad, 8]]
    assert p_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert c_ids.tolist() == [long[:4] + [pad] * 2, short + [pad] * 3, student]
    assert c_mask.tolist() == [[1] * 4 + [0] * 2, [1] * 3 + [0] * 3, [1] * 6]
    assert finished.tolist() == [False, True, False]


def test_teacher_equal_to_the_student_gives_loss_zero_and_a_loadable_model(tmp_path, tiny_model):
    run_script("algos/gkd.py", "--model_name_or_path", tiny_model, "--teacher_model_name_or_path", tiny_model,
               "--max_steps", "1", "--per_device_train_batch_size", "4", "--max_new_tokens", "8", "--lmbda", "0.5",
               "--beta", "0.5", "--logging_steps", "1", "--output_dir", str(tmp_path))
    from tests.test_sft import read_log

    row = read_log(str(tmp_path))[0]
    assert abs(row["loss"]) < 1e-8 and row["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    assert 0 < row["on_policy_ratio"] < 1
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(tmp_path))


def test_the_divergence_gets_the_models_own_logits_whatever_the_sampling_temperature(tmp_path, tiny_model, tokenizer,
                                                                                      monkeypatch):
    """--temperature only decides which completions are sampled (module docstring): the loss receives the very
    logits of the student's and the teacher's forward (test_completion_logits_are_each_rows_own: at temperature
    1); a division by the temperature between the two would make new tensors."""
    teacher = str(tmp_path / "teacher")
    perturbed(load_policy(tiny_model, tokenizer)).save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    forwards, losses = [], []
    forward, loss = gkd.completion_logits, gkd.gkd_loss
    monkeypatch.setattr(gkd, "completion_logits", lambda *a: forwards.append(forward(*a)) or forwards[-1])
    monkeypatch.setattr(gkd, "gkd_loss", lambda s, t, *a, **k: losses.append((s, t)) or loss(s, t, *a, **k))
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": PROMPT, "completion": " b"}] * 4)
    gkd.main(gkd.Args(model_name_or_path=tiny_model, teacher_model_name_or_path=teacher, dataset_name=data,
                      temperature=0.5, max_new_tokens=6, max_steps=1, per_device_train_batch_size=4,
                      output_dir=str(tmp_path / "out")))
    assert len(forwards) == 2 and losses[0][0] is forwards[0] and losses[0][1] is forwards[1]


def test_conversational_rows_are_the_chat_templates_text(tmp_path, tiny_model, monkeypatch):
    """lmbda 0 (supervised KD) on conversational prompt-completion rows: each completion the loss sees is the
    row's assistant turn as the chat template writes it, ending in one EOS (common.data.encode_completion), not
    the text of a list of messages."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.data import encode_completion

    chat = str(tmp_path / "chat")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(chat)
    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(chat)
    rows = [{"prompt": [{"role": "user", "content": f"post {i}"}],
             "completion": [{"role": "assistant", "content": f"sum {i}"}]} for i in range(4)]
    seen, loss = [], gkd.gkd_loss
    monkeypatch.setattr(gkd, "gkd_loss", lambda s, t, ids, mask, **k: seen.append((ids, mask)) or loss(s, t, ids, mask,
                                                                                                         **k))
    gkd.main(gkd.Args(model_name_or_path=chat, teacher_model_name_or_path=chat, lmbda=0.0, max_new_tokens=12,
                      dataset_name=write_jsonl(tmp_path / "d.jsonl", rows), max_steps=1,
                      per_device_train_batch_size=4, output_dir=str(tmp_path / "out")))
    [(ids, mask)] = seen
    got = sorted(row[m.bool()].tolist() for row, m in zip(ids, mask))
    want = sorted(encode_completion(tokenizer, r["prompt"], r["completion"]) for r in rows)
    assert got == want  # the assistant turn after the template's "assistant:", then EOS
    assert [tokenizer.decode(w) for w in got] == [f" sum {i}{tokenizer.eos_token}" for i in range(4)]


def test_token_reward_runs_on_the_students_samples(tmp_path, tiny_model, tokenizer):
    """The --loss_type token_reward path end to end (one step; its value and gradient are pinned by hand in
    test_token_reward_gradient_is_the_reverse_kl_estimate_times_the_score): every completion sampled, a finite
    loss, a nonzero reverse-KL estimate against the perturbed teacher, and a saved student the step moved."""
    from tests.test_sft import read_log

    teacher = str(tmp_path / "teacher")
    perturbed(load_policy(tiny_model, tokenizer)).save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": PROMPT}] * 4)
    gkd.main(gkd.Args(model_name_or_path=tiny_model, teacher_model_name_or_path=teacher, dataset_name=data,
                      loss_type="token_reward", max_new_tokens=6, max_steps=1, per_device_train_batch_size=4,
                      learning_rate=1e-2, tracking=TrackingArgs(logging_steps=1), output_dir=str(tmp_path / "out")))
    [row] = read_log(str(tmp_path / "out"))
    assert row["on_policy_ratio"] == 1 and math.isfinite(row["loss"]) and row["objective/kl"] != 0
    assert row["grad_norm"] > 0
    start, trained = load_policy(tiny_model, tokenizer), load_policy(str(tmp_path / "out"), tokenizer)
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), trained.parameters()))


def test_on_and_off_policy_prompts_follow_the_global_draw(tmp_path, tiny_model, tokenizer, monkeypatch,
                                                          one_torch_thread):
    """--lmbda 0.4, 3 steps, this process as rank 0 of 2 (collectives are its own values): the prompts of step k
    are those at the even global places 8k, 8k + 2, ... of the run's one seeded order; those whose
    on_policy(seed, place, lmbda) is true get the completion the student sampled for them (and no other prompt
    is sampled), the rest the dataset's; the logged on-policy share is the step's share of true draws."""
    from common.data import encode_completion, encode_prompt
    from tests.test_sft import read_log

    rows = [{"prompt": f"TITLE: post {i}\n\nTL;DR:", "completion": f" summary {i} of post {i}"} for i in range(24)]
    prompts = [encode_prompt(tokenizer, r["prompt"]) for r in rows]
    assert len({tuple(p) for p in prompts}) == 24
    seed, lmbda = 3, 0.4
    order = list(range(24))
    random.Random(seed).shuffle(order)  # the run's order of prompts, the same on every rank
    places = [[8 * k + 2 * j for j in range(4)] for k in range(3)]  # rank 0 of 2, 4 prompts each
    draws = [[gkd.on_policy(seed, place, lmbda) for place in step] for step in places]
    assert all(0 < sum(d) < 4 for d in draws)  # each step mixes the two
    setup, forward, sample = gkd.setup, gkd.completion_logits, gkd.generate
    seen, sampled = [], []

    class RankZeroOfTwo:
        num_processes, process_index = 2, 0

        def __init__(self, accelerator):
            self.accelerator = accelerator

        def __getattr__(self, name):
            return getattr(self.accelerator, name)

    def generate(model, tok, chosen, *a, **k):
        samples = sample(model, tok, chosen, *a, **k)
        sampled.append((chosen, [c[m.bool()].tolist() for c, m in zip(samples.completion_ids,
                                                                        samples.completion_mask)]))
        return samples

    monkeypatch.setattr(gkd, "setup", lambda **k: RankZeroOfTwo(setup(**k)))
    monkeypatch.setattr(gkd, "generate", generate)
    monkeypatch.setattr(gkd, "completion_logits", lambda m, *a: seen.append(a) or forward(m, *a))
    gkd.main(gkd.Args(model_name_or_path=tiny_model, teacher_model_name_or_path=tiny_model, lmbda=lmbda, seed=seed,
                      dataset_name=write_jsonl(tmp_path / "d.jsonl", rows), max_steps=3, max_new_tokens=6,
                      per_device_train_batch_size=4, tracking=TrackingArgs(logging_steps=1),
                      output_dir=str(tmp_path / "out")))
    assert len(seen) == 6 and len(sampled) == 3  # the student's and the teacher's forward; one generate a step
    for k, ((p_ids, p_mask, c_ids, c_mask), (chosen, samples)) in enumerate(zip(seen[::2], sampled)):
        got = [(p[pm.bool()].tolist(), c[cm.bool()].tolist()) for p, pm, c, cm in zip(p_ids, p_mask, c_ids, c_mask)]
        assert [p for p, _ in got] == [prompts[order[place]] for place in places[k]], k
        on = [j for j in range(4) if draws[k][j]]
        assert chosen == [prompts[order[places[k][j]]] for j in on], k
        for j, (_, completion) in enumerate(got):
            row = rows[order[places[k][j]]]
            dataset = encode_completion(tokenizer, row["prompt"], row["completion"])[:6]
            assert completion == (samples[on.index(j)] if j in on else dataset), (k, j)
            assert (completion != dataset) == draws[k][j], (k, j)  # a sample is not the dataset's completion
    assert [r["on_policy_ratio"] for r in read_log(str(tmp_path / "out"))] == pytest.approx(
        [sum(d) / 4 for d in draws])
