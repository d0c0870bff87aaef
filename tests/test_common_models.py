"""Tokenizer/model loading: the pad token, reward heads, clear errors for bad paths."""

import pytest
from transformers import AutoTokenizer

from common.models import load_policy, load_reward_model, load_tokenizer
from common.runtime import UserError


def save_tokenizer_with(tiny_model, tmp_path, **special):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for key, value in special.items():
        setattr(tok, key, value)
    tok.save_pretrained(tmp_path)
    return str(tmp_path)


def test_pad_equal_to_eos_is_kept_as_shipped(tiny_model, tmp_path):
    path = save_tokenizer_with(tiny_model, tmp_path, pad_token="<|endoftext|>")
    tokenizer = load_tokenizer(path)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id and tokenizer.padding_side == "left"


def test_missing_pad_token_reuses_eos_and_reaches_the_config(tiny_model, tmp_path):
    path = save_tokenizer_with(tiny_model, tmp_path, pad_token=None)
    tokenizer = load_tokenizer(path)
    assert tokenizer.pad_token == tokenizer.eos_token
    vocab = len(AutoTokenizer.from_pretrained(tiny_model))
    assert len(tokenizer) == vocab  # no token added, so the embeddings need no new row
    model = load_policy(tiny_model, tokenizer)
    assert model.config.pad_token_id == tokenizer.eos_token_id == model.generation_config.pad_token_id


def test_reward_model_has_one_output(tiny_model, tokenizer):
    model = load_reward_model(tiny_model, tokenizer, new_head=True)
    out = model(**tokenizer(["TITLE: a", "TITLE: b"], return_tensors="pt"))
    assert out.logits.shape == (2, 1)


def test_causal_lm_as_reward_model_is_refused(tiny_model, tokenizer):
    # its score head would be freshly initialised: the run would train on random rewards
    with pytest.raises(UserError, match="is not a reward model .GPTNeoXForCausalLM, not a sequence classifier."):
        load_reward_model(tiny_model, tokenizer)


def test_wrong_model_path_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="could not load"):
        load_tokenizer(str(tmp_path / "nope"))


def test_frozen_reference_runs_under_the_policys_bf16_autocast(tmp_path, sft_model):
    # step 1's KL comes from the pass before its update: policy and reference hold the same weights, so it
    # is 0 exactly when both compute alike (in bf16)
    from tests.conftest import run_script
    from tests.test_sft import read_log

    out = str(tmp_path / "grpo")
    run_script("algos/grpo.py", "--model_name_or_path", sft_model, "--reward_model_paths", "--reward_funcs",
               "tests.toy_rewards:short", "--bf16", "--beta", "0.1", "--max_steps", "1",
               "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8",
               "--output_dir", out)
    assert read_log(out)[0]["kl"] == 0.0
