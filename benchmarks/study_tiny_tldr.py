"""The full tiny TL;DR study: what one seed of the main job cannot show.

1. Seeds: seed 1 runs the whole chain (the main job's: SFT -> reward model -> DPO, KTO, GRPO, RLOO,
   online DPO, PPO, GKD); every other seed trains each method again, with its own seed, from seed 1's
   SFT and reward models (as RL methods are usually compared: on one SFT model; the SFT models' own seed
   spread moved every method together and hid the differences of budget). The table is the mean ± std
   over the seeds, with the oracle row (benchmarks/run_tiny_tldr.py).
2. Resolving power: every method again with half its budget (half the sampled completions, half the
   preference pairs), every seed. The testbed resolves a method's budget when its full-budget mean win
   rate less one std is above the half-budget mean plus one std; and it separates two methods when their
   mean ± std intervals do not overlap. A code change: --slowdown's methods at half their learning rate,
   every seed; the change shows when it moves the mean by more than the seeds' std.
3. KL-reward frontier: each method with its KL strength (DPO/KTO/GRPO/online DPO beta, RLOO/PPO
   kl_coef) times 1 and each of --kl_scales, on --frontier_seed's SFT and reward models, saving a
   checkpoint every fifth of its steps; the gold score of the greedy summaries against KL(pi || SFT)
   per summary of every checkpoint, so that each run draws its path from the SFT model (as in Rafailov
   et al. 2023, Fig. 2, and Gao et al. 2022). The x1 runs repeat the seed's main runs (same arguments
   but the checkpoints), so their final models must score as those do.
4. Over-optimisation: a reward model from only --overopt_pairs preference pairs, then GRPO without a
   KL penalty (beta 0), with a larger learning rate, for --overopt_completions completions, beside the
   same GRPO on the full reward model: the reward model's score and the gold score of the samples
   along training.

    python benchmarks/study_tiny_tldr.py          # about 60-70 minutes on 2 cores
    python benchmarks/study_tiny_tldr.py --frontier_only   # seed 1's SFT and reward model, then the frontier
    python benchmarks/study_tiny_tldr.py --resume          # after an interruption: the stages not yet finished
    python benchmarks/study_tiny_tldr.py --max_steps 2 --eval_prompts 16 --kl_prompts 8 \\
        --output_dir /tmp/study --results /tmp/study/tiny_tldr_study.md   # quick check that it runs

Writes benchmarks/results/tiny_tldr_study.md (the tables) and its figures beside it:
tiny_tldr_study_win_rate.png, _training.png, _rm_vs_gold.png, _sample_efficiency.png (the seeds),
tiny_tldr_study_overoptimisation.png; the frontier's tables go to tiny_tldr_study_frontier.md (and .json),
its figure to tiny_tldr_study_frontier.png.
"""

import datetime
import importlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import tyro

from benchmarks import plots, tiny_tldr
from benchmarks.run_tiny_tldr import (GOLD_KEY, POLICIES, RECIPE, ROOT, SAMPLES_PER_STEP, STAGES, TEACHER, Args,
                                      chain_stages, evaluate_stage, fifths, read_eval, read_log, report, run_stages,
                                      stage_argv, start_progress)
from common.runtime import flags

METHODS = POLICIES[1:]
# each method's KL strength: the flag, read from the script's own default
KL_FLAGS = {"dpo": "beta", "kto": "beta", "grpo": "beta", "rloo": "kl_coef", "online_dpo": "beta", "ppo": "kl_coef"}
FRONTIER = list(KL_FLAGS)  # the methods with a KL strength (not GKD: a divergence to its teacher is its whole loss)
UNPAIRED_ROWS = {"dpo": 1, "kto": 2}  # training rows per preference pair (KTO: chosen and rejected apart)


