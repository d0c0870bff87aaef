"""benchmarks/tool_use.py. In the default suite: the tasks' data (the chain task's warm-up conversations call
multiply, then add on its result; the mixed task's "plus first" half calls the tools in 3% only, multiplying its
last two numbers), the accuracy on each form, the stage graph (gkd waits for the pick of the better RL model, its
teacher) and the pick. On SmolLM2-135M-Instruct (python -m pytest -m realmodel): the mixed task in quick mode
(a multi-turn SFT warm-up on tool-use conversations, then grpo and rloo through --environment_factory, gkd from the
better of them), every stage evaluated in greedy episodes and the report written; and the evaluation's own episode
loop (plain transformers, not common/episodes.py) runs each call, appends its result and reads the final reply,
checked on a stand-in model whose replies are fixed."""

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


def test_chain_data_answers_and_warmup_conversations_call_multiply_then_add_on_its_result(tmp_path):
    args = tool_use.Args(task="chain", output_dir=str(tmp_path), warmup_rows=200, tool_share=0.25)
    tool_use.write_task(args)
    read = lambda *p: [json.loads(line) for line in open(os.path.join(tmp_path, "data", *p))]  # noqa: E731
    test, prompts, warmup = read("test.jsonl"), read("prompts", "train.jsonl"), read("warmup", "train.jsonl")
    assert len(test) == 300 and len(prompts) == 1800 and len(warmup) == 200
    for row in test[:20] + prompts[:20]:
        a, b, c = (int(x) for x in row["prompt"][0]["content"].removeprefix("What is ").rstrip("?").replace(
            " times ", " ").replace(" plus ", " ").split())
        assert row["answer"] == str(a * b + c) and all(99 < x < 1000 for x in (a, b, c))
    assert not {tool_use.numbers(r) for r in test} & {tool_use.numbers(r) for r in prompts}
    kinds = {2: 0, 4: 0, 6: 0}
    for row in warmup:
        m, (a, b, c) = row["messages"], tool_use.numbers({"prompt": row["messages"]})
        kinds[len(m)] += 1
        assert m[-1] == {"role": "assistant", "content": f"{a} times {b} plus {c} is {a * b + c}."}
        assert [t["function"]["name"] for t in json.loads(row["tools"])] == ["add", "multiply"]  # as training's
        if len(m) > 2:
            assert m[1]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": a, "b": b}}
            assert m[2] == {"role": "tool", "name": "multiply", "content": str(a * b)}
        if len(m) > 4:
            assert m[3]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": a * b, "b": c}}
            assert m[4] == {"role": "tool", "name": "add", "content": str(a * b + c)}
    assert 30 <= kinds[6] <= 70 and 30 <= kinds[4] <= 70  # 25% each of 200 (50), the rest direct
    (row,) = tool_use.problems(1, seed=0)  # the multiply task: "What is a times b?", the product
    a, b = tool_use.numbers(row)
    assert row["prompt"][0]["content"] == f"What is {a} times {b}?" and row["answer"] == str(a * b)


def test_mixed_data_half_plus_first_whose_warmup_chains_in_a_few_multiplying_the_last_two(tmp_path):
    args = tool_use.Args(task="mixed", output_dir=str(tmp_path), warmup_rows=240, tool_share=0.3)
    tool_use.write_task(args)
    read = lambda *p: [json.loads(line) for line in open(os.path.join(tmp_path, "data", *p))]  # noqa: E731
    test, warmup = read("test.jsonl"), read("warmup", "train.jsonl")
    for row in test[:40]:  # each form's value, times before plus, and the form told by the words' order
        a, b, c = tool_use.numbers(row)
        if row["prompt"][0]["content"] == f"What is {a} plus {b} times {c}?":
            assert tool_use.plus_first(row) and row["answer"] == str(a + b * c)
        else:
            assert row["prompt"][0]["content"] == f"What is {a} times {b} plus {c}?"
            assert not tool_use.plus_first(row) and row["answer"] == str(a * b + c)
    assert 120 <= sum(map(tool_use.plus_first, test)) <= 180  # half of 300
    kinds = {(f, n): 0 for f in (False, True) for n in (2, 4, 6)}
    for row in warmup:
        m, (a, b, c) = row["messages"], tool_use.numbers({"prompt": row["messages"]})
        first = tool_use.plus_first({"prompt": m})
        kinds[first, len(m)] += 1
        value = a + b * c if first else a * b + c
        assert m[-1]["content"].endswith(f" is {value}.")
        if len(m) > 2:  # multiply on the factors (the last two numbers when plus comes first), add the other
            x, y, z = (b, c, a) if first else (a, b, c)
            assert m[1]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": x, "b": y}}
            assert m[2] == {"role": "tool", "name": "multiply", "content": str(x * y)}
        if len(m) > 4:
            assert m[3]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": x * y, "b": z}}
            assert m[4] == {"role": "tool", "name": "add", "content": str(value)}
    assert kinds[True, 4] == 0 and 1 <= kinds[True, 6] <= 12  # the whole chain in 3%, never multiply alone
    assert 15 <= kinds[False, 6] <= 50 and 20 <= kinds[False, 4] <= 55  # the other form: 30% and 30% (26, 38)
    assert tool_use.problems(50, seed=1, task="chain") == [r for r in tool_use.problems(50, seed=1, task="chain")
                                                           if not tool_use.plus_first(r)]


