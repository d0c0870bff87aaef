"""pad == eos (SmolLM2, Qwen2.5 and most chat tokenizers ship so): sampling, truncation at the first
EOS, logprob masks and reward-model scores are the same as with a distinct pad token, because every
mask comes from lengths and from each completion's first EOS, never from `ids == pad_token_id`."""

import math

import pytest
import torch

from common.generation import generate, shifted_logits, token_logprobs
from common.models import load_policy, load_reward_model, load_tokenizer
from common.rewards import score_with_model
from tests.conftest import script_args

PROMPTS = ["TITLE: a\n\nTL;DR:", "TITLE: my cat ate the whole cake and\n\nTL;DR:", "TITLE: b c\n\nTL;DR:"] * 4


@pytest.fixture()
def tokenizers(tiny_model):
    distinct, same = load_tokenizer(tiny_model), load_tokenizer(tiny_model)
    same.pad_token = same.eos_token
    assert distinct.pad_token_id != distinct.eos_token_id and same.pad_token_id == same.eos_token_id
    return distinct, same


def test_sampling_truncation_and_logprob_masks_do_not_depend_on_the_pad_id(tiny_model, tokenizers):
    torch.manual_seed(0)
    model = load_policy(tiny_model, tokenizers[0]).eval()
    boost = torch.zeros(model.config.vocab_size)
    boost[tokenizers[0].eos_token_id] = 3.0  # so that some completions stop and some do not
    model.get_output_embeddings().register_forward_hook(lambda module, inputs, logits: logits + boost)
    results = []
    for tok in tokenizers:
        prompts = [tok(p).input_ids for p in PROMPTS]
        out = generate(model, tok, prompts, 16, temperature=1.0, seeds=list(range(len(prompts))))
        p_ids, p_mask, c_ids, c_mask, finished = (out.prompt_ids, out.prompt_mask, out.completion_ids,
                                                  out.completion_mask, out.finished)
        ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
        with torch.no_grad():
            logps = token_logprobs(shifted_logits(model, ids, mask)[:, p_ids.shape[1] - 1:], c_ids) * c_mask
        results.append((c_ids * c_mask, c_mask, finished, logps))
    (ids_a, mask_a, fin_a, logps_a), (ids_b, mask_b, fin_b, logps_b) = results
    assert 0 < fin_a.sum() < len(PROMPTS)  # both kinds of completion are in the batch
    assert torch.equal(ids_a, ids_b) and torch.equal(mask_a, mask_b) and torch.equal(fin_a, fin_b)
    lengths = mask_b.sum(1)
    for row in range(len(PROMPTS)):  # the EOS is kept in the mask: the model learns to stop
        if fin_b[row]:
            assert ids_b[row, lengths[row] - 1] == tokenizers[1].eos_token_id and mask_b[row, lengths[row] - 1] == 1
    assert torch.allclose(logps_a, logps_b, atol=1e-6)


def test_reward_model_reads_the_eos_with_either_pad_token(tiny_model, tokenizers):
    distinct, same = tokenizers
    torch.manual_seed(0)
    rm = load_reward_model(tiny_model, distinct, new_head=True).eval()
    prompts, completions = PROMPTS[:3], [" my cat", " a b c d e f", " x"]
    # independent value: each sequence alone, unpadded, read at its last token (the EOS)
    with torch.no_grad():
        alone = [rm(input_ids=torch.tensor([distinct(p).input_ids + distinct(c).input_ids + [distinct.eos_token_id]])
                    ).logits[0, 0].item() for p, c in zip(prompts, completions)]
    a = score_with_model(rm, distinct, prompts, completions)
    rm.config.pad_token_id = same.pad_token_id  # as a pad == eos reward model is saved
    b = score_with_model(rm, same, prompts, completions)
    assert a.tolist() == pytest.approx(alone, abs=1e-5) and b.tolist() == pytest.approx(alone, abs=1e-5)
    # what HF's own pooling does with pad == eos: it skips the EOS and reads the token before it
    ids = torch.tensor([same(prompts[0]).input_ids + same(completions[0]).input_ids + [same.eos_token_id]])
    with torch.no_grad():
        assert rm(input_ids=ids).logits[0, 0].item() != pytest.approx(alone[0], abs=1e-3)


@pytest.fixture(scope="module")
def pad_is_eos_models(tmp_path_factory, tiny_model):
    """The tiny model and a one-label classifier of it, saved with a tokenizer whose pad is its EOS."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path_factory.mktemp("pad_is_eos")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.pad_token = tokenizer.eos_token
    for name, cls in (("policy", AutoModelForCausalLM), ("rm", AutoModelForSequenceClassification)):
        cls.from_pretrained(tiny_model, **({"num_labels": 1} if name == "rm" else {})).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return str(root / "policy"), str(root / "rm")


@pytest.mark.parametrize("script", ["sft", "reward", "dpo", "kto", "grpo", "rloo", "online_dpo", "ppo", "gkd"])
def test_every_script_trains_with_the_tokenizer_as_shipped(tmp_path, pad_is_eos_models, script):
    import importlib

    from tests.test_bad_input import GOOD_ROWS, SCRIPT_ARGS, write_jsonl
    from tests.test_sft import read_log

    policy, rm = pad_is_eos_models
    module = importlib.import_module(f"algos.{script}")
    kw = {**dict(model_name_or_path=policy, dataset_name=write_jsonl(tmp_path / "d.jsonl", GOOD_ROWS[script]),
                 max_steps=1, per_device_train_batch_size=2, output_dir=str(tmp_path / "out")), **SCRIPT_ARGS[script]}
    if script == "ppo":
        kw["reward_model_path"] = rm
    if script == "gkd":  # student and teacher alike: the loss is 0, the pass runs with pad == eos on both
        kw["teacher_model_name_or_path"] = policy
    module.main(script_args(module.Args, **kw))
    record = read_log(tmp_path / "out")[0]
    assert record["step"] == 1 and all(math.isfinite(v) for v in record.values())
