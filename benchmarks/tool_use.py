"""A real model learns to use tools: SmolLM2-135M-Instruct with a calculator, on one of three tasks (--task).

multiply: "What is 347 times 812?", right when the reply's last number is the product: one call. It saturates
(grpo and rloo at 100% after 10 steps). chain: "What is 347 times 812 plus 509?": multiply, then add the number
to its result, two tools called in turn, the product copied from a tool result into the next call (it saturates
too: rloo 99.5% after 8 steps). mixed: chain's questions and, as many, "What is 509 plus 347 times 812?" (multiply
the last two, then add the first), whose chain the warm-up shows in 3% of them only. The model cannot do any alone (0 of
the held-out questions, greedy) and, with the tools offered, never calls them: its own chat template renders no
tools, and through configs/chatml_tools.jinja (ChatML that renders them the Hermes way) it answers from memory.
The chain of stages, per seed, each a subprocess of the scripts as a user runs them:

1. warm-up (algos/sft.py, multi-turn): --warmup_rows conversations with the tools' schemas in the `tools`
   column; in a --tool_share of them the assistant calls the tools all the way, reads each result and answers
   (chain, mixed: in as many, it calls multiply only, then answers; mixed: of the "plus first" questions, 3% call
   the tools all the way, the others answer directly); in the others it answers directly (the true value,
   which it cannot learn to compute). It learns the call format, not when (or how far) to call: that is left
   for RL.
2. grpo and rloo from the warm-up model, through `--environment_factory benchmarks.tool_use:Calculator` (chain,
   mixed: `ChainCalculator`; one per episode, its public methods the tools) and the exact reward
   `benchmarks.tool_use:correct` (the final reply's last number); 16 episodes a step, rloo's 4 prompts x 4,
   grpo's 2 x 8 (mixed: 4 x 4).
3. (chain, mixed) gkd: the warm-up model distilled on its own episodes (--lmbda 1, reverse KL) from the better
   of its seed's grpo and rloo models (held-out accuracy: the `pick` stage links it as <seed dir>/best_rl);
   mixed: 20 steps at 3e-5 (chain: 8 at 2e-5).
4. evaluate: greedy episodes on --n_test held-out questions with plain transformers (its own loop, not
   common/episodes.py: each turn re-renders the conversation through the chat template; each call is run, its
   result appended, at most 2 calls, chain and mixed 3): accuracy (95% Wilson interval per seed; the seeds pooled
   with a percentile bootstrap over questions), tool calls and turns per episode, share of episodes that called.

    python benchmarks/tool_use.py --task mixed  # 2 seeds: benchmarks/results/tool_use_mixed.{json,md}
    python benchmarks/tool_use.py --task chain  # 2 seeds: benchmarks/results/tool_use_chain.{json,md}
    python benchmarks/tool_use.py               # multiply: benchmarks/results/tool_use.{json,md}
    python benchmarks/tool_use.py --task mixed --quick  # 2 steps a stage, 8 questions, 1 seed (realmodel marker)
"""

