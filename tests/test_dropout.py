"""--disable_dropout (on by default in the online and preference scripts): with LoRA (lora_dropout
0.05) the first update's ratio pi / pi_old is exactly 1, as the old logprobs come from the same
weights; with dropout left on it is not. (from_pretrained leaves a model in eval mode, so there the
model's own dropout is off until a script calls train(), as dpo/kto do after an evaluation; LoRA's
new layers start in train mode.)"""

import importlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common.models import disable_dropout
from tests.test_sft import read_log
from tests.conftest import script_args


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory, sft_model):
    """The SFT model with dropout 0.1 after embeddings, attention and MLP, and on attention weights."""
    out = tmp_path_factory.mktemp("dropout_sft")
    config = AutoConfig.from_pretrained(sft_model, hidden_dropout=0.1, attention_dropout=0.1)
    AutoModelForCausalLM.from_pretrained(sft_model, config=config).save_pretrained(out)
    AutoTokenizer.from_pretrained(sft_model).save_pretrained(out)
    return str(out)


def test_two_passes_in_train_mode_agree_after_disable_dropout(dropout_model):
    model = AutoModelForCausalLM.from_pretrained(dropout_model).train()
    ids = torch.arange(3, 19).view(2, 8)
    assert not torch.equal(model(ids).logits, model(ids).logits)
    disable_dropout(model)
    assert torch.equal(model(ids).logits, model(ids).logits)


def first_ratio(script, out, **kw):
    """val/ratio of one rollout with one update over all of it: the first pass's ratio."""
    module = importlib.import_module(f"algos.{script}")
    module.main(script_args(module.Args, use_peft=True, reward_funcs=["tests.toy_rewards:short"], max_steps=1,
                            num_ppo_epochs=1, per_device_train_batch_size=4, output_dir=str(out), **kw))
    return read_log(out)[0]["val/ratio"]


@pytest.mark.parametrize("script", ["rloo", "ppo"])
def test_first_ratio_is_one_without_dropout(tmp_path, dropout_model, rm_model, script):
    kw = (dict(reward_model_path=rm_model, reward_weights=[0.0, 1.0], response_length=6) if script == "ppo" else
          dict(reward_model_paths=[], rloo_k=2, max_completion_length=6))
    ratios = {disable: first_ratio(script, tmp_path / str(disable), model_name_or_path=dropout_model,
                                   disable_dropout=disable, **kw) for disable in (True, False)}
    assert ratios[True] == 1.0 and ratios[False] != pytest.approx(1.0, abs=1e-7), ratios
