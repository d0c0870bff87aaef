"""benchmarks/tool_use.py in quick mode on SmolLM2-135M-Instruct (python -m pytest -m realmodel): the chain runs
(a multi-turn SFT warm-up on tool-use conversations, then grpo and rloo through --environment_factory), every
stage is evaluated in greedy episodes and the report is written; and the evaluation's own episode loop (plain
transformers, not common/episodes.py) runs a call, appends its result and reads the final reply, checked on a
stand-in model whose replies are fixed."""

import json
import os

import pytest
import torch

from benchmarks import tool_use
from tests.conftest import run_script
from tests.test_realmodel import one_thread, smollm2  # noqa: F401  (fixtures: one torch thread, the model)


class Scripted:
    """A stand-in for model.generate: turn k of every episode is replies[k], then EOS."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.prompts = tokenizer, replies, []

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        self.prompts.append(self.tokenizer.batch_decode(input_ids, skip_special_tokens=False))
        reply = self.tokenizer(self.replies[len(self.prompts) - 1], add_special_tokens=False).input_ids
        reply = torch.tensor(reply + [self.tokenizer.eos_token_id]).expand(len(input_ids), -1)
        return torch.cat([input_ids, reply], 1)


@pytest.mark.realmodel
def test_the_evaluation_runs_a_call_and_reads_the_final_reply(smollm2):  # noqa: F811
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tokenizer.chat_template, tokenizer.padding_side = open(tool_use.TEMPLATE).read(), "left"
    rows = tool_use.problems(2, seed=5)
    a, b = (int(x) for x in rows[0]["prompt"][0]["content"][8:-1].split(" times "))
    model = Scripted(tokenizer, [f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n'
                                 '</tool_call>', "It is 12."])
    talks = tool_use.episodes(model, tokenizer, rows[:1])
    # the second turn saw the product as a tool response, after the call, in the rendered conversation
    assert len(model.prompts) == 2 and f"<tool_response>\n{a * b}\n</tool_response>" in model.prompts[1][0]
    assert talks[0][0]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": a, "b": b}}
    assert talks[0][1] == {"role": "tool", "name": "multiply", "content": str(a * b)}
    assert talks[0][2] == {"role": "assistant", "content": "It is 12."}
    assert tool_use.correct(talks, [rows[0]["answer"]]) == [0.0]  # the final reply is read, not the tool's result
    assert tool_use.correct(talks, ["12"]) == [1.0]
    # a call to a tool that does not exist is answered with an error, not run as multiply
    model = Scripted(tokenizer, ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', "5"])
    talks = tool_use.episodes(model, tokenizer, rows[:1])
    assert talks[0][1]["content"] == str({"error": "Tool add not found."})


@pytest.mark.realmodel
def test_quick_chain_runs_every_stage_and_writes_the_report(smollm2, tmp_path):  # noqa: F811
    out, results = tmp_path / "chain", tmp_path / "results"
    run_script("benchmarks/tool_use.py", "--quick", "--model_name_or_path", smollm2, "--output_dir", str(out),
               "--results_dir", str(results), timeout=1200)
    with open(results / "tool_use.json") as f:
        result = json.load(f)
    assert result["start"]["n"] == 8 and set(result["methods"]) == set(tool_use.STAGES)
    for name, method in result["methods"].items():
        run = method["runs"]["1"]
        assert run["n"] == 8 and len(run["correct"]) == 8 and run["turns"] >= 1, name
        assert len(run["train_log"]) == 2, name  # its 2 steps were logged
    for name in ("grpo", "rloo"):  # the episodes' metrics reached the log
        assert all("tools/call_frequency" in r and "episodes/turns_mean" in r
                   for r in result["methods"][name]["runs"]["1"]["train_log"]), name
    report = (results / "tool_use.md").read_text()
    assert "QUICK MODE" in report and all(f"| {title} |" in report for title in tool_use.TITLES.values())
    assert os.path.isfile(out / "seed_1" / "warmup" / "tokenizer_config.json")
