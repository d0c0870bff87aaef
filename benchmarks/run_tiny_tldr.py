"""The tiny TL;DR pipeline end to end on a CPU: tiny base model -> SFT -> reward model, DPO and KTO
from the SFT model, then the numbers: gold win rate of each policy against the reference summaries,
the reward model's held-out preference accuracy, and training seconds per step. Writes
benchmarks/results/tiny_tldr.md.

    python benchmarks/run_tiny_tldr.py
"""

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    output_dir: str = "output/tiny_tldr"
    """where each stage's model and logs go (<output_dir>/<stage>)"""
    seed: int = 1
    """seed passed to every stage"""
    results: str = os.path.join(ROOT, "benchmarks", "results", "tiny_tldr.md")
    """markdown file the results table is written to"""


def last_log(output_dir: str) -> dict:
    """Merged metrics of the newest run logged in `<output_dir>/logs` (later records win)."""
    logs = os.path.join(output_dir, "logs")
    newest = max((f for f in os.listdir(logs) if f.endswith(".jsonl")),
                 key=lambda f: os.path.getmtime(os.path.join(logs, f)))
    merged = {}
    with open(os.path.join(logs, newest)) as f:
        for line in f:
            merged.update(json.loads(line))
    return merged


def seconds_per_step(output_dir: str) -> float:
    """Median time between consecutive logged steps of the newest run: one training step, without
    the evaluations that some steps also run."""
    logs = os.path.join(output_dir, "logs")
    newest = max((f for f in os.listdir(logs) if f.endswith(".jsonl")),
                 key=lambda f: os.path.getmtime(os.path.join(logs, f)))
    with open(os.path.join(logs, newest)) as f:
        times = {r["step"]: r["time"] for r in map(json.loads, f) if "loss" in r}
    steps = sorted(times)
    return statistics.median(times[b] - times[a] for a, b in zip(steps, steps[1:]))


def stage(name: str, script: str, *argv: str) -> float:
    print(f"\n=== {name}: python {script} {' '.join(argv)}", flush=True)
    start = time.time()
    subprocess.run([sys.executable, os.path.join(ROOT, script), *argv], check=True)
    return time.time() - start


def main(args: Args):
    from benchmarks import tiny_tldr

    out = lambda stage_name: os.path.join(args.output_dir, stage_name)  # noqa: E731
    seed = ["--seed", str(args.seed)]
    start = time.time()
    tiny_tldr.materialize(tiny_tldr.TINY_MODEL)
    times = {"base": time.time() - start}
    times["sft"] = stage("SFT", "algos/sft.py", *seed, "--output_dir", out("sft"))
    times["reward"] = stage("reward model", "algos/reward.py", *seed, "--model_name_or_path", out("sft"),
                            "--output_dir", out("reward"))
    for name in ("dpo", "kto"):
        times[name] = stage(name.upper(), f"algos/{name}.py", *seed, "--model_name_or_path", out("sft"),
                            "--output_dir", out(name))
    total = time.time() - start

    def policy_row(title, name):
        log = last_log(out(name))
        return (f"| {title} | **{log['gold/win_rate']:.1%} ± {log['gold/win_rate_ci']:.1%}** | {log['gold/score']:.2f} "
                f"| {log['gold/mean_length']:.1f} | {seconds_per_step(out(name)):.3f} | {times[name]:.0f} |")

    rm = last_log(out("reward"))
    rows = [
        "| stage | gold win rate vs references | mean gold score | length (tokens) | s/step (batch 16) | wall time (s) |",
        "|---|---|---|---|---|---|",
        f"| tiny base model + data | | | | | {times['base']:.0f} |",
        policy_row("SFT", "sft"),
        f"| reward model | (held-out preference accuracy: **{rm['eval_accuracy']:.1%}**) | | | "
        f"{seconds_per_step(out('reward')):.3f} | {times['reward']:.0f} |",
        policy_row("DPO (sigmoid)", "dpo"),
        policy_row("KTO", "kto"),
        f"| total | | | | | {total:.0f} |",
    ]
    header = (f"Tiny TL;DR, produced {datetime.date.today()} by `python benchmarks/run_tiny_tldr.py` "
              f"(seed {args.seed}) on {os.cpu_count()} CPU cores ({platform.machine()}). Win rate: share "
              f"of the {tiny_tldr.SPLIT_SIZES['test']} test prompts where the gold judge prefers the greedy summary to the reference "
              "(ties 0.5), ± half a 95% interval.\n\n")
    table = header + "\n".join(rows) + "\n"
    print("\n" + table)
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results, "w") as f:
        f.write(table)


if __name__ == "__main__":
    main(tyro.cli(Args))
