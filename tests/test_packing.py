"""common/packing.py (issue 57): a packed pass gives the padded pass's per-token values and gradient,
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


def test_pack_into_bins_goes_first_fit_longest_first_and_restarts_the_room_left():
    ids = torch.tensor([[0, 0, 5, 6, 7], [0, 8, 9, 0, 0], [1, 2, 3, 4, 0], [0, 0, 0, 0, 3]])
    packed, positions, place = pack(ids, (ids > 0).long(), bin_length=4)
    # longest first: [1 2 3 4] fills bin 0; [5 6 7] opens bin 1; [8 9] does not fit there, opens bin 2; [3] fits bin 1
    assert packed.tolist() == [[1, 2, 3, 4], [5, 6, 7, 3], [8, 9, 0, 0]]
    assert positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]  # bin 2's room: a row of its own
    assert place.tolist() == [[-1, -1, 4, 5, 6], [-1, 8, 9, -1, -1], [0, 1, 2, 3, -1], [-1, -1, -1, -1, 7]]
    assert torch.equal(packed.flatten()[place[place >= 0]], ids[ids > 0])


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flash_attention_2"])
def test_bin_length_takes_the_cheaper_layout_and_flash_gets_one_packed_row(attn):
    from types import SimpleNamespace

    from common.packing import bin_length
    # hidden 2, 1 layer, intermediate 4, vocabulary 10: a position costs 1 * (4*2*2 + 3*2*4) + 10*2 = 60, a pair 4
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation=attn, hidden_size=2, num_hidden_layers=1,
                                                   intermediate_size=4, vocab_size=10))

    def mask(lengths):  # left padding to 2 more than the longest row: bins are the longest row, not the width
        return torch.tensor([[0] * (max(lengths) + 2 - n) + [1] * n for n in lengths])
    # [6, 1, 1]: bins of 6 are [6], [1 1]: 2 * 6 * (60 + 6 * 4) = 1008; one row 8 * (60 + 8 * 4) = 736
    assert bin_length(model, mask([6, 1, 1])) is None
    # [6, 5, 5, 4]: 4 bins of 6: 4 * 6 * (60 + 6 * 4) = 2016; one row 20 * (60 + 20 * 4) = 2800
    assert bin_length(model, mask([6, 5, 5, 4])) == (None if attn == "flash_attention_2" else 6)
    # DDP's and DeepSpeed's wrappers: the wrapped model's config
    assert bin_length(SimpleNamespace(module=model), mask([6, 5, 5, 4])) == bin_length(model, mask([6, 5, 5, 4]))


def assert_packed_pass_equals_padded(model_path, tokenizer, prompts, completions, temperature, weights, attn="sdpa",
                                     **truncation):
    """completion_logps and packed_completion_logps on the same rows, each on a fresh copy of the model: the
    log-probabilities, entropies, and the gradient of their sum under `weights` [B, T] agree to 1e-5."""
    input_ids, attention_mask, width = left_padded(prompts, completions, tokenizer.pad_token_id)
    real = attention_mask[:, width:].bool()
    results = []
    for fn in (completion_logps, packed_completion_logps):
        policy = load_policy(model_path, tokenizer).eval()
        policy.set_attn_implementation(attn)
        logps, entropy = fn(policy, input_ids, attention_mask, width, temperature, entropy=True, **truncation)
        (logps * real * weights(real.shape)).sum().backward()
        results.append((logps[real], entropy[real], [p.grad.clone() for p in policy.parameters()]))
    (lp_a, h_a, g_a), (lp_b, h_b, g_b) = results
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(h_b, h_a, atol=1e-5, rtol=0)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("truncation", [{}, dict(top_k=3)], ids=["full", "top_k"])
def test_packed_logps_entropy_and_gradient_equal_the_padded_pass(tiny_model, tokenizer, truncation):
    assert_packed_pass_equals_padded(tiny_model, tokenizer, PROMPTS, COMPLETIONS, TEMPERATURE,
                                     lambda shape: torch.arange(1, shape[1] + 1), **truncation)  # differ per position


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


# a prompt's samples as grpo groups them: three rows share prompt A, two share B, one has C; lengths all differ
GROUPED_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41], [5, 6, 7, 8, 9, 10, 11], [40, 41], [50, 51, 52, 53],
                   [5, 6, 7, 8, 9, 10, 11]]
GROUPED_COMPLETIONS = [[20, 21, 22, 23, 24], [25], [26, 27], [28, 29, 30, 31, 32, 33], [34, 35, 36], [37]]
LAYOUTS = {"shared-bins": ("shared", 16), "shared-one-row": ("shared", None), "rows-bins": ("rows", 12),
           "rows-one-row": ("rows", None)}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_completion_layout_gives_the_padded_logps_entropy_and_gradient(tiny_model, tokenizer, monkeypatch,
                                                                            layout, attn):
    """The completion passes' four layouts, each forced (prompts shared, each once with its completions after it
    under a mask of ours, or each row with its prompt; in bins of 16 / 12, more than one with room, or one row), on
    rows that share prompts in groups of 3, 2 and 1: the padded pass's log-probabilities at temperature 0.7, its
    entropies, and its gradient under weights that differ per token."""
    from common import packing
    monkeypatch.setattr(packing, "_choose", lambda *args: LAYOUTS[layout])
    assert_packed_pass_equals_padded(tiny_model, tokenizer, GROUPED_PROMPTS, GROUPED_COMPLETIONS, 0.7,
                                     lambda shape: torch.arange(1.0, shape.numel() + 1).view(shape) % 7 - 3, attn)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_completion_sees_its_prompt_and_not_the_completions_beside_it(tiny_model, tokenizer, monkeypatch, attn):
    """Prompts shared, in one packed row: a change to row 0's completion (prompt A's first) leaves its siblings'
    log-probabilities (rows 2 and 5, packed after it) and every other row's as they were; a change to prompt A
    changes all three of its rows and no other."""
    from common import packing
    monkeypatch.setattr(packing, "_choose", lambda *args: ("shared", None))
    policy = load_policy(tiny_model, tokenizer).eval()
    policy.set_attn_implementation(attn)
    input_ids, attention_mask, width = left_padded(GROUPED_PROMPTS, GROUPED_COMPLETIONS, tokenizer.pad_token_id)
    with torch.no_grad():
        before = packed_completion_logps(policy, input_ids, attention_mask, width, TEMPERATURE)
        changed = input_ids.clone()
        changed[0, width:width + 3] += 7
        after = packed_completion_logps(policy, changed, attention_mask, width, TEMPERATURE)
        prompt = input_ids.clone()
        prompt[[0, 2, 5], width - 2] += 3  # prompt A, in each of its rows
        moved = packed_completion_logps(policy, prompt, attention_mask, width, TEMPERATURE)
    assert torch.equal(after[1:], before[1:]) and not torch.equal(after[0], before[0])
    assert all(not torch.equal(moved[r], before[r]) for r in (0, 2, 5))
    assert torch.equal(moved[[1, 3, 4]], before[[1, 3, 4]])


def test_the_completion_layout_is_the_cheapest_by_the_count(tiny_model, tokenizer, monkeypatch):
    """_choose on the tiny model's shape, each option's multiply-adds counted here (a position 1 x (4 h^2 + 3 h f) +
    V h, a pair of positions in one packed row 2 h): a long prompt shared by 4 short completions is packed once;
    a one-token prompt before 2 long completions goes row by row, in bins; the shared layout is not taken beyond a
    sliding window, by a model that ignores a 4D mask, or with flash-attention (one row)."""
    from common import packing
    policy = load_policy(tiny_model, tokenizer).eval()
    config = policy.config
    h, f, v, layers = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    position, pair = layers * (4 * h * h + 3 * h * f) + v * h, 2 * h * layers
    packing.check_packing(policy)

    def cost(rows, width):  # rows packed in `rows` bins of `width`
        return rows * width * (position + width * pair)

    def choose(prompts, completions):
        ids, mask, width = left_padded(prompts, completions, tokenizer.pad_token_id)
        return packing._choose(policy, ids, mask, width)
    four = [list(range(3 + k, 43 + k)) for k in range(4) for _ in range(4)], [[50, 51, 52]] * 16
    # 4 prompts of 40, each with 4 completions of 3: shared, 4 segments of 52 in bins, against one row of 208, and
    # 16 rows of 43 (in 16 bins or one row of 688)
    assert cost(4, 52) < min(cost(1, 208), cost(16, 43), cost(1, 688))
    assert choose(*four) == ("shared", 52)
    # one of them: its segment in one row
    assert cost(1, 52) < min(cost(4, 43), cost(1, 172))
    assert choose(four[0][:4], four[1][:4]) == ("shared", None)
    # a prompt of 1 before 2 completions of 120: 2 bins of 121, against one row of 242 or shared, 241
    assert cost(2, 121) < min(cost(1, 241), cost(1, 242))
    assert choose([[3]] * 2, [list(range(4, 124))] * 2) == ("rows", 121)
    monkeypatch.setattr(config, "sliding_window", 50, raising=False)  # 52 > 50: rows, in bins of 43
    assert choose(*four) == ("rows", 43)
    monkeypatch.setattr(config, "sliding_window", None)
    monkeypatch.setitem(packing._SHARED_MASK, policy, False)
    assert choose(*four) == ("rows", 43)
    monkeypatch.setattr(config, "_attn_implementation", "flash_attention_2")
    assert choose(*four) == ("rows", None)


def test_the_packing_check_notes_a_model_that_ignores_a_4d_mask(monkeypatch):
    """A model whose forward drops the attention mask keeps packed rows apart (by their position ids) but not a
    shared prompt's completions: its passes keep each row with its prompt."""
    from common import packing
    model, kept = _tiny("llama", "sdpa"), _tiny("llama", "sdpa")
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, attention_mask=None, **k: forward(*a, **k))
    packing.check_packing(model)
    packing.check_packing(kept)
    assert packing._SHARED_MASK[model] is False and packing._SHARED_MASK[kept] is True
    ids, mask, width = left_padded([list(range(3, 43))] * 4, [[50, 51, 52]] * 4, 0)
    assert packing._choose(model, ids, mask, width)[0] == "rows"
    assert packing._choose(kept, ids, mask, width)[0] == "shared"


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


