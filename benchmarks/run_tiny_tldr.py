"""The tiny TL;DR pipeline end to end on a CPU: tiny base model -> SFT -> reward model, then the
numbers: gold win rate of the SFT policy against the reference summaries, and the reward model's
held-out preference accuracy. Writes benchmarks/results/tiny_tldr.md.

    python benchmarks/run_tiny_tldr.py
"""

import datetime
import json
import os
import platform
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
    sft, rm = last_log(out("sft")), last_log(out("reward"))
    total = time.time() - start

    rows = [
        "| stage | result | wall time (s) |",
        "|---|---|---|",
        f"| tiny base model + data | built (or found in the cache) | {times['base']:.0f} |",
        f"| SFT | gold win rate vs references: **{sft['gold/win_rate']:.1%} ± {sft['gold/win_rate_ci']:.1%}** "
        f"(mean gold score {sft['gold/score']:.2f}, length {sft['gold/mean_length']:.1f} tokens) | {times['sft']:.0f} |",
        f"| reward model | held-out preference accuracy: **{rm['eval_accuracy']:.1%}** | {times['reward']:.0f} |",
        f"| total | | {total:.0f} |",
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