def test_by_form_pools_the_seeds_on_each_form():
    per_question = [[1, 0], [1, 1], [0, 0], [0, 1]]  # 4 questions, 2 seeds
    assert tool_use.by_form(per_question, [False, True, True, False]) == [0.5, 0.5]
    assert tool_use.by_form(per_question, [True, True, False, False]) == [0.25, 0.75]
    assert tool_use.by_form([[1], [0], [0]], [False, True, True]) == [1.0, 0.0]


def test_stage_graph_gkd_learns_from_the_pick_of_the_better_rl_model_after_both_are_evaluated(tmp_path):
    args = tool_use.Args(task="chain", output_dir=str(tmp_path), model_name_or_path="m", seeds=[3])
    tool_use.settle(args)
    stages = tool_use.chain(args, stamp=0)
    seed_dir = os.path.join(str(tmp_path), "seed_3")
    argv, needs, _ = stages[3, "gkd"]
    assert needs == [(3, "pick")] and argv[0] == "algos/gkd.py"
    flag = lambda a, name: a[a.index(name) + 1]  # noqa: E731
    assert flag(argv, "--teacher_model_name_or_path") == os.path.join(seed_dir, "best_rl")
    assert flag(argv, "--model_name_or_path") == os.path.join(seed_dir, "warmup")
    assert flag(argv, "--environment_factory") == "benchmarks.tool_use:ChainCalculator"
    assert flag(argv, "--max_tool_calling_iterations") == "3" and flag(argv, "--max_new_tokens") == "192"
    pick_argv, pick_needs, _ = stages[3, "pick"]
    assert sorted(pick_needs) == [(3, "grpo", "eval"), (3, "rloo", "eval")]
    assert pick_argv[pick_argv.index("--stage") + 1] == "pick" and pick_argv.count("--stage") == 1
    assert pick_argv[-2:] == [os.path.join(seed_dir, "grpo"), os.path.join(seed_dir, "rloo")]
    assert stages[3, "gkd", "eval"][1] == [(3, "gkd")]
    for name in ("grpo", "rloo"):
        assert stages[3, name][1] == [(3, "warmup")] and flag(stages[3, name][0], "--max_completion_length") == "192"
    assert flag(stages[3, "grpo"][0], "--num_generations") == "8" and flag(argv, "--learning_rate") == "2e-05"
    args = tool_use.Args(output_dir=str(tmp_path), model_name_or_path="m", seeds=[3])  # multiply: no gkd, no pick
    tool_use.settle(args)
    stages = tool_use.chain(args, stamp=0)
    assert {k[1] for k in stages if k != "start"} == {"warmup", "grpo", "rloo"}
    assert flag(stages[3, "grpo"][0], "--environment_factory") == "benchmarks.tool_use:Calculator"
    assert flag(stages[3, "grpo"][0], "--max_completion_length") == "96"
    # mixed: grpo in groups of 4, gkd 20 steps at 3e-5 unless the command line says otherwise
    for given, lr in (({}, "3e-05"), ({"gkd": 4e-5}, "4e-05")):
        args = tool_use.Args(task="mixed", output_dir=str(tmp_path), model_name_or_path="m", seeds=[3],
                             learning_rates=given)
        tool_use.settle(args)
        stages = tool_use.chain(args, stamp=0)
        assert flag(stages[3, "grpo"][0], "--num_generations") == "4"
        assert flag(stages[3, "grpo"][0], "--learning_rate") == flag(stages[3, "rloo"][0], "--learning_rate") == "2e-05"
        assert flag(stages[3, "gkd"][0], "--learning_rate") == lr and flag(stages[3, "gkd"][0], "--max_steps") == "20"


def test_pick_links_the_rl_model_of_higher_held_out_accuracy_and_the_first_when_tied(tmp_path):
    def pick(scores):
        folders = []
        for name, accuracy in scores.items():
            os.makedirs(tmp_path / name, exist_ok=True)
            (tmp_path / name / "tool_use_eval.json").write_text(json.dumps({"accuracy": accuracy}))
            folders.append(str(tmp_path / name))
        tool_use.pick(tool_use.Args(stage="pick", stage_models=folders))
        assert os.path.realpath(tmp_path / "best_rl") == os.path.realpath(tmp_path / json.loads(
            (tmp_path / "best_rl.json").read_text())["teacher"])
        return os.path.basename(os.path.realpath(tmp_path / "best_rl"))

    assert pick({"grpo": 0.31, "rloo": 0.52}) == "rloo"
    assert pick({"grpo": 0.6, "rloo": 0.52}) == "grpo"  # the link is replaced
    assert pick({"grpo": 0.4, "rloo": 0.4}) == "grpo"


