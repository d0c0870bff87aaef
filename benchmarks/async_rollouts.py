"""Asynchronous rollouts measured: grpo.py at --max_staleness 0 (sample, then update, in turn) and 1 (the next
generation batch drawn by a copy of the policy in a background thread while the update runs; common/rollouts.py),
side by side on this CPU, every run with one torch thread (OMP_NUM_THREADS=1), so that at K = 1 generation and
training each have one core, and at K = 0 one core does both in turn.

- the tiny TL;DR task (benchmarks/run_tiny_tldr.py's SFT and reward model of seed 1, its GRPO stage at the main
  job's budget): for each seed, K = 0 then K = 1 (interleaved: the machine's load falls on both alike); seconds
  per step (median over steps, the first left out), the seconds the trainer waited for samples and the sampler
  for new weights per step, and the final policy's gold win rate against the references (tiny_tldr_eval.py,
  512 test prompts, greedy);
- SmolLM2-135M-Instruct on the arithmetic task (benchmarks/arithmetic.py, the exact reward; 16 completions per
  step as in benchmarks/real_lm.py): seconds per step, K = 0 and K = 1 in turn, `--repeats` times.

Writes benchmarks/results/async_rollouts.{md,json}.

    python benchmarks/async_rollouts.py                          # ~25 min
    python benchmarks/async_rollouts.py --max_steps 3 --seeds 1 2 --eval_prompts 16 --smollm2_steps 3 \\
        --repeats 1 --output_dir /tmp/async --results /tmp/async/async_rollouts.md   # quick check (tests/)
"""

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import arithmetic, run_tiny_tldr, smollm2, tiny_tldr  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    output_dir: str = "output/async_rollouts"
    """models and logs of every run"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of the tiny task's GRPO runs (the SFT and reward model are seed 1's)"""
    completions: int = 1600
    """completions each tiny GRPO run samples (the main job's budget: 50 steps of 32)"""
    max_steps: int = -1
    """quick mode when > 0: every tiny stage (SFT, reward model, GRPO) stops after this many steps"""
    smollm2_steps: int = 8
    """GRPO steps of each SmolLM2 run (16 completions of up to 48 tokens per step)"""
    repeats: int = 2
    """SmolLM2: K = 0 and K = 1 runs, each, in turn"""
    eval_prompts: int = 512
    """tiny task: test prompts whose greedy summaries the gold judge compares with the references"""
    results: str = os.path.join(ROOT, "benchmarks", "results", "async_rollouts.md")
    """markdown file written (and a JSON beside it)"""


ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
           HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")


def run(argv: list[str], log: str) -> float:
    """python argv (from the repo root), its output in `log`; returns the wall seconds. Exits on a failure."""
    os.makedirs(os.path.dirname(log), exist_ok=True)
    print(f"[{time.strftime('%H:%M:%S')}] python {' '.join(argv)}", flush=True)
    start = time.time()
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, *argv], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=ENV)
    if rc:
        sys.exit(f"{argv[0]} exited {rc}; see {log}:\n" + open(log).read()[-3000:])
    return time.time() - start


def timings(out: str, run_name: str) -> dict:
    """Median seconds per step (the first step, which loads and warms up, left out) and the median seconds
    per step that the trainer waited for samples and the sampler for new weights (K >= 1)."""
    rows = [json.loads(line) for line in open(os.path.join(out, "logs", f"{run_name}.jsonl")) if '"lr"' in line]
    rows = rows[max(i for i, r in enumerate(rows) if r["step"] == 1):]  # this run's (an earlier one's went before)
    step_seconds = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    waits = {k: statistics.median(r.get(f"async/{k}_wait_seconds", 0.0) for r in rows[1:])
             for k in ("trainer", "sampler")}
    return {"seconds_per_step": statistics.median(step_seconds), "steps": len(rows),
            "trainer_wait": waits["trainer"], "sampler_wait": waits["sampler"],
            "staleness": statistics.mean(r.get("async/staleness", 0.0) for r in rows)}


def tiny(args: Args) -> list[dict]:
    tiny_tldr.build()
    base = os.path.join(args.output_dir, "tiny")
    chain = run_tiny_tldr.Args(output_dir=base, completions=args.completions, max_steps=args.max_steps)
    for stage in ("sft", "reward"):
        if not os.path.exists(os.path.join(base, stage, "model.safetensors")):
            run(run_tiny_tldr.stage_argv(stage, base, 1, stage, chain), os.path.join(base, "logs", f"{stage}.log"))
    results = []
    for seed in args.seeds:
        for k in (0, 1):  # interleaved
            name = f"grpo_k{k}_seed{seed}"
            argv = run_tiny_tldr.stage_argv("grpo", base, seed, name, chain, settings={"max_staleness": k})
            argv[argv.index("--output_dir") + 1] = os.path.join(base, name)
            wall = run(argv, os.path.join(base, "logs", f"{name}.log"))
            out = os.path.join(base, f"eval_{name}.json")
            run(["benchmarks/tiny_tldr_eval.py", "--run_dir", base, "--policies", name, "--num_prompts",
                 str(args.eval_prompts), "--kl_prompts", "16", "--out", out],
                os.path.join(base, "logs", f"eval_{name}.log"))
            gold = json.load(open(out))[name]
            results.append(dict(task="tiny", k=k, seed=seed, wall=wall, win_rate=gold["win_rate"],
                                **timings(os.path.join(base, name), name)))
            print(results[-1], flush=True)
    return results


