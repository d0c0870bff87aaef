"""Tokenizer/model loading: the pad token, reward heads, clear errors for bad paths."""

import pytest
from transformers import AutoTokenizer

from common.models import PAD_TOKEN, load_policy, load_reward_model, load_tokenizer
from common.runtime import UserError, exact_div


def save_tokenizer_with(tiny_model, tmp_path, **special):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for key, value in special.items():
        setattr(tok, key, value)
    tok.save_pretrained(tmp_path)
    return str(tmp_path)


def test_pad_equal_to_eos_is_refused(tiny_model, tmp_path):
    path = save_tokenizer_with(tiny_model, tmp_path, pad_token="<|endoftext|>")
    with pytest.raises(UserError, match="never learn to stop"):
        load_tokenizer(path)


def test_missing_pad_token_is_added_and_embeddings_grow(tiny_model, tmp_path):
    path = save_tokenizer_with(tiny_model, tmp_path, pad_token=None)
    tokenizer = load_tokenizer(path)
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"
    model = load_policy(tiny_model, tokenizer)
    assert model.get_input_embeddings().weight.shape[0] >= len(tokenizer)
    assert model.config.pad_token_id == tokenizer.pad_token_id == model.generation_config.pad_token_id


def test_reward_model_has_one_output(tiny_model, tokenizer):
    model = load_reward_model(tiny_model, tokenizer)
    out = model(**tokenizer(["TITLE: a", "TITLE: b"], return_tensors="pt"))
    assert out.logits.shape == (2, 1)


def test_wrong_model_path_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="could not load"):
        load_tokenizer(str(tmp_path / "nope"))


def test_exact_div_names_the_flags():
    assert exact_div(12, 4, "x") == 3
    with pytest.raises(UserError, match=r"--batch must divide \(10 is not divisible by 4\)"):
        exact_div(10, 4, "--batch must divide")
