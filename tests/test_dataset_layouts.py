"""The dataset layouts of TRL's "dataset formats" page, with rows modelled on the hub datasets TRL's
documentation uses, and hub snapshot folders (data/*.parquet + a README with `configs:`).

Standard (string) layouts run on the tiny model; conversational ones need a chat template and run on
SmolLM2-135M-Instruct as shipped (tests/test_realmodel.py, marker realmodel) further down.
"""

import json
import math

import pytest
from datasets import Dataset

from algos import dpo, kto, reward
from common.data import NO_SHARED_START, load_split, split_implicit_prompt
from common.runtime import UserError
from tests.conftest import run_script
from tests.test_sft import read_log

# Anthropic/hh-rlhf: chosen and rejected are whole dialogues as strings, no prompt column
HH = [{"chosen": f"\n\nHuman: What is {i} + 1?\n\nAssistant: It is {i + 1}.",
       "rejected": f"\n\nHuman: What is {i} + 1?\n\nAssistant: No idea, sorry."} for i in range(8)]


def write_snapshot(root, splits: dict) -> str:
    """A folder laid out as `huggingface-cli download --repo-type dataset` leaves a hub dataset."""
    (root / "data").mkdir(parents=True)
    for split, rows in splits.items():
        Dataset.from_list(rows).to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    files = "".join(f"  - split: {split}\n    path: data/{split}-*\n" for split in splits)
    (root / "README.md").write_text(f"---\nconfigs:\n- config_name: default\n  data_files:\n{files}---\n# a dataset\n")
    return str(root)


def test_implicit_prompt_is_the_shared_start_cut_at_a_word():
    assert split_implicit_prompt(HH[0]["chosen"], HH[0]["rejected"]) == (
        "\n\nHuman: What is 0 + 1?\n\nAssistant:", " It is 1.", " No idea, sorry.")
    # words both completions open with stay in the prompt; a completion that is the other's start
    # still keeps its last word
    assert split_implicit_prompt("Q: x\nA: it is red", "Q: x\nA: it is blue") == ("Q: x\nA: it is", " red", " blue")
    assert split_implicit_prompt("Q: x\nA: red", "Q: x\nA: red car") == ("Q: x\nA:", " red", " red car")
    assert split_implicit_prompt("red", "blue") == ("", "red", "blue")
    user, a, b = ({"role": r, "content": c} for r, c in (("user", "hi"), ("assistant", "hello"), ("assistant", "go")))
    assert split_implicit_prompt([user, a], [user, b]) == ([user], [a], [b])
    assert split_implicit_prompt([a], [b]) == ([], [a], [b])


def test_a_hub_snapshot_folder_loads_by_its_readme_configs(tmp_path):
    path = write_snapshot(tmp_path / "hh", {"train": HH[:6], "test": HH[6:]})
    assert load_split(path, "test")[:] == {k: [r[k] for r in HH[6:]] for k in HH[0]}
    with pytest.raises(UserError, match=r"has no split 'validation' \(it has: train, test\)"):
        load_split(path, "validation")


def test_hh_rlhf_rows_tokenize_for_reward_and_kto(tokenizer):
    (prompt, chosen, rejected, margin), = reward.tokenize(HH[:1], tokenizer, max_length=64)[0]
    assert tokenizer.decode(prompt) == "\n\nHuman: What is 0 + 1?\n\nAssistant:"
    assert tokenizer.decode(chosen) == " It is 1.<|endoftext|>" and margin == 0.0
    assert tokenizer.decode(rejected) == " No idea, sorry.<|endoftext|>"
    rows = list(kto.unpaired_rows(HH[:1] + [{"chosen": "red", "rejected": "blue"}], "implicit prompt"))
    assert rows[:2] == [("\n\nHuman: What is 0 + 1?\n\nAssistant:", " It is 1.", True),
                        ("\n\nHuman: What is 0 + 1?\n\nAssistant:", " No idea, sorry.", False)]
    limits = kto.Args(max_length=64, max_prompt_length=32, max_completion_length=16)
    examples, skipped = kto.tokenize(rows, tokenizer, limits)
    assert [label for _, _, label in examples] == [True, False] and skipped == {NO_SHARED_START: 2}


def test_ultrafeedback_conversations_tokenize_for_dpo_with_the_prompt_split_off(tokenizer):
    """trl-lib/ultrafeedback_binarized: chosen and rejected are conversations that both hold the user
    turn, no prompt column. dpo.py splits off the shared user turn as the prompt (rendered by the chat
    template, with its generation prompt) and learns each reply alone, ending in one EOS."""
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    rows = [{"chosen": user + [{"role": "assistant", "content": "5"}], "score_chosen": 8.0,
             "rejected": user + [{"role": "assistant", "content": "No idea."}], "score_rejected": 2.0}]
    examples, skipped = dpo.tokenize(rows, tokenizer, dpo.Args(max_length=64, max_prompt_length=48,
                                                               max_completion_length=16))
    assert not skipped and [[tokenizer.decode(ids) for ids in example] for example in examples] == [
        ["<|user|>What is 2 + 3?\n<|assistant|>", "5<|endoftext|>", "No idea.<|endoftext|>"]]


@pytest.mark.parametrize("script", ["reward", "dpo", "kto"])
def test_hh_rlhf_snapshot_trains_every_preference_script(tmp_path, sft_model, script):
    """Anthropic/hh-rlhf as downloaded (parquet under data/, a README naming the splits): no prompt
    column, plain strings; each preference script trains on it, evaluating on its test split."""
    data = write_snapshot(tmp_path / "hh", {"train": HH, "test": HH[:4]})
    out = str(tmp_path / script)
    run_script(f"algos/{script}.py", "--model_name_or_path", sft_model, "--dataset_name", data,
               "--dataset_test_split", "test", "--max_steps", "2", "--per_device_train_batch_size", "4",
               "--eval_steps", "2", "--logging_steps", "1", "--output_dir", out,
               *(["--num_sample_generations", "1", "--max_new_tokens", "4"] if script != "reward" else []))
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2] and all(math.isfinite(r["loss"]) for r in log)
    assert math.isfinite(log[-1]["eval_loss"])


def test_a_layout_that_cannot_work_is_one_line(tmp_path, sft_model):
    """HuggingFaceH4/ultrafeedback_binarized puts the prompt as a string beside conversational
    chosen/rejected that repeat it: strings and messages cannot be joined into one sequence."""
    user = [{"role": "user", "content": "hi"}]
    rows = [{"prompt": "hi", "chosen": user + [{"role": "assistant", "content": "hello"}],
             "rejected": user + [{"role": "assistant", "content": "go"}], "score_chosen": 8.0}] * 4
    path = tmp_path / "uf.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError,
                       match=r"mixes strings \(column 'prompt'\) with lists of messages \(column 'chosen'\)"):
        reward.main(reward.Args(model_name_or_path=sft_model, dataset_name=str(path), dataset_test_split="",
                                max_steps=1, output_dir=str(tmp_path / "rm")))
