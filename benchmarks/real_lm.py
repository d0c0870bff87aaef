"""Every method on a real pretrained chat model: SmolLM2-135M-Instruct learning arithmetic, on a CPU.

The tiny TL;DR task shows that the scripts optimise what they are given; this shows whether each of
them teaches a real model something measurable. The task (benchmarks/arithmetic.py, `make_mixed_splits`):
"What is 7 times 8?", "Subtract 9 from 14.", "Add 3 and 15." (+ and - on numbers to 30, x to 12, two
wordings each), chat prompts with an exact answer; a reply is right when its last number is the answer
(`benchmarks.arithmetic:correct`). The untrained model gets a fifth right, greedy (30 of the first 150
held out: 22% of sums, 6% of differences, 32% of products), often with the right format and a wrong number.

Each method starts from the same model (SmolLM2-135M-Instruct, built from the PyPI GGUF by
benchmarks/smollm2.py, or --model_name_or_path) and is launched as a subprocess, as the tiny chain does:

- pairs (once): the start model samples --pair_samples answers to each of the first --pair_prompts
  training questions; each question with a right and a wrong answer gives up to 2 (right, wrong) pairs
  (those of a fifth of these questions held out for the reward model's accuracy); KTO gets them as unpaired rows;
- sft on the worked answers ("9 * 6 = 54. The answer is 54."); reward, dpo, kto on the pairs;
- online_dpo, rloo, grpo, ppo scored by the seed's reward model (the exact reward logged, weight 0);
  rloo_exact, grpo_exact scored by the exact reward;
- gkd: the start model distilled on-policy (lmbda 1, reverse KL) from the seed's SFT model, the strongest
  policy of every run so far (2026-11-26/27: SFT 60.7%, the best RL row 44.0%);
- evaluate (the start model; then, once a seed's stages are done, its policies in one process): greedy
  replies to the --n_test held-out
  questions, their accuracy (95% Wilson interval), length in tokens (EOS included) and the mean
  per-token log ratio log pi(y_t) - log pi_start(y_t) over those replies' tokens ("KL to start": on
  greedy replies, not samples, so an estimate of how far the policy moved, not an unbiased KL).

Every online step samples 16 completions (grpo: 2 prompts x 8, rloo: 4 x 4, online DPO: 8 x 2, ppo
and gkd: 16), at temperature 0.7, at most 32 tokens; offline steps take 8 examples, pairs or rows; the
algorithms' own settings (KL strengths, clipping) are the scripts' defaults, but for one pass over
each rollout in rloo and ppo and ppo's GAE lambda of 1.
Over the seeds, a method's accuracy is the mean, with a 95% percentile bootstrap interval over the
held-out questions (each question's correctness averaged over the seeds; 2000 resamples); its change
from the start model gets the same paired bootstrap, and it "learned" when that interval is above 0.

    python benchmarks/real_lm.py                          # the study (3 seeds, ~105 minutes on 2 cores)
    python benchmarks/real_lm.py --quick                  # 2 steps a stage, 8 held-out questions, 1 seed
                                                          # (tests/test_real_lm.py; report in output/real_lm)
    python benchmarks/real_lm.py --steps.grpo 40 --seeds 1 2 3 --n_test 300
    python benchmarks/real_lm.py --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct   # with internet
    python benchmarks/real_lm.py --resume                 # after an interruption: the stages not yet finished
    python benchmarks/real_lm.py --methods ppo --results_dir benchmarks/results/real_lm_ppo   # one method again
"""