@pytest.mark.realmodel
def test_the_evaluation_runs_a_call_and_reads_the_final_reply(smollm2, tmp_path):  # noqa: F811
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
    # every warm-up conversation fits the warm-up's --max_length whole (else sft cuts its final answer off)
    for task in tool_use.TASKS:
        args = tool_use.Args(task=task, output_dir=str(tmp_path / task), tool_share=0.3)
        tool_use.write_task(args)
        with open(tmp_path / task / "data" / "warmup" / "train.jsonl") as f:
            longest = max((json.loads(line) for line in f), key=lambda r: len(r["messages"]))
        text = tokenizer.apply_chat_template(longest["messages"], tools=json.loads(longest["tools"]), tokenize=False)
        assert len(tokenizer(text, add_special_tokens=False).input_ids) <= tool_use.TASKS[task]["warmup_max_length"]
    # the chain task: multiply, then add on its result (each result seen by the next turn), then the answer
    rows = tool_use.problems(2, seed=5, task="chain")
    a, b, c = tool_use.numbers(rows[0])
    call = '<tool_call>\n{{"name": "{}", "arguments": {{"a": {}, "b": {}}}}}\n</tool_call>'.format
    model = Scripted(tokenizer, [call("multiply", a, b), call("add", a * b, c), f"It is {a * b + c}."])
    talks = tool_use.episodes(model, tokenizer, rows[:1], task="chain")
    assert len(model.prompts) == 3 and f"<tool_response>\n{a * b}\n</tool_response>" in model.prompts[1][0]
    assert f"<tool_response>\n{a * b + c}\n</tool_response>" in model.prompts[2][0]
    assert '"name": "add"' in model.prompts[0][0]  # both tools offered
    assert [m["role"] for m in talks[0]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert talks[0][3] == {"role": "tool", "name": "add", "content": str(a * b + c)}
    assert tool_use.correct(talks, [rows[0]["answer"]]) == [1.0]
    # mixed, plus first: multiply the last two, add the first; adding the last instead is wrong
    (row,) = [r for r in tool_use.problems(8, seed=5, task="mixed") if tool_use.plus_first(r)][:1]
    a, b, c = tool_use.numbers(row)
    for add, right in ((call("add", a, b * c), 1.0), (call("add", b * c, c), 0.0)):
        model = Scripted(tokenizer, [call("multiply", b, c), add, "The answer is {}.".format(
            a + b * c if right else b * c + c)])
        talks = tool_use.episodes(model, tokenizer, [row], task="mixed")
        assert f"<tool_response>\n{b * c}\n</tool_response>" in model.prompts[1][0]
        assert tool_use.correct(talks, [row["answer"]]) == [right]
    # at most 3 calls: a fourth turn's call is its final reply
    model = Scripted(tokenizer, [call("add", 1, 2)] * 4)
    talks = tool_use.episodes(model, tokenizer, rows[:1], task="chain")
    assert len(model.prompts) == 4 and len(talks[0]) == 7 and "tool_calls" not in talks[0][-1]


@pytest.mark.realmodel
def test_quick_mixed_runs_every_stage_and_writes_the_report(smollm2, tmp_path):  # noqa: F811
    out, results = tmp_path / "mixed", tmp_path / "results"  # the mixed task: every stage, gkd's included
    run_script("benchmarks/tool_use.py", "--task", "mixed", "--quick", "--model_name_or_path", smollm2,
               "--output_dir", str(out), "--results_dir", str(results), timeout=1200)
    with open(results / "tool_use_mixed.json") as f:
        result = json.load(f)
    assert result["start"]["n"] == 8 and set(result["methods"]) == set(tool_use.STAGES)
    assert result["methods"]["gkd"]["runs"]["1"]["teacher"] in ("grpo", "rloo")
    for name, method in result["methods"].items():
        run = method["runs"]["1"]
        assert run["n"] == 8 and len(run["correct"]) == 8 and run["turns"] >= 1, name
        assert len(run["train_log"]) == 2, name  # its 2 steps were logged
        assert len(method["by_form"]) == 2 and all(0 <= x <= 1 for x in method["by_form"]), name
    for name in ("grpo", "rloo", "gkd"):  # the episodes' metrics reached the log
        assert all("tools/call_frequency" in r and "episodes/turns_mean" in r
                   for r in result["methods"][name]["runs"]["1"]["train_log"]), name
    report = (results / "tool_use_mixed.md").read_text()
    assert "QUICK MODE" in report and "plus first" in report
    assert all(f"| {title} |" in report for title in tool_use.TITLES.values())
    assert os.path.isfile(out / "seed_1" / "warmup" / "tokenizer_config.json")