@dataclass
class StudyArgs(Args):
    output_dir: str = "output/tiny_tldr_study"
    """where everything goes: <output_dir>/seed_<n>, half/seed_<n>, frontier/x<scale>, overopt"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of the chain (table, mean ± std) and of the half-budget runs"""
    kl_scales: list[float] = field(default_factory=lambda: [0.1, 10.0])
    """frontier: each method's default KL strength times these (besides 1, the main run)"""
    frontier_seed: int = 1
    """seed whose whole chain runs: every other seed's methods, the frontier and the over-optimisation runs
    start from its SFT and reward models"""
    overopt_pairs: int = 256
    """over-optimisation: preference pairs the small reward model is trained on (one pass)"""
    overopt_completions: int = 4800
    """over-optimisation: completions GRPO samples with beta 0 (3x the main budget)"""
    slowdown: list[str] = field(default_factory=lambda: ["grpo", "dpo"])
    """code-change check: these methods again with half their learning rate, every seed"""
    overopt_learning_rate: float = 1e-4
    """over-optimisation: GRPO's learning rate (its default is 3e-5)"""
    results: str = os.path.join(ROOT, "benchmarks", "results", "tiny_tldr_study.md")
    """markdown file the tables are written to; the figures go beside it (<name>_*.png)"""
    frontier_only: bool = False
    """train and report only the frontier (--frontier_seed's SFT and reward model first): <results>_frontier.md"""
    report_only: bool = False
    """write the tables and figures from a finished study in --output_dir without training anything"""
    resume: bool = False
    """go on with an interrupted study in --output_dir (same flags): the stages its progress.jsonl records as
    finished, with the same command lines, are not run again"""


def default_value(method: str, flag: str) -> float:
    """The benchmark's value of a method's flag: RECIPE's, else the script's own default."""
    if flag in RECIPE.get(method, {}):
        return RECIPE[method][flag]
    value = flags(importlib.import_module(f"algos.{method}").Args())[flag]
    return value[0] if isinstance(value, list) else value  # online DPO: a beta per epoch


def default_kl(method: str) -> float:
    return default_value(method, KL_FLAGS[method])


def linked_dir(path: str, source: str) -> str:
    """A run directory whose sft and reward are links to those of `source` (the runs start from them
    and the evaluation measures KL to that SFT model)."""
    os.makedirs(path, exist_ok=True)
    for name in ("sft", "reward"):
        link = os.path.join(path, name)
        if not os.path.lexists(link):
            os.symlink(os.path.abspath(os.path.join(source, name)), link)
    return path


def train_pairs() -> int:
    with open(os.path.join(tiny_tldr.TINY_PREFERENCE_DATA, "train.jsonl")) as f:
        return sum(1 for _ in f)


def interval_overlaps(a: list[float], b: list[float]) -> bool:
    (ma, sa), (mb, sb) = (statistics.mean(a), statistics.stdev(a)), (statistics.mean(b), statistics.stdev(b))
    return ma - sa <= mb + sb and mb - sb <= ma + sa


