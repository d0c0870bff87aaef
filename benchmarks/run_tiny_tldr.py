"""The tiny TL;DR pipeline end to end on a CPU: tiny base model -> SFT -> reward model, then DPO and
KTO from the SFT model on the preference pairs, GRPO, RLOO, online DPO and PPO from the SFT model
with the reward model; then the numbers: gold win rate of each policy against the reference summaries, the reward
model's held-out preference accuracy, the online runs' reward at the start and end of training, and
training seconds per step. Writes benchmarks/results/tiny_tldr.md.

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


def step_records(output_dir: str) -> list[dict]:
    """The training-step records of the newest run logged in `<output_dir>/logs`."""
    logs = os.path.join(output_dir, "logs")
    newest = max((f for f in os.listdir(logs) if f.endswith(".jsonl")),
                 key=lambda f: os.path.getmtime(os.path.join(logs, f)))
    with open(os.path.join(logs, newest)) as f:
        return [r for r in map(json.loads, f) if "lr" in r]


def reward_curve(output_dir: str, key: str) -> str:
    """Mean of `key` over the first and the last tenth of the steps: 'start -> end'."""
    values = [r[key] for r in step_records(output_dir)]
    n = max(1, len(values) // 10)
    return f"{statistics.mean(values[:n]):.2f} -> {statistics.mean(values[-n:]):.2f}"


def over_optimization(out) -> str:
    """RM score and gold score of the sampled completions along training, per online run (means over
    fifths of the steps): a rising RM score with a falling gold score means the RM is being gamed."""
    lines = ["\nRM score vs gold score of the sampled completions along training (means over each fifth of the steps):\n",
             "| run | RM score | gold score |", "|---|---|---|"]
    for name, key in (("grpo", "reward"), ("rloo", "objective/scores"), ("online_dpo", "objective/scores"),
                      ("ppo", "objective/scores")):
        records = step_records(out(name))
        fifths = [records[i * len(records) // 5:(i + 1) * len(records) // 5] for i in range(5)]
        curve = lambda k: " -> ".join(f"{statistics.mean(r[k] for r in part):.2f}" for part in fifths)  # noqa: E731
        lines.append(f"| {name} | {curve(key)} | {curve('gold/score_sampled')} |")
    return "\n".join(lines)


def seconds_per_step(output_dir: str) -> float:
    """Median time between consecutive logged steps of the newest run: one training step, without
    the evaluations that some steps also run."""
    times = {r["step"]: r["time"] for r in step_records(output_dir)}
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
    for name in ("grpo", "rloo", "online_dpo"):
        times[name] = stage(name, f"algos/{name}.py", *seed, "--model_name_or_path", out("sft"),
                            "--reward_model_paths", out("reward"), "--output_dir", out(name))
    times["ppo"] = stage("ppo", "algos/ppo.py", *seed, "--model_name_or_path", out("sft"),
                         "--reward_model_path", out("reward"), "--output_dir", out("ppo"))
    total = time.time() - start

    def policy_row(title, name, batch, curve=""):
        log = last_log(out(name))
        return (f"| {title} | **{log['gold/win_rate']:.1%} ± {log['gold/win_rate_ci']:.1%}** | {log['gold/score']:.2f} "
                f"| {log['gold/mean_length']:.1f} | {curve} | {seconds_per_step(out(name)):.3f} ({batch}) | {times[name]:.0f} |")

    rm = last_log(out("reward"))
    rows = [
        "| stage | gold win rate vs references | mean gold score | length (tokens) | RM reward of samples, first -> last tenth | s/step (batch) | wall time (s) |",
        "|---|---|---|---|---|---|---|",
        f"| tiny base model + data | | | | | | {times['base']:.0f} |",
        policy_row("SFT", "sft", "16 examples"),
        f"| reward model | (held-out preference accuracy: **{rm['eval_accuracy']:.1%}**) | | | | "
        f"{seconds_per_step(out('reward')):.3f} (16 pairs) | {times['reward']:.0f} |",
        policy_row("DPO (sigmoid)", "dpo", "16 pairs"),
        policy_row("KTO", "kto", "16 rows"),
        policy_row("GRPO (dapo loss, beta 0.04)", "grpo", "32 samples", reward_curve(out("grpo"), "reward")),
        policy_row("RLOO (k 4, 2 PPO epochs)", "rloo", "32 samples x 2 epochs",
                   reward_curve(out("rloo"), "objective/scores")),
        policy_row("Online DPO (sigmoid, beta 0.1)", "online_dpo", "16 prompts x 2 samples",
                   reward_curve(out("online_dpo"), "objective/scores")),
        policy_row("PPO (4 epochs, value model from the RM)", "ppo", "32 samples x 4 epochs",
                   reward_curve(out("ppo"), "objective/scores")),
        f"| total | | | | | | {total:.0f} |",
    ]
    header = (f"Tiny TL;DR, produced {datetime.date.today()} by `python benchmarks/run_tiny_tldr.py` "
              f"(seed {args.seed}) on {os.cpu_count()} CPU cores ({platform.machine()}). Win rate: share "
              f"of the {tiny_tldr.SPLIT_SIZES['test']} test prompts where the gold judge prefers the greedy summary to the reference "
              "(ties 0.5), ± half a 95% interval.\n\n")
    table = header + "\n".join(rows) + "\n"
    table += over_optimization(out) + "\n"
    print("\n" + table)
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results, "w") as f:
        f.write(table)


if __name__ == "__main__":
    main(tyro.cli(Args))
