"""Bad input to the scripts: one line on stderr naming the problem, exit status 2, no traceback,
and nothing already saved in the output directory is touched."""

import json
import os

import pytest
from transformers import AutoTokenizer

from tests.conftest import run_script

FAST = ["--max_steps", "1", "--per_device_train_batch_size", "2"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0]


def test_bad_inputs_to_sft(tmp_path, tiny_model):
    rows = [{"prompt": "TITLE: a\n\nTL;DR:", "completion": " b"}] * 4
    pad_is_eos = AutoTokenizer.from_pretrained(tiny_model)
    pad_is_eos.pad_token = pad_is_eos.eos_token
    pad_is_eos.save_pretrained(tmp_path / "tok")  # the tokenizer is checked before the model loads
    cases = [
        (["--dataset_name", write_jsonl(tmp_path / "cols.jsonl", [{"prompt": "a", "answer": "b"}])],
         ["columns [prompt, answer]", "prompt-completion (prompt, completion)"]),
        (["--dataset_name", str(tmp_path / "missing")], ["could not load dataset"]),
        (["--dataset_name", write_jsonl(tmp_path / "ok.jsonl", rows), "--dataset_test_split", "validation"],
         ["no split 'validation'"]),
        (["--dataset_name", write_jsonl(tmp_path / "ok2.jsonl", rows), "--dataset_test_split", "",
          "--max_length", "3"], ["max_length=3"]),
        (["--dataset_name", write_jsonl(tmp_path / "few.jsonl", rows), "--dataset_test_split", "",
          "--per_device_train_batch_size", "8", "--max_steps", "-1"], ["per_device_train_batch_size 8"]),
        (["--model_name_or_path", str(tmp_path / "tok")], ["never learn to stop"]),
    ]
    for argv, needles in cases:
        proc = run_script("algos/sft.py", *FAST, "--gold_eval_split", "", *argv, "--output_dir", str(tmp_path / "out"), check=False)
        assert_one_line_error(proc, *needles)


def test_failed_run_leaves_saved_model_untouched(tmp_path, sft_model):
    before = {f: os.path.getmtime(os.path.join(sft_model, f)) for f in os.listdir(sft_model)}
    proc = run_script("algos/sft.py", *FAST, "--dataset_name", str(tmp_path / "missing"),
                      "--output_dir", sft_model, check=False)
    assert proc.returncode == 2
    assert {f: os.path.getmtime(os.path.join(sft_model, f)) for f in os.listdir(sft_model)} == before


@pytest.mark.parametrize("rows,needles", [
    ([{"prompt": "a", "chosen": "b"}], ["columns [prompt, chosen]", "preference (prompt, chosen, rejected)"]),
    ([{"prompt": "a", "chosen": " b", "rejected": " b"}] * 3, ["no training pair left"]),
])
def test_bad_inputs_to_reward(tmp_path, sft_model, rows, needles):
    proc = run_script("algos/reward.py", *FAST, "--model_name_or_path", sft_model, "--dataset_test_split", "",
                      "--dataset_name", write_jsonl(tmp_path / "d.jsonl", rows),
                      "--output_dir", str(tmp_path / "rm"), check=False)
    assert_one_line_error(proc, *needles)