def frontier_report(args: StudyArgs, fs: int, frontier_dirs: dict, seed_dir: str, total: float, main_runs: bool) -> str:
    """The frontier's tables (<results>_frontier.md and .json) and figure (.png) from the evaluations of
    the runs in `frontier_dirs` {scale: dir} and their checkpoints; returns the tables' path."""
    start = read_eval(seed_dir, ["sft"])  # the SFT model (KL 0) and the oracle
    # finals: [(kl, gold, win, scale)]; paths: {scale: [(step, kl, gold)]}
    finals, paths = {m: [] for m in FRONTIER}, {m: {} for m in FRONTIER}
    for x, run_dir in frontier_dirs.items():
        for m in FRONTIER:
            e = read_eval(run_dir, [m])[m]
            finals[m].append((e["kl"], e["gold_score"], e["win_rate"], x))
            saved = [(c["step"], c["kl"], c["gold_score"]) for c in e["along_training"]]
            last = [] if any(c["final"] for c in e["along_training"]) else [("end", e["kl"], e["gold_score"])]
            paths[m][x] = [(0, 0.0, start["sft"]["gold_score"]), *saved, *last]
    scales = list(frontier_dirs)
    lines = ["# Tiny TL;DR: the KL-reward frontier along training", "",
             f"Produced {datetime.date.today().isoformat()} by `python benchmarks/study_tiny_tldr.py"
             f"{' --frontier_only' if not main_runs else ''}` on {os.cpu_count()} CPU cores (the whole command: "
             f"{total / 60:.0f} minutes, {args.jobs} stages at a time, {args.threads} thread each). Seed {fs}'s SFT "
             f"and reward model; each method's KL strength times {', '.join(f'{x:g}' for x in scales)} (defaults: "
             + ", ".join(f"{m} {KL_FLAGS[m]} {default_kl(m):g}" for m in FRONTIER)
             + "), a checkpoint every fifth of its steps. Each checkpoint is evaluated as the finished policies are: "
             "KL(pi || SFT) per summary in nats "
             f"(temperature-1 samples of the first {args.kl_prompts} test prompts) and the gold score of the greedy "
             f"summaries of the first {args.eval_prompts} (SFT: {start['sft']['gold_score']:.2f}, oracle "
             f"{start['oracle']['gold_score']:.2f}).", "", "Final models: KL / gold score / win rate.", "",
             "| method | " + " | ".join(f"x{x:g}" for x in scales) + " |", "|---|" + "---|" * len(scales)]
    for m in FRONTIER:
        lines.append(f"| {STAGES[m][2]} | " + " | ".join(f"{kl:.2f} / {g:.2f} / {w:.1%}" for kl, g, w, _ in finals[m])
                     + " |")
    lines += ["", "Along training, step: KL / gold score (step 0 is the SFT model; end: the final model, where "
              "the last checkpoint is not it):", "", "| method | x | path |", "|---|---|---|"]
    for m in FRONTIER:
        for x in scales:
            lines.append(f"| {STAGES[m][2]} | {x:g} | "
                         + " → ".join(f"{step}: {kl:.2f} / {g:.2f}" for step, kl, g in paths[m][x]) + " |")
    if main_runs:  # the x1 runs have the main runs' arguments (and checkpoints): the same final models
        same = [m for m in FRONTIER if read_eval(frontier_dirs[1.0], [m])[m] | {"along_training": None}
                == read_eval(seed_dir, [m])[m] | {"along_training": None}]
        lines += ["", f"The x1 runs repeat seed {fs}'s main runs: identical evaluations for {len(same)} of "
                  f"{len(FRONTIER)} methods ({', '.join(same) or 'none'})."]
    stem = os.path.splitext(args.results)[0] + "_frontier"
    lines += ["", f"Figure: `{os.path.basename(stem)}.png`."]
    plots.frontier(paths, start["sft"]["gold_score"], start["oracle"]["gold_score"], stem + ".png")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"finals": finals, "paths": paths, "seconds": total}, f, indent=1)
    print("\n".join(lines))
    return stem + ".md"