@pytest.mark.parametrize("attn,layout", [("sdpa", "bins"), ("eager", "bins"), ("sdpa", "one row")])
def test_dpo_pairs_padding_free_give_the_padded_logps_counts_mean_logits_and_gradient(tiny_model, tokenizer, attn,
                                                                                      layout, monkeypatch):
    """dpo.py's forward_pairs, padded and padding-free, on pairs whose prompts and completions differ in length (6
    rows of 4 to 9 tokens), each layout forced: bins of 9 (more than one, with room at their ends), or one row."""
    from algos import dpo
    from common import packing
    longest = {"bins": lambda model, mask: int(mask.sum(-1).max()), "one row": lambda model, mask: None}[layout]
    monkeypatch.setattr(packing, "bin_length", longest)
    examples = [([5, 6, 7, 8, 9, 10], [20, 21, 22], [23]), ([11, 12], [24, 25, 26, 27, 28, 29], [30, 31]),
                ([13, 14, 15], [32], [33, 34, 35, 36])]
    batch = dpo.collate(examples, tokenizer.pad_token_id)
    results = []
    for padding_free in (False, True):
        policy = load_policy(tiny_model, tokenizer).eval()
        policy.set_attn_implementation(attn)
        chosen, rejected, counts, mean_logits = dpo.forward_pairs(policy, batch, False, padding_free)
        (chosen * torch.tensor([1.0, 2.0, 3.0]) - rejected * torch.tensor([0.5, 1.5, 2.5])).sum().backward()
        results.append((chosen, rejected, torch.stack(counts), torch.stack(mean_logits),
                        [p.grad.clone() for p in policy.parameters()]))
    for a, b in zip(*results):
        for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            torch.testing.assert_close(y.detach(), x.detach(), atol=1e-5, rtol=1e-4)
    assert results[0][2].tolist() == [[3, 6, 1], [1, 2, 4]]  # the completions' lengths, chosen then rejected


