"""Bad input to the scripts: one line on stderr naming the problem, exit status 2, no traceback,
and nothing already saved in the output directory is touched."""

import json
import os

import pytest
from transformers import AutoTokenizer

from algos import reward, sft
from common.runtime import UserError
from tests.conftest import run_script


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_cli_error_is_one_line_exit_2_and_leaves_saved_model_untouched(tmp_path, sft_model):
    before = {f: os.path.getmtime(os.path.join(sft_model, f)) for f in os.listdir(sft_model)}
    bad = write_jsonl(tmp_path / "cols.jsonl", [{"prompt": "a", "answer": "b"}])
    proc = run_script("algos/sft.py", "--dataset_name", bad, "--output_dir", sft_model, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: dataset '{bad}' (split train), given to sft.py, has columns [prompt, answer], which "
                      "fit no accepted format: prompt-completion (prompt, completion: missing completion); "
                      "messages (messages: missing messages)"]
    assert {f: os.path.getmtime(os.path.join(sft_model, f)) for f in os.listdir(sft_model)} == before


def sft_args(tmp_path, **kw):
    defaults = dict(max_steps=1, per_device_train_batch_size=2, dataset_test_split="", gold_eval_split="",
                    output_dir=str(tmp_path / "out"))
    return sft.Args(**{**defaults, **kw})


def test_bad_inputs_to_sft(tmp_path, tiny_model):
    rows = [{"prompt": "TITLE: a\n\nTL;DR:", "completion": " b"}] * 4
    ok = write_jsonl(tmp_path / "ok.jsonl", rows)
    pad_is_eos = AutoTokenizer.from_pretrained(tiny_model)
    pad_is_eos.pad_token = pad_is_eos.eos_token
    pad_is_eos.save_pretrained(tmp_path / "tok")  # the tokenizer is checked before the model loads
    cases = [
        (dict(dataset_name=str(tmp_path / "missing")), "could not load dataset"),
        (dict(model_name_or_path=str(tmp_path / "nope")), "could not load"),
        (dict(dataset_name=ok, dataset_test_split="validation"), "no split 'validation'"),
        (dict(dataset_name=ok, max_length=3), "every training prompt is >= max_length=3"),
        (dict(dataset_name=ok, per_device_train_batch_size=8, max_steps=-1),
         "4 training examples make no full batch of 8 (per_device_train_batch_size 8"),
        (dict(model_name_or_path=str(tmp_path / "tok")), "never learn to stop"),
    ]
    for kw, message in cases:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            sft.main(sft_args(tmp_path, **kw))
    assert not os.path.exists(tmp_path / "out" / "config.json")


@pytest.mark.parametrize("rows,message", [
    ([{"prompt": "a", "chosen": "b"}], r"columns \[prompt, chosen\].*preference \(prompt, chosen, rejected: missing rejected\)"),
    ([{"prompt": "a", "chosen": " b", "rejected": " b"}] * 3, "no training pair left"),
])
def test_bad_inputs_to_reward(tmp_path, sft_model, rows, message):
    args = reward.Args(model_name_or_path=sft_model, dataset_name=write_jsonl(tmp_path / "d.jsonl", rows),
                       dataset_test_split="", max_steps=1, output_dir=str(tmp_path / "rm"))
    with pytest.raises(UserError, match=message):
        reward.main(args)


def test_reward_without_an_sft_model_says_so(tmp_path):
    with pytest.raises(UserError, match="could not load 'nowhere/sft'"):
        reward.main(reward.Args(model_name_or_path="nowhere/sft", output_dir=str(tmp_path / "rm")))