def smollm(args: Args) -> list[dict]:
    model = smollm2.build()
    data = os.path.join(args.output_dir, "smollm2", "data")
    train, _ = arithmetic.make_splits()
    arithmetic.write_jsonl(train, os.path.join(data, "train.jsonl"))
    results = []
    for repeat in range(args.repeats):
        for k in (0, 1):
            name = f"grpo_k{k}_r{repeat}"
            out = os.path.join(args.output_dir, "smollm2", name)
            argv = ["algos/grpo.py", "--model_name_or_path", model, "--dataset_name", data, "--reward_model_paths",
                    "--reward_funcs", "benchmarks.arithmetic:correct", "--per_device_train_batch_size", "16",
                    "--num_generations", "8", "--temperature", "0.7", "--max_prompt_length", "64",
                    "--max_completion_length", "48", "--learning_rate", "2e-5", "--max_steps",
                    str(args.smollm2_steps), "--logging_steps", "1", "--max_staleness", str(k), "--output_dir", out,
                    "--run_name", name, "--overwrite_output_dir", "--num_sample_generations", "0"]
            wall = run(argv, os.path.join(args.output_dir, "smollm2", "logs", f"{name}.log"))
            results.append(dict(task="smollm2", k=k, seed=1, wall=wall, **timings(out, name)))
            print(results[-1], flush=True)
    return results


def summary(rows: list[dict]) -> dict:
    """Per task and K: medians over runs; the win rate's mean and std over seeds."""
    out = {}
    for task in ("tiny", "smollm2"):
        for k in (0, 1):
            mine = [r for r in rows if r["task"] == task and r["k"] == k]
            if not mine:
                continue
            s = {key: statistics.median(r[key] for r in mine) for key in
                 ("seconds_per_step", "trainer_wait", "sampler_wait")}
            if "win_rate" in mine[0]:
                wins = [r["win_rate"] for r in mine]
                s |= {"win_rate": statistics.mean(wins), "win_rate_std": statistics.stdev(wins) if len(wins) > 1
                      else 0.0, "win_rates": wins}
            out[f"{task}_k{k}"] = s | {"runs": len(mine)}
        if f"{task}_k0" in out and f"{task}_k1" in out:
            out[f"{task}_speedup"] = out[f"{task}_k0"]["seconds_per_step"] / out[f"{task}_k1"]["seconds_per_step"]
    return out


def markdown(s: dict, args: Args) -> str:
    lines = ["| task | K | s/step (median) | trainer waits (s/step) | sampler waits (s/step) | speed-up vs K = 0 | "
             "gold win rate (mean ± std over seeds) |", "|---|---|---|---|---|---|---|"]
    tiny_label = f"tiny TL;DR, GRPO {args.completions // 32} x 32"
    for task, label in (("tiny", tiny_label), ("smollm2", "SmolLM2-135M arithmetic, GRPO 16/step")):
        for k in (0, 1):
            r = s.get(f"{task}_k{k}")
            if r is None:
                continue
            win = (f"{100 * r['win_rate']:.1f}% ± {100 * r['win_rate_std']:.1f} "
                   f"({', '.join(f'{100 * w:.1f}' for w in r['win_rates'])})" if "win_rate" in r else "-")
            speed = f"{s[f'{task}_speedup']:.2f}x" if k == 1 and f"{task}_speedup" in s else "1"
            lines.append(f"| {label} | {k} | {r['seconds_per_step']:.3f} | {r['trainer_wait']:.3f} | "
                         f"{r['sampler_wait']:.3f} | {speed} | {win} |")
    return ("# Asynchronous rollouts: GRPO at --max_staleness 0 and 1 on this CPU\n\n"
            f"Produced by `python benchmarks/async_rollouts.py` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} "
            f"cores; one torch thread per run; tiny seeds {args.seeds}, SmolLM2 {args.repeats} x "
            f"{args.smollm2_steps} steps per K, K = 0 and 1 interleaved). s/step: median over each run's steps "
            "but the first, then over runs; waits: the median per step of `async/trainer_wait_seconds` and "
            "`async/sampler_wait_seconds`.\n\n" + "\n".join(lines) + "\n")


def main(args: Args):
    rows = tiny(args) + smollm(args)
    s = summary(rows)
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results, "w") as f:
        f.write(markdown(s, args))
    with open(args.results.removesuffix(".md") + ".json", "w") as f:
        json.dump({"summary": s, "runs": rows}, f, indent=1)
    print(markdown(s, args))


if __name__ == "__main__":
    main(tyro.cli(Args))
