"""Dataset loading and validation, chat templates, and prompt/completion tokenization."""

import json
import os
import subprocess
import sys

import pytest
from datasets import Dataset, DatasetDict

from common.data import (as_completions, check_columns, completion_text, encode_completion, encode_prompt,
                         load_prompts, load_split, prompt_text)
from common.runtime import UserError
from tests.conftest import ROOT

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_load_jsonl_file_and_directory_and_save_to_disk(tmp_path):
    rows = [{"prompt": "a", "completion": " b"}, {"prompt": "c", "completion": " d"}]
    assert load_split(write_jsonl(tmp_path / "one.jsonl", rows), "train")["prompt"] == ["a", "c"]
    (tmp_path / "dir").mkdir()
    write_jsonl(tmp_path / "dir" / "train.jsonl", rows)
    write_jsonl(tmp_path / "dir" / "test.jsonl", rows[:1])
    assert len(load_split(str(tmp_path / "dir"), "test")) == 1
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    assert len(load_split(str(tmp_path / "saved"), "train")) == 2


def test_the_defaults_are_the_built_tiny_task(tiny_task):
    split = load_split("tiny_tldr/tldr-preference", "validation")  # a script's default, from the project root
    assert split.column_names == ["prompt", "chosen", "rejected"]


def test_an_unbuilt_tiny_task_says_how_to_build_it(tmp_path):
    """Run from a folder without tiny_tldr/: one line with the command that builds it, not a hub error."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "algos", "sft.py")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: the policy's tokenizer 'tiny_tldr/tiny-pythia' does not exist; "
                                                "build the tiny task first (from the project root): "
                                                "python benchmarks/tiny_tldr.py"]
    with pytest.raises(UserError, match="python benchmarks/tiny_tldr.py"):
        load_split("tiny_tldr/missing", "train")  # cwd: the project root (conftest)


@pytest.mark.parametrize("make,message", [
    (lambda p: str(p / "missing.jsonl"), "could not load dataset"),
    (lambda p: write_jsonl(p / "x.txt", [{"a": 1}]), "is not one of"),
])
def test_bad_paths_are_one_clear_error(tmp_path, make, message):
    with pytest.raises(UserError, match=message):
        load_split(make(tmp_path), "train")


def test_missing_split_names_the_available_ones(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(UserError, match=r"no split 'validation' \(it has: train\)"):
        load_split(path, "validation")


def test_empty_split_is_an_error(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "completion": "b"}])
    write_jsonl(tmp_path / "validation.jsonl", [])
    with pytest.raises(UserError, match="empty split"):
        load_split(str(tmp_path), "validation")
    Dataset.from_dict({"prompt": ["a"]}).filter(lambda r: False).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(UserError, match="split 'train' of dataset .* is empty"):
        load_split(str(tmp_path / "saved"), "train")


def test_load_prompts_keeps_each_prompts_end_and_refuses_too_few_for_a_batch(tmp_path, tokenizer):
    """The online scripts' prompts: each cut to its last max_tokens tokens (a TL;DR prompt ends in its question),
    and a split that fills no batch of distinct prompts refused with the flags that size the batch."""
    rows = [{"prompt": "one two three four five six seven eight nine ten"}, {"prompt": "a b"}, {"prompt": "c"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    got_rows, ids = load_prompts(tokenizer, path, "train", "grpo.py", 4, 3, "the flags")
    assert got_rows == rows
    for row, got in zip(rows, ids):
        full = encode_prompt(tokenizer, row["prompt"])
        assert got == full[-4:] and (len(full) <= 4 or got != full[:4])
    with pytest.raises(UserError, match=r"3 prompts make no full batch of 4 prompts \(8 x 2 / 4\)"):
        load_prompts(tokenizer, path, "train", "grpo.py", 4, 4, "8 x 2 / 4")


def test_completions_are_messages_after_a_conversation_and_text_after_text():
    chat = [{"role": "user", "content": "hi"}]
    assert as_completions([chat, "TL;DR:"], ["hello", "short"]) == [[{"role": "assistant", "content": "hello"}],
                                                                     "short"]


def test_check_columns_picks_a_format_or_lists_them():
    formats = {"prompt-completion": ["prompt", "completion"], "messages": ["messages"]}
    messages = Dataset.from_dict({"messages": [[{"role": "user", "content": "a"}]]})
    assert check_columns(messages, formats, "d") == "messages"
    with pytest.raises(UserError) as e:
        check_columns(Dataset.from_dict({"prompt": ["x"], "answer": ["y"]}), formats, "dataset 'd'")
    assert "[prompt, answer]" in str(e.value)
    assert "prompt-completion (prompt, completion: missing completion)" in str(e.value)


def test_completion_ends_in_exactly_one_eos(tokenizer):
    ids = encode_completion(tokenizer, "p", " my boss ate my cake.")
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in ids[:-1]
    again = encode_completion(tokenizer, "p", " my boss ate my cake.<|endoftext|>")
    assert again == ids


def test_bos_is_not_doubled(tokenizer):
    """A Llama-style tokenizer adds BOS to every call: the prompt gets one, the completion none."""
    from tokenizers import processors

    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, bos)])
    prompt, completion = encode_prompt(tokenizer, "TITLE: x"), encode_completion(tokenizer, "TITLE: x", " y")
    assert prompt[0] == bos and bos not in completion[:-1]
    assert (prompt + completion).count(bos) == 1 + completion.count(bos)
    # a chat template writes its own BOS: tokenizing the rendered text must not add a second one
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = encode_prompt(tokenizer, [{"role": "user", "content": "hi"}])
    assert ids[0] == bos and ids[1] != bos


def test_conversational_rows_go_through_the_chat_template(tokenizer):
    prompt = [{"role": "user", "content": "summarize"}]
    completion = [{"role": "assistant", "content": "short"}]
    with pytest.raises(UserError, match="no chat template"):
        prompt_text(tokenizer, prompt)
    tokenizer.chat_template = CHAT_TEMPLATE
    eos = tokenizer.eos_token
    assert prompt_text(tokenizer, prompt) == f"{eos}<user>summarize{eos}\n<assistant>"
    assert completion_text(tokenizer, prompt, completion) == f"short{eos}"
    ids = encode_completion(tokenizer, prompt, completion)
    assert tokenizer.decode(ids) == f"short{eos}"  # the turn's end is the EOS, written once