import datetime
import json
import os
import platform
import random
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python benchmarks/tool_use.py` puts benchmarks/, not the repo, on the path
    sys.path.insert(0, ROOT)

from benchmarks import arithmetic  # noqa: E402

TEMPLATE = os.path.join(ROOT, "configs", "chatml_tools.jinja")
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
STAGES = ["warmup", "grpo", "rloo", "gkd"]
TITLES = {"start": "start model", "warmup": "SFT warm-up", "grpo": "GRPO (from the warm-up)",
          "rloo": "RLOO (from the warm-up)", "gkd": "GKD (the warm-up, distilled from the best RL policy)"}


class Calculator:
    """One per episode (--environment_factory): its public method is the model's tool."""

    def reset(self, **row) -> None:
        return None

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        return a * b


class ChainCalculator(Calculator):
    """The chain task's environment: multiply, then add."""

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first term
            b: the second term
        """
        return a + b


# per task: the environment, its stages, the most calls an episode may make, grpo's group size (16 episodes a step),
# the defaults of Args' task fields
TASKS = {
    "multiply": dict(env=Calculator, stages=STAGES[:3], max_calls=2, tool_share=0.3, max_completion_length=96, group=8,
                     warmup_max_length=384,
                     steps={"warmup": 40, "grpo": 10, "rloo": 10}, report="tool_use",
                     title="3-digit multiplication, a calculator", question="What is 347 times 812?",
                     right="the product"),
    "chain": dict(env=ChainCalculator, stages=STAGES, max_calls=3, tool_share=0.2, max_completion_length=192, group=8,
                  warmup_max_length=512,  # a whole chain conversation is 423 tokens: 384 would cut its answer
                  steps={"warmup": 40, "grpo": 8, "rloo": 8, "gkd": 8}, report="tool_use_chain",
                  title="a product plus a number, two tools called in turn", question="What is 347 times 812 plus 509?",
                  right="the product plus the number"),
}
# mixed: chain's tools and budget; half the questions "a plus b times c" (multiply b and c, then add a), whose chain
# the warm-up shows in plus_first_share of them only (the other form: tool_share chains, as many multiply alone);
# grpo in groups of 4 (4 prompts a step, as rloo: in groups of 8, one seed's groups all went wrong from step 4),
# gkd 20 steps at 3e-5 (8 at 2e-5 and 12 at 5e-5 did not move it in both seeds: docs/multi_turn.md)
TASKS["mixed"] = TASKS["chain"] | dict(tool_share=0.4, plus_first_share=0.03, report="tool_use_mixed", group=4,
                                       steps={"warmup": 40, "grpo": 8, "rloo": 8, "gkd": 20},
                                       learning_rates={"gkd": 3e-5},
                                       title="a product and a sum in either order, two tools called in turn",
                                       question='What is 347 times 812 plus 509?" or "What is 509 plus 347 times 812?',
                                       right="its value, times before plus")


def correct(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number of the episode's final reply is the product (a string: its last message's)."""
    return arithmetic.correct(completions, answer)


@dataclass
class Args:
    model_name_or_path: str = ""
    """start model: a folder or hub name; empty: SmolLM2-135M-Instruct built from PyPI (benchmarks/smollm2.py)"""
    output_dir: str = "output/tool_use"
    """data/, start_eval.json and <output_dir>/seed_<n>/<stage>"""
    results_dir: str = ""
    """where tool_use.json and .md go; empty: benchmarks/results (in quick mode: <output_dir>)"""
    task: str = "multiply"
    """multiply: "What is 347 times 812?", one calculator call (it saturates: 100% after 10 steps); chain: "What is
    347 times 812 plus 509?", two tools called in turn (multiply, then add the number to its result); mixed: chain's
    questions and as many "What is 509 plus 347 times 812?", whose chain the warm-up shows in 3% of them only"""
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    """seeds; each runs the whole chain (warm-up, then the methods)"""
    jobs: int = 2
    """stages run at the same time (1 torch thread each)"""
    resume: bool = False
    """after an interruption: run the stages not yet finished (<output_dir>/progress.jsonl), the others kept"""
    quick: bool = False
    """2 steps a stage, 8 held-out questions, 1 seed: checks that the chain runs and the report is written"""
    warmup_rows: int = 320
    """warm-up conversations (sft: one pass, batch 8)"""
    tool_share: float = 0.0
    """share of the warm-up conversations that call the tools all the way (chain: as many call multiply only, then
    answer; mixed: of its "times first" questions only); the rest answer directly. 0: the task's (multiply 0.3,
    chain 0.2, mixed 0.4)"""
    steps: dict[str, int] = field(default_factory=dict)
    """optimizer steps of each stage (rollouts for rloo); a stage not named: the task's (TASKS)"""
    learning_rates: dict[str, float] = field(default_factory=dict)
    """peak learning rate of each stage; a stage not named: the task's (mixed: gkd 3e-5), else warm-up 5e-5, 2e-5"""
    n_test: int = 100
    """held-out questions evaluated"""
    max_completion_length: int = 0
    """tokens of a whole episode (the model's turns, tool results and the template's text between them); 0: the
    task's (multiply 96, chain and mixed 192; quick mode 96)"""
    stage: str = ""
    """internal: 'evaluate' (with --stage_models) runs the evaluation alone; 'pick' links <seed dir>/best_rl to the
    better of --stage_models (the RL models, by held-out accuracy), gkd's teacher"""
    stage_models: list[str] = field(default_factory=list)
    """internal: the model folders --stage evaluate judges"""


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def problems(n: int, seed: int, exclude=frozenset(), task: str = "multiply") -> list[dict]:
    """n questions of 3-digit numbers, none of `exclude` (their numbers): "What is a times b?" (chain: "What is a
    times b plus c?"; mixed: half of them "What is a plus b times c?") with the answer's string."""
    rng, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < n:
        a, b, *c = (rng.randint(100, 999) for _ in range(2 if task == "multiply" else 3))
        flip = task == "mixed" and rng.random() < 0.5  # (mixed) half "What is a plus b times c?"
        if (a, b, *c) not in seen:
            seen.add((a, b, *c))
            question = f"What is {a} times {b}{''.join(f' plus {x}' for x in c)}?"
            answer = a * b + sum(c)
            if flip:
                question, answer = f"What is {a} plus {b} times {c[0]}?", a + b * c[0]
            rows.append({"prompt": [{"role": "user", "content": question}], "answer": str(answer)})
    return rows


def plus_first(row: dict) -> bool:
    """(mixed) "What is a plus b times c?": multiply b and c, then add a."""
    return " plus " in row["prompt"][0]["content"].split(" times ")[0]


def numbers(row: dict) -> tuple:
    return tuple(map(int, re.findall(r"\d+", row["prompt"][0]["content"])))


def tool_schemas(task: str) -> list[dict]:
    """The task's tools as training renders them (common/episodes.py: the environment's public methods)."""
    from transformers.utils import get_json_schema

    from common.episodes import environment_methods

    env = TASKS[task]["env"]
    return [get_json_schema(getattr(env, name)) for name in environment_methods(env)]


def tool_turn(name: str, a: int, b: int) -> list[dict]:
    """A warm-up call of a tool and its result."""
    call = {"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": name, "content": str(a * b if name == "multiply" else a + b)}]


def write_task(args: Args) -> None:
    """<output_dir>/data: test.jsonl (held out), prompts/ (prompt + answer), warmup/ (messages + tools)."""
    test = problems(300, seed=0, task=args.task)
    train = problems(2000, seed=1, exclude={numbers(r) for r in test}, task=args.task)
    data, tools = os.path.join(args.output_dir, "data"), tool_schemas(args.task)
    arithmetic.write_jsonl(test, os.path.join(data, "test.jsonl"))
    arithmetic.write_jsonl(train[args.warmup_rows:], os.path.join(data, "prompts", "train.jsonl"))
    rng, warmup = random.Random(0), []
    for row in train[:args.warmup_rows]:
        a, b, *c = numbers(row)
        answer = {"role": "assistant", "content": f"{row['prompt'][0]['content'][8:-1]} is {row['answer']}."}
        multiply = tool_turn("multiply", a, b)
        chain = multiply + [m for x in c for m in tool_turn("add", a * b, x)]
        draw = rng.random()  # a chain; (chain task) as often, multiply alone; else the answer straight away
        calls = chain if draw < args.tool_share else multiply if c and draw < 2 * args.tool_share else []
        if plus_first(row):  # (mixed) the whole chain (multiply the last two, add the first) in a few, else answer
            whole = tool_turn("multiply", b, c[0]) + tool_turn("add", b * c[0], a)
            calls = whole if draw < TASKS[args.task]["plus_first_share"] else []
        warmup.append({"messages": row["prompt"] + calls + [answer], "tools": json.dumps(tools)})
    arithmetic.write_jsonl(warmup, os.path.join(data, "warmup", "train.jsonl"))


# ---------------------------------------------------------------------------------------------
# evaluation: greedy episodes with plain transformers
# ---------------------------------------------------------------------------------------------
def episodes(model, tokenizer, rows: list[dict], task: str = "multiply", max_new_tokens: int = 48
             ) -> list[list[dict]]:
    """Each row's conversation after the prompt: every turn renders the whole conversation so far (the task's
    tool schemas in it), the model replies greedy; a reply with <tool_call> JSONs gets each call's result back as
    a tool message, until a reply without a call or the task's max_calls calls."""
    import torch

    from common.episodes import environment_methods

    env, max_calls, tools = TASKS[task]["env"], TASKS[task]["max_calls"], tool_schemas(task)
    names = environment_methods(env)
    talks, active = [[] for _ in rows], list(range(len(rows)))
    for turn in range(max_calls + 1):
        if not active:
            break
        texts = [tokenizer.apply_chat_template(rows[i]["prompt"] + talks[i], tools=tools, add_generation_prompt=True,
                                               tokenize=False) for i in active]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        replies = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
        still = []
        for i, reply in zip(active, replies):
            found = CALL.findall(reply)
            if not found or turn == max_calls:
                talks[i].append({"role": "assistant", "content": reply.strip()})
                continue
            calls, results = [], []
            for body in found:
                try:
                    call = json.loads(body)
                    if call["name"] not in names:  # as training answers it: an unknown tool is a failed call
                        raise ValueError(f"Tool {call['name']} not found.")
                    result = str(getattr(env(), call["name"])(**call["arguments"]))
                except Exception as e:  # the model's JSON or arguments
                    call, result = {"name": names[-1], "arguments": {}}, str({"error": str(e)})
                calls.append({"type": "function", "function": {"name": call.get("name"), "arguments":
                                                               call.get("arguments", {})}})
                results.append({"role": "tool", "name": call.get("name"), "content": result})
            talks[i] += [{"role": "assistant", "content": CALL.split(reply)[0].strip(), "tool_calls": calls}, *results]
            still.append(i)
        active = still
    return talks


def evaluate(args: Args) -> None:
    """<model>/tool_use_eval.json (the start model's: <output_dir>/start_eval.json)."""
    from benchmarks.real_lm import load_model

    with open(os.path.join(args.output_dir, "data", "test.jsonl")) as f:
        rows = [json.loads(line) for line in f][:args.n_test]
    for path in args.stage_models:
        start = time.time()
        model, tokenizer = load_model(path, threads=1)
        if path == args.model_name_or_path:
            tokenizer.chat_template = open(TEMPLATE).read()
        talks = [t for i in range(0, len(rows), 25)
                 for t in episodes(model, tokenizer, rows[i:i + 25], args.task)]
        right = [int(x) for x in correct(talks, [r["answer"] for r in rows])]
        calls = [sum(len(m.get("tool_calls", [])) for m in t) for t in talks]
        result = {"model": path, "n": len(rows), "correct": right, "accuracy": sum(right) / len(rows),
                  "ci95": arithmetic.wilson(sum(right), len(rows)), "calls": sum(calls) / len(rows),
                  "called": sum(c > 0 for c in calls) / len(rows),
                  "turns": sum(sum(m["role"] == "assistant" for m in t) for t in talks) / len(rows),
                  "eval_seconds": time.time() - start,
                  "examples": [{"question": r["prompt"][-1]["content"], "answer": r["answer"], "episode": t}
                               for r, t in zip(rows[:4], talks[:4])]}
        out = (os.path.join(args.output_dir, "start_eval.json") if path == args.model_name_or_path
               else os.path.join(path, "tool_use_eval.json"))
        with open(out, "w") as f:
            json.dump(result, f, indent=2)


def pick(args: Args) -> None:
    """gkd's teacher: <seed dir>/best_rl links to the --stage_models folder of highest held-out accuracy (the
    first if tied), and best_rl.json says which."""
    scores = []
    for path in args.stage_models:
        with open(os.path.join(path, "tool_use_eval.json")) as f:
            scores.append(json.load(f)["accuracy"])
    best = args.stage_models[scores.index(max(scores))]
    link = os.path.join(os.path.dirname(best), "best_rl")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(os.path.basename(best), link)
    with open(link + ".json", "w") as f:
        json.dump({"teacher": os.path.basename(best), "accuracy": dict(zip(args.stage_models, scores))}, f)


# ---------------------------------------------------------------------------------------------
# the chain: stage command lines, run, report
# ---------------------------------------------------------------------------------------------
def stage_argv(name: str, seed: int, args: Args, stamp: int) -> list[str]:
    run_dir, data = os.path.join(args.output_dir, f"seed_{seed}"), os.path.join(args.output_dir, "data")
    batch = 2 if args.quick else 8
    common = ["--seed", str(seed), "--output_dir", os.path.join(run_dir, name), "--run_name",
              f"tool_{name}__{seed}__{stamp}", "--overwrite_output_dir", "--logging_steps", "1", "--max_steps",
              str(args.steps[name]), "--learning_rate", str(args.learning_rates[name])]
    if name == "warmup":
        return ["algos/sft.py", "--model_name_or_path", args.model_name_or_path, "--dataset_name",
                os.path.join(data, "warmup"), "--chat_template_path", TEMPLATE, "--per_device_train_batch_size",
                str(batch), "--max_length", str(TASKS[args.task]["warmup_max_length"]), "--dataset_test_split", "",
                *common]
    task, completions = TASKS[args.task], 4 if args.quick else 16
    episodes = ["--model_name_or_path", os.path.join(run_dir, "warmup"), "--dataset_name",
                os.path.join(data, "prompts"), "--environment_factory", f"benchmarks.tool_use:{task['env'].__name__}",
                "--max_tool_calling_iterations", str(task["max_calls"]), "--per_device_train_batch_size",
                str(completions), "--temperature", "0.7"]
    if name == "gkd":  # on-policy distillation of the warm-up model's own episodes (lmbda 1, reverse KL: beta 1);
        # micro-batches of 4: the full-vocabulary divergence of 16 episodes of ~480 tokens took 15.7 GB at once
        micro = ["--per_device_train_batch_size", str(min(4, completions)), "--gradient_accumulation_steps",
                 str(completions // min(4, completions))]
        return ["algos/gkd.py", *episodes, *micro, "--teacher_model_name_or_path", os.path.join(run_dir, "best_rl"),
                "--max_new_tokens", str(args.max_completion_length), "--max_length",
                str(384 + args.max_completion_length), "--eval_steps", str(args.steps[name]), *common]
    group = ["--num_generations", str(min(task["group"], completions))] if name == "grpo" else [
        "--rloo_k", "4", "--num_ppo_epochs", "1"]
    return [f"algos/{name}.py", *episodes, "--reward_model_paths", "--reward_funcs", "benchmarks.tool_use:correct",
            *group, "--max_prompt_length", "384", "--max_completion_length", str(args.max_completion_length), *common]


def chain(args: Args, stamp: int) -> dict:
    """{key: (argv, keys it waits for, log)}: the start model's evaluation; per seed the warm-up, then grpo and
    rloo, each evaluated when trained; (chain, mixed) the pick of the better RL model, then gkd from it."""
    me = ["benchmarks/tool_use.py", "--task", args.task, "--model_name_or_path", args.model_name_or_path,
          "--output_dir", args.output_dir, "--n_test", str(args.n_test), "--stage", "evaluate", "--stage_models"]
    stages, names = {}, TASKS[args.task]["stages"]
    for seed in args.seeds:
        run_dir = os.path.join(args.output_dir, f"seed_{seed}")
        for name in names:
            needs = {"warmup": [], "gkd": [(seed, "pick")]}.get(name, [(seed, "warmup")])
            stages[seed, name] = (stage_argv(name, seed, args, stamp), needs,
                                  os.path.join(run_dir, "logs", f"{name}.log"))
        if "gkd" in names:
            rl = [os.path.join(run_dir, n) for n in ("grpo", "rloo")]
            stages[seed, "pick"] = ([*me[:-3], "--stage", "pick", "--stage_models", *rl],
                                    [(seed, "grpo", "eval"), (seed, "rloo", "eval")],
                                    os.path.join(run_dir, "logs", "pick.log"))
    stages["start"] = (me + [args.model_name_or_path], [], os.path.join(args.output_dir, "logs", "start.log"))
    for seed in args.seeds:
        run_dir = os.path.join(args.output_dir, f"seed_{seed}")
        for name in names:
            stages[seed, name, "eval"] = (me + [os.path.join(run_dir, name)], [(seed, name)],
                                          os.path.join(run_dir, "logs", f"{name}_eval.log"))
    return stages


def by_form(per_question: list[list[int]], forms: list[bool]) -> list[float]:
    """(mixed) accuracy on each form, the seeds pooled: [times first, plus first]; per_question[i]: question i's
    correctness in each seed, forms[i]: whether it is plus first."""
    return [sum(sum(q) for q, f in zip(per_question, forms, strict=True) if f == flag) / max(
        1, sum(len(q) for q, f in zip(per_question, forms) if f == flag)) for flag in (False, True)]


def collect(args: Args, seconds: dict) -> dict:
    from benchmarks.real_lm import bootstrap
    from benchmarks.run_tiny_tldr import read_log, seconds_per_step

    with open(os.path.join(args.output_dir, "start_eval.json")) as f:
        result = {"start": json.load(f), "methods": {}}
    with open(os.path.join(args.output_dir, "data", "test.jsonl")) as f:
        forms = [plus_first(json.loads(line)) for line in f][:args.n_test]
    for name in TASKS[args.task]["stages"]:
        runs = {}
        for seed in args.seeds:
            folder = os.path.join(args.output_dir, f"seed_{seed}", name)
            with open(os.path.join(folder, "tool_use_eval.json")) as f:
                runs[str(seed)] = json.load(f)
            merged, steps = read_log(next(os.path.join(folder, "logs", p) for p in os.listdir(
                os.path.join(folder, "logs")) if p.endswith(".jsonl")))
            runs[str(seed)].update(seconds=seconds[seed, name], seconds_per_step=seconds_per_step(steps),
                                   train_log=[{k: v for k, v in r.items() if k.startswith(
                                       ("tools/", "episodes/", "rewards/", "loss", "step"))} for r in steps])
            if name == "gkd":
                with open(os.path.join(args.output_dir, f"seed_{seed}", "best_rl.json")) as f:
                    runs[str(seed)]["teacher"] = json.load(f)["teacher"]
        per_question = [list(q) for q in zip(*(r["correct"] for r in runs.values()))]
        accuracy = sum(map(sum, per_question)) / (len(per_question) * len(runs))
        result["methods"][name] = {"runs": runs, "accuracy": accuracy, "ci95": bootstrap(per_question),
                                   "calls": sum(r["calls"] for r in runs.values()) / len(runs),
                                   "called": sum(r["called"] for r in runs.values()) / len(runs),
                                   "turns": sum(r["turns"] for r in runs.values()) / len(runs)}
        if args.task == "mixed":
            result["methods"][name]["by_form"] = by_form(per_question, forms)
        if name != "warmup":  # calls per episode sampled in training (temperature 0.7): first and last step
            result["methods"][name]["train_calls"] = [sum(r["train_log"][k]["tools/call_frequency"] for r in
                                                          runs.values()) / len(runs) for k in (0, -1)]
    return result


def markdown(r: dict, args: Args) -> str:
    pct = "{:.1%}".format
    rows = [f"| {TITLES['start']} | {pct(r['start']['accuracy'])} ({pct(r['start']['ci95'][0])} - "
            f"{pct(r['start']['ci95'][1])}, Wilson) | | {r['start']['called']:.0%} | {r['start']['calls']:.2f} | "
            f"{r['start']['turns']:.2f} | | |"]
    for name, m in r["methods"].items():
        runs = m["runs"].values()
        per_seed = ", ".join(f"{pct(x['accuracy'])} ({pct(x['ci95'][0])} - {pct(x['ci95'][1])})" for x in runs)
        train = "{:.2f} -> {:.2f}".format(*m["train_calls"]) if "train_calls" in m else ""
        time_ = ", ".join(f"{x['seconds'] / 60:.1f}" for x in runs)
        if "by_form" in m:
            per_seed += "; times first {:.0%}, plus first {:.0%}".format(*m["by_form"])
        rows.append(f"| {TITLES[name]} | **{pct(m['accuracy'])}** ({pct(m['ci95'][0])} - {pct(m['ci95'][1])}) | "
                    f"{per_seed} | {m['called']:.0%} | {m['calls']:.2f} | {m['turns']:.2f} | {train} | {time_} |")
    columns = ["model", "accuracy (95% CI)", "per seed (95% Wilson)", "called", "calls / episode", "turns / episode",
               "sampled calls / episode, step 1 -> last", "wall time (min)"]
    header = "| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|"
    quick = "\n**QUICK MODE: 2 steps a stage; the numbers mean nothing.**\n" if args.quick else ""
    s, task = r["settings"], TASKS[args.task]
    runs = (f", over {r['runs']} runs (each later one with --resume: the stages whose command line had not changed "
            "kept, the others run again)" if r.get("runs", 1) > 1 else "")
    env, calls, g = f"benchmarks.tool_use:{task['env'].__name__}", task["max_calls"], task["group"]
    warmup = (f"{s['tool_share']:.0%} call the calculator, the rest answer directly" if args.task == "multiply" else
              f"{s['tool_share']:.0%} call multiply then add, {s['tool_share']:.0%} multiply only, the rest answer "
              "directly")
    if args.task == "mixed":
        warmup = (f"half of them \"a plus b times c\": of those, {task['plus_first_share']:.0%} call multiply on b "
                  "and c then add a, the rest answer directly; of the others " + warmup)
    gkd = "" if "gkd" not in r["methods"] else (
        f"GKD (algos/gkd.py): {s['steps']['gkd']} steps of 16 (4 x 4 accumulated) of the warm-up model's own "
        "episodes (--lmbda 1, --beta "
        "1: the reverse KL on its own tokens, tool results as context), temperature 0.7, lr "
        f"{s['learning_rates']['gkd']}, the teacher per seed the RL model of higher held-out accuracy (" + ", ".join(
            f"seed {k}: {v['teacher']}" for k, v in r["methods"]["gkd"]["runs"].items()) + ").\n")
    return f"""# A real model learns to use a tool: SmolLM2-135M-Instruct, {task['title']}
{quick}
Produced {r['date']} by `{r['command']}` on {r['machine']}; total wall time {r['total_seconds'] / 60:.1f} min{runs}.

Held-out greedy episodes on {s['n_test']} questions ("{task['question']}"; right when the final reply's last
number is {task['right']}), at most {calls} tool calls each. Accuracy: mean over seeds {', '.join(map(str, s['seeds']))}
with a 95% percentile bootstrap over questions (each question's correctness averaged over the seeds); per seed,
the 95% Wilson interval. Called: share of episodes with a tool call; calls and turns (assistant replies) per
episode; in training (sampled at temperature 0.7), TRL's tools/call_frequency at the first and last step,
mean over seeds. Wall time: the stage's training run, minutes, per seed ({s['jobs']} stages at a time, 1 torch
thread each).

{header}
{chr(10).join(rows)}

Warm-up: algos/sft.py on {s['warmup_rows']} conversations ({warmup}), {s['steps']['warmup']} steps of 8, lr
{s['learning_rates']['warmup']}, `--chat_template_path configs/chatml_tools.jinja`. GRPO: {s['steps']['grpo']} steps
of {16 // g} prompts x {g} episodes; RLOO: {s['steps']['rloo']} rollouts of 4 prompts x 4, one pass; both at
temperature 0.7, lr {s['learning_rates']['grpo']} / {s['learning_rates']['rloo']}, `--environment_factory {env}
--max_tool_calling_iterations {calls} --max_completion_length {s['max_completion_length']}`, reward
`benchmarks.tool_use:correct`, the scripts' other defaults.
{gkd}"""


def settle(args: Args) -> dict:
    """Fills the fields left to the task (TASKS) in `args`, the quick mode's too; returns the task."""
    if args.task not in TASKS:
        sys.exit(f"error: --task is one of {', '.join(TASKS)} (got {args.task!r})")
    task = TASKS[args.task]
    args.steps = task["steps"] | args.steps
    args.learning_rates = {"warmup": 5e-5, "grpo": 2e-5, "rloo": 2e-5, "gkd": 2e-5} | task.get(
        "learning_rates", {}) | args.learning_rates
    args.tool_share = args.tool_share or task["tool_share"]
    # quick: episodes of 96 tokens unless given (the chain is checked, not learnt: 2026-12-06, the mixed task's quick
    # run took 224 s with chain's 192)
    args.max_completion_length = args.max_completion_length or (96 if args.quick else task["max_completion_length"])
    if args.quick:
        args.steps, args.n_test, args.seeds = {k: 2 for k in args.steps}, 8, args.seeds[:1]
    return task


def main(args: Args):
    task = settle(args)
    if not args.model_name_or_path:
        from benchmarks import smollm2

        args.model_name_or_path = smollm2.build()
    if args.stage in ("evaluate", "pick"):
        return evaluate(args) if args.stage == "evaluate" else pick(args)
    from benchmarks.run_tiny_tldr import run_stages, start_progress
    from benchmarks.vs_trl import machine

    os.chdir(ROOT)  # the environment and reward are imported from the working directory
    start = time.time()
    progress = os.path.join(args.output_dir, "progress.jsonl")  # a line per finished stage, for --resume
    stamp, earlier_seconds, earlier_runs = start_progress(progress, args.resume)
    write_task(args)
    seconds = run_stages(chain(args, stamp), args.jobs, threads=1, progress=progress)
    result = collect(args, seconds)
    result.update(settings=asdict(args), total_seconds=time.time() - start + earlier_seconds, runs=earlier_runs + 1,
                  date=datetime.date.today().isoformat(),
                  command=shlex.join(["python", "benchmarks/tool_use.py", *sys.argv[1:]]),
                  machine=f"{os.cpu_count()} CPU cores ({platform.machine()}, {machine()['cpu']})",
                  model=args.model_name_or_path)
    results_dir = args.results_dir or (args.output_dir if args.quick else os.path.join(ROOT, "benchmarks", "results"))
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, f"{task['report']}.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    report = markdown(result, args)
    with open(os.path.join(results_dir, f"{task['report']}.md"), "w") as f:
        f.write(report)
    print(report)


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