@pytest.mark.long  # script steps padded and packed: about 60 s together on 2 cores; .ci/run's lane 1
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


def count_scoring(monkeypatch, module) -> dict:
    """Counts a script's reward-model scoring passes, packed and padded: a script that kept the padded pass under
    --padding_free would still give the padded values, so the equality tests below could not see it."""
    calls = {"packed": 0, "padded": 0}
    for name, key in (("packed_scores", "packed"), ("last_token_scores", "padded")):
        def counted(*args, _fn=getattr(module, name), _key=key, **kwargs):
            calls[_key] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls


def scored_by(calls: dict, before: dict, padding_free: bool) -> bool:
    """The run since `before` scored with its variant's pass only."""
    used = {k: calls[k] - before[k] for k in calls}
    return used["packed" if padding_free else "padded"] > 0 and used["padded" if padding_free else "packed"] == 0


@pytest.mark.long  # script steps padded and packed: about 60 s together on 2 cores; .ci/run's lane 1
def test_an_rloo_step_padding_free_gives_the_padded_steps_values(tmp_path, tiny_model, rm_model, monkeypatch):
    """rloo.py's first step, padded and padding-free (the old, reference and training passes packed, and the reward
    model's scores): the same samples, and the logged scores, policy loss, kl, entropy and gradient norm agree to
    1e-5."""
    from algos import rloo
    from tests.conftest import script_args
    from tests.test_sft import read_log
    logged, calls = [], count_scoring(monkeypatch, rloo)
    for padding_free in (False, True):
        out, before = tmp_path / f"out_{padding_free}", dict(calls)
        rloo.main(script_args(rloo.Args, model_name_or_path=tiny_model, reward_model_paths=[rm_model],
                              reward_funcs=["tests.toy_rewards:short"], per_device_train_batch_size=4, rloo_k=2,
                              max_steps=1, max_completion_length=12, num_ppo_epochs=2, temperature=0.7,
                              padding_free=padding_free, output_dir=str(out)))
        logged.append(read_log(str(out))[0])
        assert scored_by(calls, before, padding_free)
    padded, packed_run = logged
    keys = ["objective/scores", "loss/policy_avg", "objective/kl", "objective/entropy", "grad_norm",
            "completions/mean_length"]
    assert {k: packed_run[k] for k in keys} == pytest.approx({k: padded[k] for k in keys}, rel=1e-5, abs=1e-6)


