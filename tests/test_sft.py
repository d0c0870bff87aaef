"""algos/sft.py: the loss against an independent computation, prompt masking, gradient
accumulation, end-to-end runs (1 and 2 processes) and bad input."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from algos import sft
from algos.sft import collate, sft_loss, tokenize
from tests.conftest import ROOT, run_script

SMALL = ["--per_device_train_batch_size", "4", "--eval_steps", "100", "--num_sample_generations", "1",
         "--max_new_tokens", "8"]


def test_sft_loss_equals_cross_entropy_on_completion_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    input_ids = torch.tensor([[1, 2, 3, 4, 0], [1, 5, 6, 0, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]])  # completions: [3, 4] and [5, 6]
    # independent: F.cross_entropy with ignore_index on the shifted labels
    labels = input_ids.masked_fill(loss_mask == 0, -100)[:, 1:]
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 7), labels.reshape(-1), ignore_index=-100)
    assert torch.allclose(sft_loss(logits, input_ids, loss_mask, num_tokens=4.0), expected, atol=1e-6)


def test_prompt_tokens_contribute_exactly_zero():
    torch.manual_seed(0)
    input_ids = torch.tensor([[1, 2, 3, 4, 5]])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1]])  # prompt = first 3 tokens
    logits = torch.randn(1, 5, 7, requires_grad=True)
    sft_loss(logits, input_ids, loss_mask, num_tokens=2.0).backward()
    # logits at positions 0 and 1 predict prompt tokens 2 and 3: no gradient at all
    assert logits.grad[0, :2].abs().sum() == 0
    assert logits.grad[0, 2:4].abs().sum() > 0
    assert logits.grad[0, 4].abs().sum() == 0  # the last position predicts nothing


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_collate_masks_prompt_and_padding_but_keeps_eos(tokenizer, pad_is_eos):
    if pad_is_eos:  # as SmolLM2 / Qwen2.5 ship: padding and the real EOS share one id
        tokenizer.pad_token = tokenizer.eos_token
    rows = [{"prompt": "TITLE: a\n\nTL;DR:", "completion": " my boss"},
            {"prompt": "TITLE: a longer title here\n\nTL;DR:", "completion": " x"}]
    examples, skipped = tokenize(rows, tokenizer, max_length=64)
    assert skipped == 0
    input_ids, attention_mask, loss_mask = collate(examples, tokenizer.pad_token_id)
    assert (input_ids == tokenizer.pad_token_id).any()  # one row is padded
    for row, (ids, mask) in enumerate(examples):
        n_prompt = mask.index(1)
        assert n_prompt == len(tokenizer(rows[row]["prompt"]).input_ids)
        assert loss_mask[row, :n_prompt].sum() == 0
        assert loss_mask[row, n_prompt:len(ids)].all()
        assert input_ids[row, len(ids) - 1] == tokenizer.eos_token_id  # EOS is a target ...
        assert loss_mask[row, len(ids) - 1] == 1  # ... even when it is also the pad id
        assert loss_mask[row, len(ids):].sum() == 0 and attention_mask[row, len(ids):].sum() == 0


def test_messages_without_an_assistant_turn_are_refused(tokenizer):
    from common.runtime import UserError

    rows = [{"messages": [{"role": "user", "content": "a"}]}]
    with pytest.raises(UserError, match="row 0: its messages hold no assistant turn"):
        tokenize(rows, tokenizer, max_length=64)


def test_every_assistant_turn_of_a_conversation_is_learnt_and_nothing_else(tokenizer):
    # a template without {% generation %} tags: a header per turn, the end of turn, a newline
    tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}" + tokenizer.eos_token
                               + "\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    turns = [("system", "be brief"), ("user", "hi there"), ("assistant", "hello you"), ("user", "and now"),
             ("assistant", "bye then")]
    rows = [{"messages": [{"role": r, "content": c} for r, c in turns]}]
    [(ids, mask)], _ = tokenize(rows, tokenizer, max_length=256)
    eos = tokenizer.eos_token
    full = "".join(f"<{r}>{c}{eos}\n" for r, c in turns).rstrip()  # the last newline is not kept
    assert tokenizer.decode(ids) == full and len(mask) == len(ids)
    learnt = [tokenizer.decode([i for i, m in zip(ids, mask) if m == k]) for k in (1,)]
    # by hand: the two replies and the end of turn after each, and no header, user or system text
    assert learnt == [f"hello you{eos}bye then{eos}"]
    spans = "".join(str(m) for m in mask)
    assert spans.count("01") == 2 and spans.endswith("1")  # two separate learnt spans, the last at the end


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


TOOL_ROW = {"messages": [
    {"role": "user", "content": "What is 123 * 456?"},
    {"role": "assistant", "tool_calls": [{"type": "function",
                                          "function": {"name": "multiply", "arguments": {"a": 123, "b": 456}}}]},
    {"role": "tool", "name": "multiply", "content": "56088"},
    {"role": "assistant", "content": "It is 56088."}]}


def test_tool_calls_are_learnt_and_tool_results_and_schemas_are_not(tokenizer):
    from transformers.utils import get_json_schema

    tokenizer.chat_template = open(os.path.join(ROOT, "configs", "chatml_tools.jinja")).read()
    tools = [get_json_schema(multiply)]
    [(ids, mask)], _ = tokenize([{**TOOL_ROW, "tools": tools}], tokenizer, max_length=1024)
    text, learnt = tokenizer.decode(ids), tokenizer.decode([i for i, m in zip(ids, mask) if m])
    # by hand: the schema in the system turn, the call as JSON in tags, the result in a user turn, none of it
    # learnt but the two assistant turns (each with its end of turn) and the EOS after the last
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 123, "b": 456}}\n</tool_call><|im_end|>'
    assert learnt == call + "It is 56088.<|im_end|>" + tokenizer.eos_token
    assert text.startswith("<|im_start|>system\n") and '"description": "the first factor"' in text
    assert "<tool_response>\n56088\n</tool_response>" in text and "56088" not in learnt.replace("It is 56088", "")
    assert text.endswith("<|im_start|>assistant\nIt is 56088.<|im_end|>" + tokenizer.eos_token)
    # the same row as Arrow stores it (null content and tool_calls filled in, the tools as one JSON string)
    from datasets import Dataset

    stored = Dataset.from_list([{**TOOL_ROW, "tools": json.dumps(tools)}, {"messages": TOOL_ROW["messages"][:1] + [
        {"role": "assistant", "content": "no"}], "tools": "[]"}])
    assert stored[0]["messages"][1]["content"] is None and stored[1]["messages"][1]["tool_calls"] is None
    assert tokenize(stored, tokenizer, max_length=1024)[0][0] == (ids, mask)


def test_a_message_with_neither_content_nor_tool_calls_is_refused():
    from datasets import Dataset

    from common.data import check_columns
    from common.runtime import UserError

    ok = Dataset.from_list([TOOL_ROW])
    assert check_columns(ok, {"messages": ["messages"]}, "data") == "messages"
    bad = Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}])
    with pytest.raises(UserError, match="in column 'messages' at row 0"):
        check_columns(bad, {"messages": ["messages"]}, "data")


def test_text_rows_learn_every_token_and_end_in_eos(tokenizer):
    [(ids, mask)], skipped = tokenize([{"text": "TITLE: a post\n\nTL;DR: my boss"}], tokenizer, max_length=64)
    assert skipped == 0 and ids == tokenizer("TITLE: a post\n\nTL;DR: my boss").input_ids + [tokenizer.eos_token_id]
    assert mask == [1] * len(ids)


def test_too_long_prompts_are_skipped_and_long_completions_cut(tokenizer):
    rows = [{"prompt": "word " * 50, "completion": " x"}, {"prompt": "TITLE:", "completion": " y" * 50}]
    examples, skipped = tokenize(rows, tokenizer, max_length=20)
    assert skipped == 1 and len(examples) == 1 and len(examples[0][0]) == 20


def read_log(output_dir):
    logs = os.path.join(output_dir, "logs")
    (name,) = [f for f in os.listdir(logs) if f.endswith(".jsonl")]
    with open(os.path.join(logs, name)) as f:
        return [json.loads(line) for line in f]


def test_sft_end_to_end_saves_a_loadable_model(tmp_path):
    out = str(tmp_path / "sft")
    proc = run_script("algos/sft.py", "--max_steps", "3", *SMALL, "--output_dir", out)
    assert "completion" in proc.stdout + proc.stderr and "reference" in proc.stdout + proc.stderr  # samples table
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2, 3] and "eval_loss" in log[-1]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert not any(name.startswith(".saving") for name in os.listdir(out))


def test_sft_on_text_rows_trains_and_shows_continuations(tmp_path):
    """Language-modelling data (a `text` column, as stanfordnlp/imdb): trains, evaluates, samples."""
    for split, n in (("train", 16), ("validation", 4)):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": f"TITLE: post {i}\n\nTL;DR: my boss ate my cake {i}"}) + "\n"
                         for i in range(n))
    out = str(tmp_path / "sft")
    proc = run_script("algos/sft.py", "--dataset_name", str(tmp_path), "--max_steps", "2",
                      "--per_device_train_batch_size", "4", "--eval_steps", "2",
                      "--logging_steps", "1", "--output_dir", out)
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2] and log[-1]["eval_loss"] < log[0]["loss"] + 1
    assert "TITLE: post 0" in proc.stdout + proc.stderr  # the samples table shows a text's start


def test_sft_on_tool_use_conversations_with_a_chat_template_file(tmp_path):
    """TRL's tool-use SFT rows (messages with tool calls and results, a tools column) through
    --chat_template_path: trains, shows the conversations, and saves the template with the model."""
    from transformers.utils import get_json_schema

    tools = [get_json_schema(multiply)]
    for split, n in (("train", 8), ("validation", 2)):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps({**TOOL_ROW, "tools": tools}) + "\n" for _ in range(n))
    out = str(tmp_path / "sft")
    template = os.path.join(ROOT, "configs", "chatml_tools.jinja")
    proc = run_script("algos/sft.py", "--dataset_name", str(tmp_path), "--chat_template_path", template,
                      "--max_steps", "2", "--per_device_train_batch_size", "4", "--eval_steps", "2",
                      "--num_sample_generations", "1", "--max_new_tokens", "4", "--output_dir", out)
    assert [r["step"] for r in read_log(out)] == [1, 2]
    console = proc.stdout + proc.stderr
    assert 'assistant: [{"type": "function", "function": {"name": "multiply"' in console  # the prompt's tool call
    assert AutoTokenizer.from_pretrained(out).chat_template == open(template).read()


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    """4 x 2 micro-batches and 8 x 1 see the same 8 examples: same loss, same weights after."""
    runs = {}
    for name, bs, ga in (("big", "8", "1"), ("acc", "4", "2")):
        out = str(tmp_path / name)
        run_script("algos/sft.py", "--max_steps", "2", *SMALL, "--per_device_train_batch_size", bs,
                   "--gradient_accumulation_steps", ga, "--dataset_test_split", "", "--output_dir", out)
        runs[name] = (read_log(out), AutoModelForCausalLM.from_pretrained(out).state_dict())
    (log_a, w_a), (log_b, w_b) = runs["big"], runs["acc"]
    for a, b in zip(log_a, log_b):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert all(torch.allclose(w_a[k], w_b[k], atol=1e-5) for k in w_a)


def test_help_documents_every_option():
    proc = run_script("algos/sft.py", "--help")
    for flag in ("--model-name-or-path", "--dataset-name", "--max-length", "--learning-rate", "--track"):
        assert flag in proc.stdout.replace("_", "-")
    assert "completion tokens" in proc.stdout  # a docstring made it into the help


@pytest.mark.usefixtures("one_torch_thread")
def test_default_first_step_gradient_against_the_cross_entropy_written_out(tmp_path, tiny_model, monkeypatch):
    """sft.py at its defaults on 4 fixed rows in one batch: the gradient of its first step against the
    summed negative log-likelihood of the completion tokens (EOS included, prompt tokens not) over their
    count, every row scored alone here."""
    from tests.first_step import (PAIRS, assert_gradient, encode, gradient, gradients_before_clipping, grads_of,
                                  own_logprobs, policy_with, weights_of, write_splits)
    rows = [{"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"]} for i, r in enumerate(PAIRS)]
    args = sft.Args(model_name_or_path=tiny_model, dataset_name=write_splits(tmp_path / "rows", rows),
                    per_device_train_batch_size=4, output_dir=str(tmp_path / "sft"))
    (record,) = gradients_before_clipping(monkeypatch, sft.main, args)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = policy_with(tiny_model, tokenizer, weights_of(record))
    encoded = [encode(tokenizer, r["prompt"], r["completion"]) for r in rows]
    tokens = sum(len(c) for _, c in encoded)
    loss = sum(-own_logprobs(model, p, c).sum() for p, c in encoded) / tokens
    assert_gradient(grads_of(record), {"cross-entropy": gradient(loss, model)})