def main(args: StudyArgs):
    if len(args.seeds) < 2 and not args.frontier_only:
        sys.exit("the study needs at least 2 seeds (the table's std and the resolving power)")
    out = os.path.abspath(args.output_dir)
    done_file = os.path.join(out, "stages.json")  # written when every stage has finished
    finished = json.load(open(done_file)) if args.report_only else None
    progress = os.path.join(out, "progress.jsonl")  # a line per finished stage, for --resume
    if finished:
        stamp, earlier_seconds, earlier_runs = finished["stamp"], 0, 0
    else:
        stamp, earlier_seconds, earlier_runs = start_progress(progress, args.resume)
    run_name = lambda key, name: f"{name}__{key}__{stamp}"  # noqa: E731
    start = time.time()
    tiny_tldr.build()
    base_seconds = time.time() - start
    seed_dirs = {s: os.path.join(out, f"seed_{s}") for s in args.seeds}
    fs = args.frontier_seed if args.frontier_seed in seed_dirs else args.seeds[0]
    stages = {}

    made = lambda seed, name: (fs if name in ("sft", "reward") else seed, name)  # noqa: E731  (the stage that made it)

    # ---- 1. the chain of every seed: the frontier seed's whole, the others' methods from its SFT and RM ----
    for seed in sorted(seed_dirs, key=lambda s: s != fs):
        chain_stages(seed_dirs[seed], seed, run_name, args, stages, start=None if seed == fs else fs)
    if args.frontier_only:  # only what the frontier starts from
        stages = {k: v for k, v in stages.items() if k in [(fs, "sft"), (fs, "reward"), (fs, "evaluate_sft")]}

    # ---- 2. half budgets: every method from the same seed's SFT and reward models ----
    batch = 16  # DPO's and KTO's rows per step (their default)
    steps = {m: args.completions // SAMPLES_PER_STEP[m] for m in SAMPLES_PER_STEP}
    steps.update({m: train_pairs() * rows // batch for m, rows in UNPAIRED_ROWS.items()})
    half_steps = {m: n // 2 for m, n in steps.items()}
    half_dirs = {s: linked_dir(os.path.join(out, "half", f"seed_{s}"), seed_dirs[s])
                 for s in (args.seeds if not args.frontier_only else ())}
    for seed, run_dir in half_dirs.items():
        for m in METHODS:
            needs = [made(seed, n) for n in STAGES[m][1]]
            # GKD at half its budget, from the same teacher: the seed's RLOO at its full budget
            stages["half", seed, m] = (stage_argv(m, run_dir, seed, run_name(f"half{seed}", m), args, half_steps[m],
                                                  teacher=os.path.join(seed_dirs[seed], TEACHER)),
                                       needs, os.path.join(run_dir, "logs", f"{m}.log"))
            stages["half", seed, f"evaluate_{m}"] = evaluate_stage(run_dir, m, args,
                                                                   [(fs, "reward"), ("half", seed, m)])

    # ---- 2b. a code change that slows learning: methods at half their learning rate, every seed ----
    slow_dirs = {s: linked_dir(os.path.join(out, "slow", f"seed_{s}"), seed_dirs[s])
                 for s in (args.seeds if not args.frontier_only else ())}
    for seed, run_dir in slow_dirs.items():
        for m in args.slowdown:
            lr = {"learning_rate": default_value(m, "learning_rate") / 2}
            stages["slow", seed, m] = (stage_argv(m, run_dir, seed, run_name(f"slow{seed}", m), args, settings=lr),
                                       [made(seed, n) for n in STAGES[m][1]],
                                       os.path.join(run_dir, "logs", f"{m}.log"))
            stages["slow", seed, f"evaluate_{m}"] = evaluate_stage(run_dir, m, args,
                                                                   [(fs, "reward"), ("slow", seed, m)])

    # ---- 3. the frontier: each method's KL strength scaled, a checkpoint every fifth of the steps ----
    frontier_dirs = {x: linked_dir(os.path.join(out, "frontier", f"x{x:g}"), seed_dirs[fs])
                     for x in sorted({1.0, *args.kl_scales})}
    for x, run_dir in frontier_dirs.items():
        for m in FRONTIER:
            every = max(1, (steps[m] if args.max_steps <= 0 else args.max_steps) // 5)
            flags = {KL_FLAGS[m]: default_kl(m) * x, "save_steps": every, "save_total_limit": 5}
            stages["frontier", x, m] = (stage_argv(m, run_dir, fs, run_name(f"x{x:g}", m), args, settings=flags),
                                        [(fs, n) for n in STAGES[m][1]], os.path.join(run_dir, "logs", f"{m}.log"))
            argv, needs, log = evaluate_stage(run_dir, m, args, [(fs, "reward"), ("frontier", x, m)])
            stages["frontier", x, f"evaluate_{m}"] = ([*argv, "--checkpoints"], needs, log)

    # ---- 4. over-optimisation: a reward model from few pairs, GRPO without KL on it and on the full one ----
    overopt_dir = os.path.join(out, "overopt")
    small_rm = os.path.join(overopt_dir, "reward_small")
    stages["overopt", "reward"] = (
        ["algos/reward.py", "--seed", str(fs), "--model_name_or_path", os.path.join(seed_dirs[fs], "sft"),
         "--output_dir", small_rm, "--run_name", run_name("overopt", "reward_small"), "--overwrite_output_dir",
         "--max_steps", str(max(1, args.overopt_pairs // batch) if args.max_steps <= 0 else args.max_steps)],
        [(fs, "sft")], os.path.join(overopt_dir, "logs", "reward_small.log"))
    overopt_runs = {"small RM, beta 0": ("grpo_small_rm", small_rm, [("overopt", "reward")]),
                    "full RM, beta 0": ("grpo_full_rm", os.path.join(seed_dirs[fs], "reward"), [(fs, "reward")])}
    for name, rm, needs in overopt_runs.values() if not args.frontier_only else ():
        argv = stage_argv("grpo", seed_dirs[fs], fs, run_name("overopt", name), args,
                          args.overopt_completions // SAMPLES_PER_STEP["grpo"],
                          {"beta": 0.0, "learning_rate": args.overopt_learning_rate})
        argv[argv.index("--output_dir") + 1] = os.path.join(overopt_dir, name)
        argv[argv.index("--reward_model_paths") + 1] = rm
        stages["overopt", name] = (argv, [(fs, "sft"), *needs], os.path.join(overopt_dir, "logs", f"{name}.log"))
    if args.frontier_only:
        del stages["overopt", "reward"]

    if finished:
        seconds = {tuple(json.loads(k)): v for k, v in finished["seconds"].items()}
        base_seconds, total, runs = finished["base_seconds"], finished["total"], finished.get("runs", 1)
    else:
        seconds = run_stages(stages, args.jobs, args.threads, progress)
        total, runs = time.time() - start + earlier_seconds, earlier_runs + 1
        with open(done_file, "w") as f:
            json.dump({"stamp": stamp, "base_seconds": base_seconds, "total": total, "runs": runs,
                       "seconds": {json.dumps(list(k)): v for k, v in seconds.items()}}, f)

    # ---- REPORT: the seeds' table and figures, the frontier (its own file), then the study's own sections ----
    if args.frontier_only:
        return frontier_report(args, fs, frontier_dirs, seed_dirs[fs], total, main_runs=False)
    numbers = report(args, seed_dirs, run_name, seconds, base_seconds, total)
    frontier_file = frontier_report(args, fs, frontier_dirs, seed_dirs[fs], total, main_runs=True)
    full = {m: [numbers[s][m]["win_rate"] for s in args.seeds] for m in METHODS}
    half = {m: [read_eval(d, [m])[m]["win_rate"] for d in half_dirs.values()] for m in METHODS}
    lines = ["", "## Resolving power", "",
             f"Each method with half its budget ({args.completions // 2} completions; DPO and KTO half the pairs: "
             f"{half_steps['dpo']} and {half_steps['kto']} steps), from the same seeds' SFT and reward models. "
             "Resolved: the full-budget mean win rate less one std (over the seeds) is above the half-budget "
             "mean plus one std.", "",
             "| method | full budget | half budget | (full - std) - (half + std) | resolved |", "|---|---|---|---|---|"]
    resolved = 0
    for m in METHODS:
        mean_f, std_f = statistics.mean(full[m]), statistics.stdev(full[m])
        mean_h, std_h = statistics.mean(half[m]), statistics.stdev(half[m])
        gap = (mean_f - std_f) - (mean_h + std_h)
        resolved += gap > 0
        lines.append(f"| {STAGES[m][2]} | {mean_f:.1%} ± {std_f:.1%} | {mean_h:.1%} ± {std_h:.1%} "
                     f"| {100 * gap:+.1f} points | {'yes' if gap > 0 else 'no'} |")
    apart = [(a, b) for i, a in enumerate(METHODS) for b in METHODS[i + 1:] if not interval_overlaps(full[a], full[b])]
    lines += ["", f"Resolved: {resolved} of {len(METHODS)} methods. Pairs of methods whose mean ± std intervals "
              f"do not overlap ({len(apart)} of {len(METHODS) * (len(METHODS) - 1) // 2}): "
              + (", ".join(f"{STAGES[a][2]} / {STAGES[b][2]}" for a, b in apart) or "none") + "."]

    slow = {m: [read_eval(d, [m])[m]["win_rate"] for d in slow_dirs.values()] for m in args.slowdown}
    lines += ["", "## A code change that slows learning", "",
              "Each method again with half its learning rate (one changed line), every seed, full budget. Moved: "
              "the two means differ by more than the larger of the two std.", "",
              "| method | as is | half the learning rate | difference | moved |", "|---|---|---|---|---|"]
    for m in args.slowdown:
        diff = statistics.mean(full[m]) - statistics.mean(slow[m])
        std_a, std_b = statistics.stdev(full[m]), statistics.stdev(slow[m])
        moved = abs(diff) > max(std_a, std_b)
        lines.append(f"| {STAGES[m][2]} (lr {default_value(m, 'learning_rate'):g}) | {statistics.mean(full[m]):.1%} ± "
                     f"{std_a:.1%} | {statistics.mean(slow[m]):.1%} ± {std_b:.1%} | {100 * diff:+.1f} points "
                     f"| {'yes' if moved else 'no'} |")

    figure = lambda suffix: os.path.splitext(args.results)[0] + f"_{suffix}.png"  # noqa: E731
    lines += ["", "## KL-reward frontier", "",
              f"In `{os.path.basename(frontier_file)}`: each method's gold score against its KL to the SFT model "
              "along training, at several KL strengths, and its figure.", ""]

    overopt = {name: read_log(os.path.join(overopt_dir, run, "logs", f"{run_name('overopt', run)}.jsonl"))[1]
               for name, (run, _, _) in overopt_runs.items()}
    small_rm_metrics, _ = read_log(os.path.join(small_rm, "logs", f"{run_name('overopt', 'reward_small')}.jsonl"))
    lines += ["", "## Over-optimisation", "",
              f"GRPO without a KL penalty (beta 0), learning rate {args.overopt_learning_rate:g}, for "
              f"{args.overopt_completions} completions, on a reward model "
              f"trained on {args.overopt_pairs} pairs (held-out accuracy {small_rm_metrics['eval_accuracy']:.1%}) "
              f"and on the full reward model ({numbers[fs]['reward']['accuracy']:.1%}). Means over each fifth of the "
              "steps of the samples' scores:", "", "| run | RM score | gold score |", "|---|---|---|"]
    for name, records in overopt.items():
        lines.append(f"| {name} | {fifths([records], 'reward')} | {fifths([records], GOLD_KEY)} |")
    plots.overoptimisation(overopt, "reward", figure("overoptimisation"))
    lines += ["", f"Figure: `{os.path.basename(figure('overoptimisation'))}`.",
              "", f"Whole study: {total / 60:.0f} minutes ({args.jobs} stages at a time, {args.threads} thread each"
              + (f"; {runs} runs, each resumed with --resume after an interruption, counted up to its last finished "
                 "stage)." if runs > 1 else ").")]
    with open(args.results, "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    with open(os.path.splitext(args.results)[0] + ".json", "w") as f:
        json.dump({"seeds": numbers, "half": half, "slow": slow, "seconds": total,
                   "overopt": {k: [{"episode": r["episode"], "reward": r["reward"], "gold": r[GOLD_KEY]}
                                   for r in v] for k, v in overopt.items()}}, f, indent=1, default=str)


if __name__ == "__main__":
    main(tyro.cli(StudyArgs))