@pytest.mark.long  # script steps padded and packed: about 60 s together on 2 cores; .ci/run's lane 1
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


@pytest.mark.long  # script steps padded and packed: about 60 s together on 2 cores; .ci/run's lane 1
def test_an_online_dpo_step_padding_free_gives_the_padded_steps_values(tmp_path, tiny_model, sft_model, rm_model,
                                                                         monkeypatch):
    """online_dpo.py's first step, padded and padding-free (policy, reference and reward-model passes packed; a
    reference that differs from the policy): loss, reward margin and gradient norm agree to 1e-5."""
    from algos import online_dpo
    from tests.conftest import script_args
    from tests.test_sft import read_log
    logged, calls = [], count_scoring(monkeypatch, online_dpo)
    for padding_free in (False, True):
        out, before = tmp_path / f"out_{padding_free}", dict(calls)
        online_dpo.main(script_args(online_dpo.Args, model_name_or_path=sft_model, reward_model_paths=[rm_model],
                                    reward_funcs=["tests.toy_rewards:short"], per_device_train_batch_size=4,
                                    max_steps=2, max_new_tokens=12, padding_free=padding_free, output_dir=str(out)))
        logged.append(read_log(str(out))[-1])
        assert scored_by(calls, before, padding_free)
    padded, packed_run = logged
    keys = ["loss", "grad_norm", "rewards/margins"]
    assert {k: packed_run[k] for k in keys} == pytest.approx({k: padded[k] for k in keys}, rel=1e-5, abs=1e-6)
    assert abs(padded["rewards/margins"]) > 1e-6  # step 2: the policy has moved from its reference


@pytest.mark.long  # script steps padded and packed: about 60 s together on 2 cores; .ci/run's lane 1
def test_grpo_steps_padding_free_give_the_padded_steps_values(tmp_path, tiny_model, rm_model, monkeypatch):
    """grpo.py's two steps on one generation batch (num_iterations 2: the sampling-time pass, the reference's with
    beta 0.3, the training passes and the reward model's packed), padded and padding-free: loss, kl, entropy,
    clipped shares and the gradient norm agree to 1e-5."""
    from algos import grpo
    from tests.conftest import script_args
    from tests.test_sft import read_log
    logged, calls = [], count_scoring(monkeypatch, grpo)
    for padding_free in (False, True):
        out, before = tmp_path / f"out_{padding_free}", dict(calls)
        grpo.main(script_args(grpo.Args, model_name_or_path=tiny_model, reward_model_paths=[rm_model],
                              reward_funcs=["tests.toy_rewards:short"], per_device_train_batch_size=4,
                              gradient_accumulation_steps=2, num_generations=4, max_completion_length=12,
                              num_iterations=2, beta=0.3, temperature=0.7, learning_rate=1e-2, max_steps=2,
                              padding_free=padding_free, output_dir=str(out)))
        logged.append(read_log(str(out)))
        assert scored_by(calls, before, padding_free)
    keys = ["loss", "kl", "entropy", "grad_norm", "clip_ratio/region_mean"]
    for padded, packed_run in zip(*logged):
        assert {k: packed_run[k] for k in keys} == pytest.approx({k: padded[k] for k in keys}, rel=1e-5, abs=1e-6)
    assert logged[0][1]["kl"] > 1e-6  # the second step's policy has moved from its reference


