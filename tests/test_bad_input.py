"""Bad input to the scripts: one line on stderr naming the problem, exit status 2, no traceback,
and nothing already saved in the output directory is touched."""

import json
import os
import time

import pytest
from transformers import AutoTokenizer

from algos import dpo, kto, reward, sft
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


@pytest.mark.parametrize("rows,extra,message", [
    ([{"prompt": "a", "chosen": " b", "rejected": " b"}, {"prompt": "a", "chosen": "", "rejected": " c"},
      {"prompt": "a " * 40, "chosen": " b", "rejected": " c"}], {},
     "no pair of split 'train' is left to train on: 1 chosen == rejected, 1 empty completion, "
     "1 prompt leaves no room under max_length=32"),
    ([{"chosen": "a b", "rejected": "a c"}], {}, "chosen/rejected without a prompt must be conversations"),
    ([{"prompt": "a", "chosen": " b", "rejected": " c"}], {"precompute_ref_logps": True, "sync_ref_model": True},
     "exclude each other"),
    ([{"prompt": "a", "chosen": " b", "rejected": " c"}], {"loss_type": "robust", "label_smoothing": 0.5},
     "robust needs 0 <= label_smoothing < 0.5"),
])
def test_bad_inputs_to_dpo(tmp_path, sft_model, rows, extra, message):
    args = dpo.Args(model_name_or_path=sft_model, dataset_name=write_jsonl(tmp_path / "d.jsonl", rows),
                    dataset_test_split="", max_steps=1, max_length=32, output_dir=str(tmp_path / "dpo"), **extra)
    with pytest.raises(UserError, match=message):
        dpo.main(args)


@pytest.mark.parametrize("rows,extra,message", [
    ([{"prompt": "a", "completion": " ", "label": True}, {"prompt": "a", "completion": " b", "label": "yes"}], {},
     "no row of split 'train' is left to train on: 1 empty completion, 1 label not true/false"),
    ([{"prompt": "a", "completion": " b"}], {}, r"unpaired \(prompt, completion, label: missing label\)"),
    ([{"prompt": "a", "completion": " b", "label": True}], {"per_device_train_batch_size": 1}, "must be >= 2"),
])
def test_bad_inputs_to_kto(tmp_path, sft_model, rows, extra, message):
    args = kto.Args(model_name_or_path=sft_model, dataset_name=write_jsonl(tmp_path / "d.jsonl", rows),
                    dataset_test_split="", max_steps=1, output_dir=str(tmp_path / "kto"), **extra)
    with pytest.raises(UserError, match=message):
        kto.main(args)


def test_scale_out_options_fail_early_with_one_line(tmp_path, sft_model, monkeypatch):
    from algos import grpo

    common = dict(model_name_or_path=sft_model, reward_model_paths=[], reward_funcs=["tests.toy_rewards:short"],
                  max_steps=1, per_device_train_batch_size=4, num_generations=2, output_dir=str(tmp_path / "out"))
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # as if vLLM were not installed
    with pytest.raises(UserError, match=r"--use_vllm needs vLLM: pip install 'minimal-post-training\[vllm\]'"):
        grpo.main(grpo.Args(use_vllm=True, **common))
    monkeypatch.setitem(__import__("sys").modules, "peft", None)
    with pytest.raises(UserError, match=r"--use_peft needs peft: pip install 'minimal-post-training\[peft\]'"):
        grpo.main(grpo.Args(use_peft=True, **common))
    with pytest.raises(UserError, match="--sync_ref_model mixes the policy into a separate reference"):
        dpo.main(dpo.Args(model_name_or_path=sft_model, use_peft=True, sync_ref_model=True))


def test_a_server_that_never_comes_up_is_one_clear_error():
    from algos import grpo
    from common.vllm import wait_for_server

    args = grpo.Args(use_vllm=True, vllm_mode="server", vllm_server_port=9, vllm_server_timeout=2)  # nothing listens on 9
    start = time.time()
    with pytest.raises(UserError, match=r"no vLLM server answered at http://127.0.0.1:9 within 2 s; start one with "):
        wait_for_server(args)
    assert time.time() - start < 10