import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python benchmarks/real_lm.py` puts benchmarks/, not the repo, on the path
    sys.path.insert(0, ROOT)

from benchmarks import arithmetic  # noqa: E402

EXACT = "benchmarks.arithmetic:correct"
# stage: (script, data folder under <output_dir>/data, stages it waits for, reward); ready stages start
# in this order (the longest online run first)
STAGES = {
    "sft": ("sft", "sft", (), None),
    "reward": ("reward", "pairs", ("pairs",), None),
    "dpo": ("dpo", "pairs", ("pairs",), None),
    "kto": ("kto", "kto", ("pairs",), None),
    "ppo": ("ppo", "prompts", ("reward",), "rm"),
    "rloo": ("rloo", "prompts", ("reward",), "rm"),
    "grpo": ("grpo", "prompts", ("reward",), "rm"),
    "online_dpo": ("online_dpo", "prompts", ("reward",), "rm"),
    "rloo_exact": ("rloo", "prompts", (), "exact"),
    "grpo_exact": ("grpo", "prompts", (), "exact"),
    "gkd": ("gkd", "prompts", ("sft",), None),  # the start model distilled on-policy from the seed's SFT model
}
POLICIES = [name for name in STAGES if name != "reward"]
TITLES = {"sft": "SFT (worked answers)", "dpo": "DPO (pairs)", "kto": "KTO (pairs, unpaired)",
          "online_dpo": "Online DPO (RM)", "rloo": "RLOO (RM)", "grpo": "GRPO (RM)", "ppo": "PPO (RM)",
          "rloo_exact": "RLOO (exact reward)", "grpo_exact": "GRPO (exact reward)",
          "gkd": "GKD (from SFT, on-policy)"}
HELD_OUT = 300  # questions held out of training whatever --n_test is, so that the training set never changes with it


@dataclass
class Args:
    # general
    model_name_or_path: str = ""
    """start model: a folder or hub name; empty: SmolLM2-135M-Instruct built from PyPI (benchmarks/smollm2.py)"""
    output_dir: str = "output/real_lm"
    """data/, pairs, and <output_dir>/seed_<n>/<stage> for each stage's model and logs"""
    results_dir: str = ""
    """where real_lm.json, .md and .png go; empty: benchmarks/results (in quick mode: <output_dir>)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds, started in this order; each trains every method once (the pairs and the start model's evaluation
    are shared)"""
    methods: list[str] = field(default_factory=lambda: list(POLICIES))
    """methods trained and reported (with the stages they wait for: the reward model, SFT for gkd), e.g.
    `--methods ppo` to rerun one method with other flags"""
    jobs: int = 2
    """stages run at the same time"""
    threads: int = 1
    """torch threads of every stage (OMP_NUM_THREADS): on 2 shared cores, two 1-thread jobs beat one 2-thread job"""
    quick: bool = False
    """2 steps a stage on batches of 2 (4 completions online), 16 tokens, 8 held-out questions, 32 pair
    prompts, 1 seed: checks that every stage runs and the report is written"""
    resume: bool = False
    """go on with an interrupted study in --output_dir (same flags): the stages its progress.jsonl records as
    finished, with the same command lines, are not run again"""
    # budgets
    steps: dict[str, int] = field(default_factory=lambda: {
        "sft": 30, "reward": 20, "dpo": 20, "kto": 20, "online_dpo": 15, "rloo": 15, "grpo": 15, "ppo": 30,
        "gkd": 15, "rloo_exact": 25, "grpo_exact": 30})
    """optimizer steps of each stage (rollouts for rloo / ppo); ppo 30 (at 15 its reward-model score rose as
    much as rloo's and grpo's, but its held-out accuracy stayed inside the start model's interval in one seed of
    two; at 30 with GAE lambda 1, all 3 seeds are above it); the 3-seed study: ~105 minutes on 2 cores on a normal
    day, ~220 on a 2.1x slower one (measured per seed: docs/benchmarks.md, "Real-model study")"""
    learning_rates: dict[str, float] = field(default_factory=lambda: {
        "sft": 2e-5, "reward": 1e-5, "dpo": 2e-5, "kto": 2e-5, "online_dpo": 2e-5, "rloo": 2e-5, "grpo": 2e-5,
        "ppo": 3e-5, "gkd": 2e-5, "rloo_exact": 2e-5, "grpo_exact": 1e-5})
    """peak learning rates of each stage: docs/usage.md "Real models" for sft and reward; 2e-5 for the others, whose
    published rates are for thousands of steps, not tens (at 5e-6, dpo, kto and online_dpo moved the policy
    0.02-0.04 nats a token in 15-20 steps, as ppo did at 1e-5, and ended inside the start model's interval in one
    seed of two or both: docs/benchmarks.md); ppo, whose value head starts from the reward model, 3e-5; grpo on
    the exact reward 1e-5 for 30 steps (at 2e-5 for 15, one seed of two ended below the start model)"""
    n_test: int = 150
    """held-out questions evaluated (the first of the HELD_OUT that no stage trains on)"""
    max_new_tokens: int = 32
    """tokens of each greedy reply in the evaluation (as the online runs sample)"""
    pair_prompts: int = 200
    """training questions the start model answers for the preference pairs"""
    pair_samples: int = 6
    """answers sampled per pair question"""
    pair_temperature: float = 0.7
    """temperature of those answers (as the online runs sample; at 1.0 about 5% of the answers were right)"""
    # internal: one stage of the study, run as a subprocess
    stage: str = ""
    """'pairs' or 'evaluate' (with --stage_models): run that stage alone and exit"""
    stage_models: list[str] = field(default_factory=list)
    """the model folders --stage evaluate judges, one after the other"""
    # filled in at runtime
    stamp: int = 0
    """the study's start time, in every run name (kept by --resume, so the stages' command lines match)"""


# ---------------------------------------------------------------------------------------------
# data: the task as files, the model's own pairs
# ---------------------------------------------------------------------------------------------
def write_task(args: Args) -> None:
    """<output_dir>/data: test.jsonl (held out), prompts/ (prompt + answer), sft/ (worked answers)."""
    assert args.n_test <= HELD_OUT, f"--n_test {args.n_test}: at most {HELD_OUT} questions are held out"
    train, test = arithmetic.make_mixed_splits(HELD_OUT)
    data = os.path.join(args.output_dir, "data")
    arithmetic.write_jsonl(test, os.path.join(data, "test.jsonl"))
    arithmetic.write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in train],
                           os.path.join(data, "prompts", "train.jsonl"))
    arithmetic.write_jsonl([{"messages": r["prompt"] + [{"role": "assistant", "content": r["solution"]}]}
                            for r in train], os.path.join(data, "sft", "train.jsonl"))


def load_model(path: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tokenizer


def generate(model, tokenizer, rows: list[dict], max_new_tokens: int, temperature: float = 0.0, batch_size: int = 50):
    """[(prompt ids, attention mask, reply ids, reply mask, reply log-probs)] per batch: plain HF generate
    on the chat template (so that it judges the saved folder, not the scripts' own code); the reply mask
    keeps the tokens up to and including the first EOS (pad == EOS here, so the padding after it is EOS
    too); the log-probabilities are the model's own (temperature 1), from the logits generate returns."""
    import torch

    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    batches = []
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {"do_sample": False}
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id,
                                 output_logits=True, return_dict_in_generate=True, **sampling)
        reply = out.sequences[:, batch.input_ids.shape[1]:]
        logps = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, reply[..., None]).squeeze(-1)
        is_eos = reply == tokenizer.eos_token_id
        batches.append((batch.input_ids, batch.attention_mask, reply, (is_eos.cumsum(-1) - is_eos.long()) == 0, logps))
    return batches


def make_pairs(args: Args) -> None:
    """The start model's own right and wrong answers to training questions -> pairs/ and kto/."""
    import torch

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model_name_or_path, args.threads)
    with open(os.path.join(args.output_dir, "data", "prompts", "train.jsonl")) as f:
        questions = [json.loads(line) for line in f][:args.pair_prompts]
    rows = [q for q in questions for _ in range(args.pair_samples)]
    replies = []
    for _, _, reply, mask, _ in generate(model, tokenizer, rows, args.max_new_tokens, args.pair_temperature):
        replies += tokenizer.batch_decode(reply.masked_fill(~mask, tokenizer.eos_token_id), skip_special_tokens=True)
    right = arithmetic.correct(replies, [r["answer"] for r in rows])
    pairs = []
    for i, q in enumerate(questions):
        answers = dict(zip(replies[i * args.pair_samples:(i + 1) * args.pair_samples],
                           right[i * args.pair_samples:(i + 1) * args.pair_samples]))  # distinct replies
        good, bad = [t for t, r in answers.items() if r], [t for t, r in answers.items() if not r]
        pairs.append([{"prompt": q["prompt"], "chosen": [{"role": "assistant", "content": g}],
                       "rejected": [{"role": "assistant", "content": b}]} for g, b in list(zip(good, bad))[:2]])
    paired = [q for q in pairs if q]
    n_test = max(1, len(paired) // 5)  # the reward model's held-out pairs: those of the last fifth of these questions
    train, test = [p for q in paired[:-n_test] for p in q], [p for q in paired[-n_test:] for p in q]
    if len(train) < 2 or not test:
        sys.exit(f"error: the start model's answers gave {len(train)} training and {len(test)} held-out right-vs-wrong "
                 "pairs; raise --pair_prompts or --pair_samples")
    data = os.path.join(args.output_dir, "data")
    arithmetic.write_jsonl(train, os.path.join(data, "pairs", "train.jsonl"))
    arithmetic.write_jsonl(test, os.path.join(data, "pairs", "test.jsonl"))
    arithmetic.write_jsonl([{"prompt": p["prompt"], "completion": p[key], "label": key == "chosen"}
                            for p in train for key in ("chosen", "rejected")], os.path.join(data, "kto", "train.jsonl"))
    stats = {"questions": len(questions), "samples": len(replies), "sampled_accuracy": sum(right) / len(right),
             "questions_with_a_pair": len(paired), "train_pairs": len(train), "test_pairs": len(test)}
    with open(os.path.join(data, "pairs_stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
    print(json.dumps(stats), flush=True)


# ---------------------------------------------------------------------------------------------
# evaluation: greedy held-out accuracy, length, log ratio to the start model
# ---------------------------------------------------------------------------------------------
def eval_file(model: str, args: Args) -> str:
    return (os.path.join(args.output_dir, "start_eval.json") if model == args.model_name_or_path
            else os.path.join(model, "real_lm_eval.json"))


def evaluate(args: Args) -> None:
    """Each of --stage_models in turn (one process: Python and the start model load once)."""
    start = None
    for path in args.stage_models:
        if path != args.model_name_or_path and start is None:
            start = load_model(args.model_name_or_path, args.threads)[0]
        evaluate_one(path, None if path == args.model_name_or_path else start, args)


def evaluate_one(path: str, start, args: Args) -> None:
    """<eval_file>: per-question correctness, accuracy, length, log ratio to the start model."""
    import torch

    start_time = time.time()
    model, tokenizer = load_model(path, args.threads)
    with open(os.path.join(args.output_dir, "data", "test.jsonl")) as f:
        rows = [json.loads(line) for line in f][:args.n_test]
    replies, tokens, log_ratio = [], 0, 0.0
    for ids, attention, reply, mask, logps in generate(model, tokenizer, rows, args.max_new_tokens):
        replies += tokenizer.batch_decode(reply.masked_fill(~mask, tokenizer.eos_token_id), skip_special_tokens=True)
        tokens += int(mask.sum())
        if start is not None:
            seq, full_mask = torch.cat([ids, reply], 1), torch.cat([attention, mask.long()], 1)
            log_ratio += float(((logps - reply_logprobs(start, seq, full_mask, ids.shape[1])) * mask).sum())
    right = [int(x) for x in arithmetic.correct(replies, [r["answer"] for r in rows])]
    result = {"model": path, "n": len(rows), "correct": right, "accuracy": sum(right) / len(rows),
              "ci95": arithmetic.wilson(sum(right), len(rows)), "mean_tokens": tokens / len(rows),
              "log_ratio_per_token": log_ratio / tokens, "eval_seconds": time.time() - start_time,
              "examples": [{"question": r["prompt"][-1]["content"], "answer": r["answer"], "reply": t}
                           for r, t in zip(rows[:6], replies[:6])]}
    with open(eval_file(path, args), "w") as f:
        json.dump(result, f, indent=2)


def reply_logprobs(model, seq, attention, n_prompt: int):
    """Log-probabilities (temperature 1) of each reply token; positions count real tokens only, since
    the prompts are left-padded."""
    import torch

    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=attention, position_ids=positions).logits[:, n_prompt - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, seq[:, n_prompt:, None]).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# the study: stage command lines, run, report
# ---------------------------------------------------------------------------------------------
def script_flags(script: str, args: Args) -> list[str]:
    """Each script's batch and lengths: 8 examples / pairs / rows a step offline, 16 completions a step
    online, sampled at temperature 0.7 (quick mode: 2 and 4); rloo and ppo make one pass over each
    rollout (their defaults, 2 and 4, would double and quadruple the cost of a step on this CPU). ppo's
    GAE lambda is 1 (its default 0.95 leans each token's advantage on the value model, which starts from the
    reward model and at the first rollout missed the returns by ~1.6 root mean square, on scores of ~2.8; seed 3
    ended at 12.7% with 0.95, 27.3% with 1, above the start model's interval as seeds 1 and 2: docs/benchmarks.md)."""
    batch, completions = (2, 4) if args.quick else (8, 16)
    lengths = ["--max_length", "128", "--max_prompt_length", "64"]  # the chat prompts are about 40 tokens
    online = ["--temperature", "0.7", "--max_prompt_length", "64"]
    return {"sft": ["--per_device_train_batch_size", str(batch), "--max_length", "128"],
            "reward": ["--per_device_train_batch_size", str(batch), "--max_length", "128"],
            "dpo": ["--per_device_train_batch_size", str(batch), *lengths, "--max_completion_length", "48"],
            "kto": ["--per_device_train_batch_size", str(batch), *lengths, "--max_completion_length", "48"],
            "online_dpo": ["--per_device_train_batch_size", str(completions // 2), "--temperature", "0.7",
                           "--max_new_tokens", str(args.max_new_tokens)],
            "rloo": ["--per_device_train_batch_size", str(completions), "--rloo_k", "4", "--num_ppo_epochs", "1",
                     *online, "--max_completion_length", str(args.max_new_tokens)],
            "grpo": ["--per_device_train_batch_size", str(completions), "--num_generations", str(min(8, completions)),
                     *online, "--max_completion_length", str(args.max_new_tokens)],
            "ppo": ["--per_device_train_batch_size", str(completions), "--num_ppo_epochs", "1", "--lam", "1.0",
                    *online, "--response_length", str(args.max_new_tokens)],
            "gkd": ["--per_device_train_batch_size", str(completions), "--temperature", "0.7",
                    "--max_new_tokens", str(args.max_new_tokens)]}[script]


def stage_argv(name: str, seed: int, run_dir: str, args: Args) -> list[str]:
    script, data, _, reward = STAGES[name]
    argv = [f"algos/{script}.py", "--model_name_or_path", args.model_name_or_path, "--seed", str(seed),
            "--dataset_name", os.path.join(args.output_dir, "data", data), "--output_dir", os.path.join(run_dir, name),
            "--run_name", f"{name}__{seed}__{args.stamp}", "--overwrite_output_dir", "--logging_steps", "1",
            "--max_steps", str(args.steps[name]), "--learning_rate", str(args.learning_rates[name]),
            *script_flags(script, args)]
    argv += ["--dataset_test_split", "test" if name == "reward" else ""] if data != "prompts" else []
    if script == "gkd":
        argv += ["--teacher_model_name_or_path", os.path.join(run_dir, "sft")]
    if reward == "rm":  # scored by this seed's reward model; the exact reward logged alongside (weight 0)
        argv += ["--reward_model_path" + ("" if script == "ppo" else "s"), os.path.join(run_dir, "reward"),
                 "--reward_funcs", EXACT, "--reward_weights", "1", "0"]
    elif reward == "exact":
        argv += ["--reward_model_paths", "--reward_funcs", EXACT]
    return argv


def trained(args: Args) -> list[str]:
    """The stages a seed trains: --methods and the stages they wait for, in STAGES' order."""
    names, todo = set(), list(args.methods)
    while todo:
        name = todo.pop()
        if name in STAGES and name not in names:
            names.add(name)
            todo += STAGES[name][2]
    return [name for name in STAGES if name in names]


def study_stages(args: Args) -> dict:
    """{key: (argv, keys it waits for, log)} of the whole study, in the order they may start."""
    me = ["benchmarks/real_lm.py", "--model_name_or_path", args.model_name_or_path, "--output_dir", args.output_dir,
          "--threads", str(args.threads), "--max_new_tokens", str(args.max_new_tokens)]
    logs = os.path.join(args.output_dir, "logs")
    stages = {"pairs": ([*me, "--stage", "pairs", "--pair_prompts", str(args.pair_prompts), "--pair_samples",
                         str(args.pair_samples), "--pair_temperature", str(args.pair_temperature)], [],
                        os.path.join(logs, "pairs.log")),
              "evaluate_start": ([*me, "--stage", "evaluate", "--stage_models", args.model_name_or_path,
                                  "--n_test", str(args.n_test)], [], os.path.join(logs, "evaluate_start.log"))}
    for seed in args.seeds:
        run_dir = os.path.join(args.output_dir, f"seed_{seed}")
        for name in trained(args):
            stages[seed, name] = (stage_argv(name, seed, run_dir, args),
                                  [n if n == "pairs" else (seed, n) for n in STAGES[name][2]],
                                  os.path.join(run_dir, "logs", f"{name}.log"))
        for i in range(min(args.jobs, len(args.methods))):  # one evaluation process per lane, each starting once
            chunk = args.methods[i::args.jobs]  # its policies are trained
            stages[seed, "evaluate", i] = ([*me, "--stage", "evaluate", "--n_test", str(args.n_test), "--stage_models",
                                            *(os.path.join(run_dir, name) for name in chunk)],
                                           [(seed, name) for name in chunk],
                                           os.path.join(run_dir, "logs", f"evaluate_{i}.log"))
    return stages


def bootstrap(per_question: list[list[float]], n: int = 2000) -> tuple[float, float]:
    """95% percentile interval of the mean over questions, resampling the questions (rows: questions)."""
    import numpy as np

    values = np.asarray(per_question, dtype=float).mean(axis=1)  # each question's mean over the seeds
    means = values[np.random.default_rng(0).integers(0, len(values), (n, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def collect(args: Args, seconds: dict) -> dict:
    """Everything the report shows, from the stages' evaluation files and JSONL logs."""
    from benchmarks.run_tiny_tldr import read_log, seconds_per_step

    def load(path):
        with open(path) as f:
            return json.load(f)

    start = load(eval_file(args.model_name_or_path, args))
    result = {"start": start, "pairs": load(os.path.join(args.output_dir, "data", "pairs_stats.json")),
              "stage_seconds": {"pairs": seconds["pairs"], "evaluate_start": seconds["evaluate_start"]},
              "reward_model": {}, "methods": {}}
    for seed in args.seeds:
        run_dir = os.path.join(args.output_dir, f"seed_{seed}")
        for name in trained(args):
            merged, records = read_log(os.path.join(run_dir, name, "logs", f"{name}__{seed}__{args.stamp}.jsonl"))
            timing = {"seconds": seconds[seed, name], "s_per_step": seconds_per_step(records), "steps": len(records)}
            if name == "reward":
                result["reward_model"][seed] = {"heldout_pair_accuracy": merged["eval_accuracy"], **timing}
            if name not in args.methods:
                continue
            evaluation = load(eval_file(os.path.join(run_dir, name), args))
            result["methods"].setdefault(name, {})[seed] = {**evaluation, **timing}
    for name, runs in result["methods"].items():
        after = [[runs[s]["correct"][q] for s in args.seeds] for q in range(start["n"])]
        change = [[runs[s]["correct"][q] - start["correct"][q] for s in args.seeds] for q in range(start["n"])]
        runs.update(accuracy=statistics.mean(runs[s]["accuracy"] for s in args.seeds), ci95=bootstrap(after),
                    change_ci95=bootstrap(change))
        runs["learned"] = runs["change_ci95"][0] > 0
        runs["seeds_above_start"] = sum(runs[s]["accuracy"] > start["ci95"][1] for s in args.seeds)
    return result


def markdown(r: dict, args: Args) -> str:
    s, start, m = sorted(args.seeds), r["start"], r["methods"]  # seeds run in the order given, listed sorted
    mean = lambda name, key: statistics.mean(m[name][seed][key] for seed in s)  # noqa: E731
    rows = [f"| start model | {start['accuracy']:.1%} ({start['ci95'][0]:.1%} - {start['ci95'][1]:.1%}, Wilson) | | | "
            f"0 | {start['mean_tokens']:.1f} | | {r['stage_seconds']['evaluate_start']:.0f} (evaluation) |"]
    for name in args.methods:
        per_seed = ", ".join(f"{m[name][seed]['accuracy']:.1%}" for seed in s) + f" ({m[name]['seeds_above_start']})"
        rows.append(f"| {TITLES[name]} | **{m[name]['accuracy']:.1%}** "
                    f"({m[name]['ci95'][0]:.1%} - {m[name]['ci95'][1]:.1%}) "
                    f"| {per_seed} | {m[name]['change_ci95'][0]:+.1%} to {m[name]['change_ci95'][1]:+.1%}"
                    f"{' (learned)' if m[name]['learned'] else ''} | {mean(name, 'log_ratio_per_token'):.3f} "
                    f"| {mean(name, 'mean_tokens'):.1f} | {mean(name, 'steps'):.0f} x {mean(name, 's_per_step'):.1f} s "
                    f"| {mean(name, 'seconds'):.0f} + {mean(name, 'eval_seconds'):.0f} |")
    ran = trained(args)  # the budgets of these stages
    steps, rates = ({k: v for k, v in flags.items() if k in ran} for flags in (args.steps, args.learning_rates))
    rm, p = r["reward_model"], r["pairs"]
    rm_line = ""
    if rm:  # trained when a method waits for it
        accuracy = ", ".join(f"{rm[seed]['heldout_pair_accuracy']:.1%}" for seed in s)
        rm_line = (f"Reward model (from the start model, on the pairs): held-out pair accuracy {accuracy}\n"
                   f"(seed{'s' if len(s) > 1 else ''} {', '.join(map(str, s))}; {p['test_pairs']} pairs), "
                   f"{statistics.mean(rm[seed]['seconds'] for seed in s):.0f} s.\n")
    quick = ("QUICK MODE (--quick): 2 steps a stage; the numbers only show that the study runs.\n\n" if args.quick
             else "")
    minutes = r["total_seconds"] / 60
    runs = (f" ({r['runs']} runs: interrupted, then --resume; each counted up to its last finished stage)"
            if r.get("runs", 1) > 1 else "")
    header = ("| method | accuracy after (95% CI) | per seed (above start's interval) | change vs start (95% CI) "
              "| KL to start | length "
              "| steps x s/step | wall time (s) |")
    return f"""# Every method on SmolLM2-135M-Instruct: mixed arithmetic

{quick}Produced {r['date']} by `{r['command']}` on {r['machine']}; total wall time {minutes:.1f} min{runs}.

Held-out greedy accuracy on {start['n']} questions (+, - and x in two wordings each; right when the reply's last
number is the answer), after training from the start model; mean over seed(s) {', '.join(map(str, s))}, with a 95%
percentile bootstrap interval over questions (each question's correctness averaged over the seeds). Change: the
paired bootstrap interval of (after - start); "learned" when it is above 0. Per seed: each seed's accuracy and
how many are above the start model's interval. KL to start: mean per-token
log pi(y_t) - log pi_start(y_t) over the policy's own greedy held-out replies (nats). Length: reply tokens, EOS
included. Wall time: training + evaluation of each stage, in seconds (mean over seeds; {args.jobs} stages at a time,
{args.threads} torch thread(s) each).

{header}
|---|---|---|---|---|---|---|---|
""" + "\n".join(rows) + f"""

{rm_line}Pairs: the start model answered {p['questions']} training questions {p['samples'] // p['questions']} times
each at temperature {args.pair_temperature} ({p['sampled_accuracy']:.1%} right); \
{p['questions_with_a_pair']} questions had a right
and a wrong answer: {p['train_pairs']} training pairs, {p['test_pairs']} held out ({r['stage_seconds']['pairs']:.0f} s).

Budgets: steps {json.dumps(steps)}; learning rates {json.dumps(rates)}; every online step
samples {4 if args.quick else 16} completions (temperature 0.7, at most {args.max_new_tokens} tokens); \
offline steps take
{2 if args.quick else 8} examples, pairs or rows. Figure: `real_lm.png`.
"""


def figure(r: dict, args: Args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start, m = r["start"], r["methods"]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.axhspan(*start["ci95"], color="grey", alpha=0.25, label="start model (95% Wilson)")
    ax.axhline(start["accuracy"], color="grey")
    for i, name in enumerate(args.methods):
        low, high = m[name]["ci95"]
        ax.errorbar(i, m[name]["accuracy"], yerr=[[m[name]["accuracy"] - low], [high - m[name]["accuracy"]]],
                    fmt="o", color="C0" if m[name]["learned"] else "C3", capsize=4)
        ax.plot([i] * len(args.seeds), [m[name][s]["accuracy"] for s in args.seeds], "x", color="k", ms=4)
    ax.set_xticks(range(len(args.methods)), [TITLES[n] for n in args.methods], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"held-out greedy accuracy ({start['n']} questions)")
    ax.set_title("SmolLM2-135M-Instruct: start -> after each method (mean, 95% bootstrap; x: seeds; blue: learned)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: Args):
    if args.quick:
        args.steps = {k: 2 for k in args.steps}
        args.n_test, args.max_new_tokens, args.pair_prompts, args.pair_samples = 8, 16, 32, 4
        args.seeds = args.seeds[:1]
    unknown = set(args.methods) - set(POLICIES)
    if unknown:
        raise SystemExit(f"--methods: no method {', '.join(sorted(unknown))} (methods: {', '.join(POLICIES)})")
    args.methods = [name for name in POLICIES if name in args.methods]  # the report's order
    if not args.model_name_or_path:
        from benchmarks import smollm2

        args.model_name_or_path = smollm2.build()
    if args.stage == "pairs":
        return make_pairs(args)
    if args.stage == "evaluate":
        return evaluate(args)
    from benchmarks.run_tiny_tldr import run_stages, start_progress

    os.chdir(ROOT)  # the reward function is imported from the working directory
    start = time.time()
    progress = os.path.join(args.output_dir, "progress.jsonl")  # a line per finished stage, for --resume
    args.stamp, earlier_seconds, earlier_runs = start_progress(progress, args.resume)
    write_task(args)
    seconds = run_stages(study_stages(args), args.jobs, args.threads, progress)
    result = collect(args, seconds)
    result.update(settings=asdict(args), total_seconds=time.time() - start + earlier_seconds, runs=earlier_runs + 1,
                  date=datetime.date.today().isoformat(),
                  command=shlex.join(["python", "benchmarks/real_lm.py", *sys.argv[1:]]),
                  machine=f"{os.cpu_count()} CPU cores ({platform.machine()})", model=args.model_name_or_path)
    results_dir = args.results_dir or (args.output_dir if args.quick else os.path.join(ROOT, "benchmarks", "results"))
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, "real_lm.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    report = markdown(result, args)
    with open(os.path.join(results_dir, "real_lm.md"), "w") as f:
        f.write(report)
    figure(result, args, os.path.join(results_dir, "real_lm.png"))
    print(report)


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