def test_packed_scores_and_their_gradient_equal_the_padded_scores(tiny_model, tokenizer):
    """A reward model's scores of rows of different lengths (reward.py's batch: a left-padded prompt block, then a
    left-padded completion block), padded and packed (the `score` head read at each row's last token
    by a hook): scores and gradient agree to 1e-5."""
    from algos.reward import collate
    from common.models import load_reward_model
    from common.packing import packed_scores
    from common.rewards import last_token_scores
    encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    examples = [(encode(p), encode(c) + [tokenizer.eos_token_id], encode(r) + [tokenizer.eos_token_id], 0.0)
                for p, c, r in [("a long prompt about the weather in the hills", " rain", " sun and some wind later"),
                                ("short", " one two three four five six seven", " x"),
                                ("mid length prompt here", " yes", " no")]]
    input_ids, attention_mask, _, width = collate(examples, tokenizer.pad_token_id)
    assert (attention_mask == 0).float().mean() > 0.2  # much padding
    results = []
    for fn in (last_token_scores, packed_scores):
        torch.manual_seed(0)  # the same new head each time
        model = load_reward_model(tiny_model, tokenizer, new_head=True).eval()
        scores = fn(model, input_ids, attention_mask, width)
        (scores * torch.arange(1.0, len(scores) + 1)).sum().backward()  # a different weight per row
        results.append((scores.detach(), [p.grad.clone() for p in model.parameters()]))
    (s_a, g_a), (s_b, g_b) = results
    assert s_a.std() > 1e-3  # the rows score differently
    torch.testing.assert_close(s_b, s_a, atol=1e-5, rtol=0)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_ppo_policy_and_value_pass_packed_equals_the_padded_pass(tiny_model, tokenizer):
    """ppo.py's PolicyAndValue, padded and packed (each model on one packed row, the value model's backbone then its
    head): response logits and values at every real response token, and the gradient of both models, agree."""
    from algos.ppo import PolicyAndValue
    from common.models import load_reward_model
    input_ids, attention_mask, width = left_padded(PROMPTS, COMPLETIONS, tokenizer.pad_token_id)
    real = attention_mask[:, width:].bool()
    results = []
    for padding_free in (False, True):
        torch.manual_seed(0)  # the same new value head each time
        model = PolicyAndValue(load_policy(tiny_model, tokenizer),
                               load_reward_model(tiny_model, tokenizer, new_head=True), padding_free).eval()
        logits, values = model(input_ids, attention_mask, width)
        weights = torch.arange(1.0, real.shape[1] + 1)  # a different weight per position
        ((logits.float().logsumexp(-1) + values) * real * weights).sum().backward()
        results.append((logits[real].detach(), values[real].detach(), [p.grad.clone() for p in model.parameters()]))
    (l_a, v_a, g_a), (l_b, v_b, g_b) = results
    torch.testing.assert_close(l_b, l_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(v_b, v_a, atol=1e-5, rtol=0)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


@pytest.mark.long  # script steps padded and packed: about 60 s together on 2 cores; .ci/run's lane 1
def test_a_reward_model_step_padding_free_gives_the_padded_steps_values(tmp_path, sft_model):
    """One step of reward.py (a fresh head; pairs of different lengths; gradient accumulation 2), padded and
    padding-free: loss, accuracy and gradient norm agree to 1e-5."""
    from algos import reward
    from tests.conftest import script_args
    from tests.test_sft import read_log
    logged = []
    for padding_free in (False, True):
        out = tmp_path / f"out_{padding_free}"
        reward.main(script_args(reward.Args, model_name_or_path=sft_model, dataset_name="tiny_tldr/tldr-preference",
                                per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1,
                                logging_steps=1, dataset_test_split="", num_sample_pairs=0,
                                padding_free=padding_free, output_dir=str(out)))
        logged.append(read_log(str(out))[0])
    padded, packed_run = logged
    keys = ["loss", "grad_norm", "accuracy"]
    assert {k: packed_run[k] for k in keys} == pytest.approx({k: padded[k] for k in keys}, rel=1e-5, abs=1e-6)


def test_reward_evaluation_padding_free_reads_packed_scores_equal_to_the_padded_ones(rm_model, tokenizer,
                                                                                  monkeypatch):
    """reward.py's evaluation with --padding_free scores every batch packed, and its metrics are the
    padded evaluation's to 1e-5."""
    from accelerate import Accelerator

    from algos import reward
    from common import packing
    from common.data import load_split
    from common.models import load_reward_model
    examples, _ = reward.tokenize(load_split("tiny_tldr/tldr-preference", "test").select(range(10)), tokenizer, 512)
    model, calls = load_reward_model(rm_model, tokenizer), []
    monkeypatch.setattr(reward, "packed_scores", lambda *a: calls.append(1) or packing.packed_scores(*a))
    metrics = [reward.evaluate(model, examples, reward.Args(per_device_eval_batch_size=4,
                                                                packing=packing.PackingArgs(padding_free)),
                               tokenizer, Accelerator(cpu=True)) for padding_free in (False, True)]
    assert len(calls) == 3  # 10 pairs in batches of 4
    assert metrics[1] == pytest.approx(metrics[0], rel=1e-5, abs=1e-6)


@pytest.mark.long  # script steps padded and packed: about 60 s together on 2 cores; .ci/run's lane 1
def test_a_ppo_step_padding_free_gives_the_padded_steps_values(tmp_path, tiny_model, rm_model, monkeypatch):
    """ppo.py's first rollout, padded and padding-free (policy, reference, value and reward model passes packed; 2
    PPO epochs, temperature 0.7): the reward model's scores, kl, policy and value losses and the gradient norm agree
    to 1e-5."""
    from algos import ppo
    from tests.conftest import script_args
    from tests.test_sft import read_log
    logged, calls = [], count_scoring(monkeypatch, ppo)
    for padding_free in (False, True):
        out, before = tmp_path / f"out_{padding_free}", dict(calls)
        ppo.main(script_args(ppo.Args, model_name_or_path=tiny_model, reward_model_path=rm_model,
                             per_device_train_batch_size=4, response_length=10, num_ppo_epochs=2, temperature=0.7,
                             max_steps=1, padding_free=padding_free, output_dir=str(out)))
        logged.append(read_log(str(out))[0])
        assert scored_by(calls, before, padding_free)
    padded, packed_run = logged
    keys = ["objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "grad_norm"]
    keys = [k for k in keys if k in padded]
    assert len(keys) >= 4
    assert {k: packed_run[k] for k in keys} == pytest.approx({k: padded[k] for k in keys}, rel=1e-5, abs=1e-6)


def _tiny(kind: str, attn: str):
    import transformers
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    configs = {"llama": transformers.LlamaConfig(num_key_value_heads=2, **common),
               "qwen2": transformers.Qwen2Config(num_key_value_heads=2, **common),
               "gpt2": transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4),
               "gpt_neox": transformers.GPTNeoXConfig(**common),
               "mamba": transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2)}
    torch.manual_seed(0)
    config = configs[kind.removesuffix("-classifier")]
    config._attn_implementation = attn
    if kind == "llama-classifier":
        config.num_labels = 1
        return transformers.AutoModelForSequenceClassification.from_config(config)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", "gpt_neox", "llama-classifier"])
def test_packing_check_passes_attention_models_whose_rows_stay_apart(kind, attn):
    from common.packing import check_packing
    check_packing(_tiny(kind, attn))  # no error


def test_packing_check_refuses_a_recurrent_model_in_one_line(capsys):
    """Mamba carries its state from one packed row into the next: refused, with the class and the way out."""
    from common.packing import check_packing
    from common.runtime import UserError
    model = _tiny("mamba", "eager")
    with pytest.raises(UserError, match="--padding_free: MambaForCausalLM lets packed rows see each other.*without "
                                        "--padding_free"):
        check_packing(model)
    assert model.training  # its mode is given back


def test_packing_check_refuses_an_attention_told_to_ignore_the_restarting_positions(monkeypatch):
    """An attention model run with a cache (transformers then reads the position ids as one sequence): the same
    check catches the rows attending across."""
    from common import packing
    from common.runtime import UserError
    model = _tiny("llama", "sdpa")
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, use_cache=None, **k: forward(*a, use_cache=True, **k))
    with pytest.raises(UserError, match="LlamaForCausalLM lets packed rows see each other"):
        packing.check_packing(model)
