"""The tiny TL;DR pipeline end to end on a CPU: tiny base model -> SFT -> reward model, then DPO and
KTO from the SFT model on the preference pairs, GRPO, RLOO, online DPO and PPO from the SFT model
with the reward model, on equal budgets (every online run samples --completions completions; DPO and
KTO see every preference pair once), and GKD: the SFT model distilled on-policy from RLOO's policy (the
chain's strongest on the main job), with as many completions; then the evaluation (benchmarks/tiny_tldr_eval.py) of each
policy as soon as it is trained: its gold win rate against the reference summaries, its reward model
score, its KL to the SFT model and its length, next to the oracle (gold-optimal summaries); plus the
reward model's held-out accuracy, the online runs' reward along training and seconds per step.
Writes benchmarks/results/tiny_tldr.md and four figures beside it (tiny_tldr_*.png).
benchmarks/study_tiny_tldr.py adds seeds, half budgets, the KL-reward frontier and over-optimisation.

Every stage is a subprocess, started as soon as the stages it starts from have finished, `--jobs`
at a time with `--threads` torch threads each: on 2 cores two one-thread processes get more done than
one two-thread process. Every stage runs with the same number of threads whatever `--jobs` is, so the
numbers do not depend on it (another `--threads` changes the last bits of the arithmetic, and so the
runs). A stage's output goes to logs/<stage>.log in its seed's directory.

    python benchmarks/run_tiny_tldr.py                   # the main job
    python benchmarks/run_tiny_tldr.py --seeds 1 2 3     # everything per seed (<output_dir>/seed_<n>); mean ± std
    python benchmarks/run_tiny_tldr.py --max_steps 2 --eval_prompts 32 --kl_prompts 16 \\
        --output_dir /tmp/quick --results /tmp/quick/tiny_tldr.md   # quick check of the whole job
"""

import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import tyro

from benchmarks import tiny_tldr
from benchmarks.vs_trl import machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# stage: (script, stages it starts from, name, settings, what one logged step processes). The
# scheduler starts ready stages in this order: the reward model first (four stages wait for it),
# then the others longest first.
STAGES = {
    "sft": ("algos/sft.py", (), "SFT", "", "16 examples"),
    "reward": ("algos/reward.py", ("sft",), "reward model", "", "16 pairs"),
    "ppo": ("algos/ppo.py", ("sft", "reward"), "PPO", "4 epochs, value model from the RM", "32 samples x 4 epochs"),
    "kto": ("algos/kto.py", ("sft",), "KTO", "", "16 rows"),
    "rloo": ("algos/rloo.py", ("sft", "reward"), "RLOO", "k 4, 2 PPO epochs", "32 samples x 2 epochs"),
    "online_dpo": ("algos/online_dpo.py", ("sft", "reward"), "Online DPO", "sigmoid", "16 prompts x 2 samples"),
    "grpo": ("algos/grpo.py", ("sft", "reward"), "GRPO", "dapo loss", "32 samples"),
    "dpo": ("algos/dpo.py", ("sft",), "DPO", "sigmoid", "16 pairs"),
    # on-policy distillation: the SFT model as the student of the chain's strongest policy, no reward model
    "gkd": ("algos/gkd.py", ("sft", "rloo"), "GKD", "on-policy, reverse KL, teacher RLOO", "16 samples"),
}
# GKD's teacher: RLOO had the best gold win rate of the RL methods on the main job (56.8%, 2026-11-28; PPO
# 51.7%, and GKD from PPO 50.8%, from RLOO 56.8% in a pilot the same day)
TEACHER = STAGES["gkd"][1][1]
# The benchmark's settings where they differ from the scripts' defaults (shown in the table's settings
# column). The online methods' KL strengths are ten times the defaults: at the defaults the KL term never
# bound (a tenth and ten times the default ended at the same KL), so the study's KL sweep could not show
# what it buys. KTO, GKD and PPO learn at rates where half the budget is still below the whole (KTO at
# its default 1e-4 and PPO at 3e-5 were on their plateaus by half the budget). Both were measured in
# pilots on a draft of the task's second version (2026-11-27, seed 1); the study on this version checks them.
# PPO and GKD at 1e-5 barely left SFT on the second version itself (KL 0.07 and 0.06 nats): 2e-5 since 2026-11-28.
# Online DPO at 6e-5: at 3e-5 it ended 19.3 points above SFT (the study asks for 20), at beta 0.5 as at 1.0;
# at 6e-5 57.2% full, 51.1% at half the budget (pilots, seed 1, 2026-11-28).
RECIPE = {"grpo": {"beta": 0.4}, "rloo": {"kl_coef": 0.5}, "online_dpo": {"beta": 1.0, "learning_rate": 6e-5},
          "ppo": {"kl_coef": 0.5, "learning_rate": 2e-5}, "kto": {"learning_rate": 3e-5},
          "gkd": {"learning_rate": 2e-5}}
POLICIES = ["sft", "dpo", "kto", "grpo", "rloo", "online_dpo", "ppo", "gkd"]  # the table's order
# completions each online script samples per step at its defaults (grpo: 4 prompts x 8, rloo: 8 x 4,
# online DPO: 16 x 2, ppo: 32 x 1): every online run gets the same --completions
SAMPLES_PER_STEP = {"grpo": 32, "rloo": 32, "online_dpo": 32, "ppo": 32, "gkd": 16}
# what each online script logs per step: the reward model's mean score of its samples, and its KL
# to the reference (grpo: per-token k3 mean; the others: k1 summed over each sequence)
ONLINE_KEYS = {"grpo": ("reward", "kl"), "rloo": ("objective/scores", "objective/kl"),
               "online_dpo": ("objective/scores", "objective/kl"), "ppo": ("objective/scores", "objective/kl")}
GOLD_KEY = "rewards/gold_reward/mean"  # the gold judge's mean score of each step's samples (a weight-0 reward)


@dataclass
class Args:
    output_dir: str = "output/tiny_tldr"
    """where each stage's model and logs go: <output_dir>/<stage> (<output_dir>/seed_<n>/<stage> with several seeds)"""
    seeds: list[int] = field(default_factory=lambda: [1])
    """seeds; each runs the whole chain, and the table reports the mean ± std over them"""
    jobs: int = 2
    """stages run at the same time"""
    threads: int = 1
    """torch threads of every stage (OMP_NUM_THREADS; fixed, so that --jobs does not change the numbers)"""
    track: bool = False
    """pass --track to every training stage (wandb; WANDB_MODE=offline works without network)"""
    completions: int = 1600
    """sampled completions of every online run (the same budget for GRPO, RLOO, online DPO and PPO:
    completions / 32 steps; GKD: completions / 16 steps); DPO and KTO each see every training preference pair once"""
    max_steps: int = -1
    """quick mode when > 0: every training stage stops after this many steps (rollouts for RLOO and PPO)
    and skips its own evaluations (except the reward model's accuracy); the numbers then only show that the job runs"""
    eval_prompts: int = 512
    """test prompts (the first ones) whose greedy summaries are judged and scored by the reward model"""
    kl_prompts: int = 256
    """test prompts (the first ones) sampled once each at temperature 1 for the KL estimate"""
    results: str = os.path.join(ROOT, "benchmarks", "results", "tiny_tldr.md")
    """markdown file the tables are written to; the figures go beside it (<name>_*.png)"""


def stage_argv(name: str, run_dir: str, seed: int, run_name: str, args: Args, steps: int | None = None,
               settings: dict | None = None, teacher: str | None = None) -> list[str]:
    """Command line of one stage: its output in <run_dir>/<name>, starting from <run_dir>/sft (and
    <run_dir>/reward; GKD's teacher: `teacher`, default <run_dir>/<TEACHER>); `steps` (default: the online budget,
    or the script's own epochs); RECIPE's flags for it, updated with `settings` {flag: value} (the study's
    half budgets, KL sweeps and slowdowns), each flag once."""
    out = lambda stage_name: os.path.join(run_dir, stage_name)  # noqa: E731
    argv = [STAGES[name][0], "--seed", str(seed), "--output_dir", out(name), "--run_name", run_name,
            "--overwrite_output_dir"]
    for flag, value in {**RECIPE.get(name, {}), **(settings or {})}.items():
        argv += [f"--{flag}", f"{value:g}" if isinstance(value, float) else str(value)]
    if steps is None and name in SAMPLES_PER_STEP:
        steps = args.completions // SAMPLES_PER_STEP[name]
    if steps is not None and args.max_steps <= 0:
        argv += ["--max_steps", str(steps)]
    argv += ["--model_name_or_path", tiny_tldr.TINY_MODEL if name == "sft" else out("sft"), "--dataset_name",
             tiny_tldr.TINY_PREFERENCE_DATA if name in ("reward", "dpo", "kto") else tiny_tldr.TINY_SFT_DATA]
    if name == "gkd":
        argv += ["--teacher_model_name_or_path", teacher or out(TEACHER)]
    if name in ("grpo", "rloo", "online_dpo", "ppo"):  # the gold judge, logged (weight 0), not optimised
        argv += ["--reward_model_path" + ("" if name == "ppo" else "s"), out("reward"),
                 "--reward_funcs", "benchmarks.tiny_tldr:gold_reward", "--reward_weights", "1", "0"]
    if args.track:
        argv.append("--track")
    if args.max_steps > 0:  # quick mode: no evaluations inside the stages (but the reward model's accuracy)
        argv += ["--max_steps", str(args.max_steps)]
        argv += ["--dataset_test_split", ""] if name in ("sft", "dpo", "kto") else []
    return argv


def run_stages(stages: dict, jobs: int, threads: int, progress: str | None = None) -> dict:
    """Run every stage {key: (argv, keys it needs, log file)} once the stages it needs have finished,
    up to `jobs` at a time, in the order given. Returns each stage's wall seconds; if one fails, stops
    the others and exits with its log's end. With `progress` (a JSONL file), each finished stage is
    appended to it, and a stage found there with the same command line is not run again, unless a stage it
    needs runs again (an interrupted job goes on where it stopped). Stopped itself (SIGTERM, Ctrl-C), it stops
    the stages it runs."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    pending, running, seconds, began = dict(stages), {}, {}, time.time()
    done = {}
    if progress and os.path.exists(progress):
        with open(progress) as f:
            done = {r["key"]: r for r in map(json.loads, f) if "key" in r}
    kept = {key for key, (argv, _, _) in stages.items() if done.get(json.dumps(list(key)), {}).get("argv") == argv}
    while stale := {key for key in kept if any(n not in kept for n in stages[key][1])}:
        kept -= stale
    for key in kept:
        seconds[key] = done[json.dumps(list(key))]["seconds"]
        del pending[key]
    if seconds:
        print(f"{len(seconds)} of {len(stages)} stages already finished (in {progress}): not run again", flush=True)
    stop = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # `kill`, a time limit
    try:
        while pending or running:
            for key, (argv, needs, log) in list(pending.items()):
                if len(running) < jobs and all(n in seconds for n in needs):
                    print(f"[{time.strftime('%H:%M:%S')}] start {log}: python {' '.join(argv)}", flush=True)
                    os.makedirs(os.path.dirname(log), exist_ok=True)
                    with open(log, "w") as f:
                        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, argv[0]), *argv[1:]], stdout=f,
                                                stderr=subprocess.STDOUT, env=env)
                    running[key] = (proc, time.time(), log, argv)
                    del pending[key]
            time.sleep(0.5)
            for key, (proc, start, log, argv) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[key]
                if proc.returncode != 0:  # run_stages stops the others
                    with open(log) as f:
                        sys.exit(f"{f.read()[-4000:]}\nstage failed (exit status {proc.returncode}); its output: {log}")
                seconds[key] = time.time() - start
                print(f"[{time.strftime('%H:%M:%S')}] done  {log} in {seconds[key]:.0f} s", flush=True)
                if progress:  # `elapsed`: this run's time so far (a job's total over its runs)
                    with open(progress, "a") as f:
                        record = {"key": json.dumps(list(key)), "argv": argv, "seconds": seconds[key], "run": began,
                                  "elapsed": time.time() - began}
                        f.write(json.dumps(record) + "\n")
    finally:  # stopped (SIGTERM, Ctrl-C) or a stage failed: the stages still running stop with it
        signal.signal(signal.SIGTERM, stop)
        for proc, *_ in running.values():
            proc.terminate()
            proc.wait()
    return seconds


def start_progress(path: str, resume: bool) -> tuple[int, float, int]:
    """The progress file of a long job, for run_stages: with `resume` and an existing file, the interrupted
    runs' (time stamp, wall seconds, each run up to its last finished stage, number of runs); else a new file
    holding a new stamp (the run names carry it, so a resumed job's command lines match the first run's)."""
    if resume and os.path.exists(path):
        with open(path) as f:
            lines = [json.loads(line) for line in f]
        runs = {r["run"]: r["elapsed"] for r in lines if "run" in r}
        return lines[0]["stamp"], sum(runs.values()), len(runs)
    stamp = int(time.time())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps({"stamp": stamp}) + "\n")
    return stamp, 0.0, 0


def read_log(path: str) -> tuple[dict, list[dict]]:
    """(all metrics merged, later records winning; the training-step records) of one run's JSONL."""
    with open(path) as f:
        records = [json.loads(line) for line in f]
    merged = {k: v for r in records for k, v in r.items()}
    return merged, [r for r in records if "lr" in r]


def seconds_per_step(records: list[dict]) -> float:
    """Median time between consecutive logged steps: one training step, without the evaluations that
    some steps also run."""
    times = [r["time"] for r in records]
    return statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else float("nan")


def fifths(runs: list[list[dict]], key: str) -> str:
    """Means of `key` over each fifth of the steps (each fifth at least one step), then over the runs
    (one per seed): 'a -> b -> c -> d -> e'."""
    means = []
    for records in runs:
        n = len(records)
        means.append([statistics.mean(r[key] for r in records[i * n // 5:max(i * n // 5 + 1, (i + 1) * n // 5)])
                      for i in range(5)])
    return " -> ".join(f"{statistics.mean(v):.2f}" for v in zip(*means))


def cell(values: list[float], spec: str = ".2f", ci: float | None = None) -> str:
    """One seed's value (± ci when given), or the mean ± std over the seeds."""
    if len(values) == 1:
        return f"{values[0]:{spec}}" + (f" ± {ci:{spec}}" if ci is not None else "")
    return f"{statistics.mean(values):{spec}} ± {statistics.stdev(values):{spec}}"


def evaluate_stage(run_dir: str, policy: str, args: Args, needs: list) -> tuple[list[str], list, str]:
    """The stage that evaluates one policy of `run_dir` (its greedy summaries, RM score, KL to
    <run_dir>/sft, and the oracle) into <run_dir>/eval/<policy>.json, once the stages `needs` are done."""
    argv = ["benchmarks/tiny_tldr_eval.py", "--run_dir", run_dir, "--policies", policy, "--num_prompts",
            str(args.eval_prompts), "--kl_prompts", str(args.kl_prompts), "--out",
            os.path.join(run_dir, "eval", f"{policy}.json")]
    return argv, needs, os.path.join(run_dir, "logs", f"evaluate_{policy}.log")


def chain_stages(run_dir: str, seed: int, run_name, args: Args, stages: dict, start: int | None = None) -> None:
    """Add the whole chain of one seed to `stages` {(seed, name): (argv, needs, log)}: every training
    stage, and an evaluation of each policy as soon as it is trained (so that evaluating is off the
    critical path but for the last policy). With `start` (another seed whose chain is in `stages`), the
    methods start from that seed's SFT and reward models: <run_dir>/sft and reward link to them."""
    for name, (_, needs, *_) in STAGES.items():
        if start is not None and name in ("sft", "reward"):
            link, argv = os.path.join(run_dir, name), stages[start, name][0]
            os.makedirs(run_dir, exist_ok=True)
            if not os.path.lexists(link):  # to the start seed's model: its stage's --output_dir
                os.symlink(os.path.abspath(argv[argv.index("--output_dir") + 1]), link)
            continue
        made = lambda n: (start if start is not None and n in ("sft", "reward") else seed, n)  # noqa: E731
        stages[seed, name] = (stage_argv(name, run_dir, seed, run_name(seed, name), args),
                              [made(n) for n in needs], os.path.join(run_dir, "logs", f"{name}.log"))
    for policy in POLICIES:
        made = (start, policy) if start is not None and policy == "sft" else (seed, policy)
        reward = (start if start is not None else seed, "reward")
        stages[seed, f"evaluate_{policy}"] = evaluate_stage(run_dir, policy, args, [reward, made])


def read_eval(run_dir: str, policies: list[str]) -> dict:
    """{policy: metrics, 'oracle': metrics} from the per-policy evaluation files of `run_dir`."""
    numbers = {}
    for policy in policies:
        with open(os.path.join(run_dir, "eval", f"{policy}.json")) as f:
            numbers.update(json.load(f))
    return numbers


def main(args: Args):
    run_dirs = {s: args.output_dir if len(args.seeds) == 1 else os.path.join(args.output_dir, f"seed_{s}")
                for s in args.seeds}
    stamp = int(time.time())
    run_name = lambda seed, name: f"{name}__{seed}__{stamp}"  # noqa: E731
    start = time.time()
    tiny_tldr.build()
    base_seconds = time.time() - start

    # ---- TRAIN every stage and EVALUATE each policy once trained, `jobs` at a time ----
    stages = {}
    for seed, run_dir in run_dirs.items():
        chain_stages(run_dir, seed, run_name, args, stages)
    seconds = run_stages(stages, args.jobs, args.threads)
    report(args, run_dirs, run_name, seconds, base_seconds, time.time() - start)


def report(args: Args, run_dirs: dict, run_name, seconds: dict, base_seconds: float, total: float) -> dict:
    """Write the table (mean ± std over the seeds) and the figures of the chains in `run_dirs`
    {seed: dir}; returns the numbers {seed: {stage: metrics}}."""
    from benchmarks import plots

    # ---- COLLECT per seed: the evaluation, and from each run's JSONL its steps and final metrics ----
    numbers, steps = {}, {}  # numbers[seed][stage][key]; steps[stage]: the step records of each seed
    for seed, run_dir in run_dirs.items():
        numbers[seed] = read_eval(run_dir, POLICIES)
        numbers[seed]["evaluate"] = {"seconds": sum(seconds[seed, f"evaluate_{p}"] for p in POLICIES)}
        for name in STAGES:
            owner = seed if (seed, name) in seconds else args.seeds[0]  # a chain from the first seed's SFT and RM
            merged, records = read_log(os.path.join(run_dir, name, "logs", f"{run_name(owner, name)}.jsonl"))
            steps.setdefault(name, []).append(records)
            found = numbers[seed].setdefault(name, {})
            found.update(seconds=seconds[owner, name], s_per_step=seconds_per_step(records))
            if name == "reward":
                found["accuracy"] = merged["eval_accuracy"]
            if name in ONLINE_KEYS:  # the reward model's score of the samples, first and last tenth of the steps
                rewards = [r[ONLINE_KEYS[name][0]] for r in records]
                tenth = max(1, len(rewards) // 10)
                found.update(reward_start=statistics.mean(rewards[:tenth]),
                             reward_end=statistics.mean(rewards[-tenth:]))

    def col(stage: str, key: str, spec: str = ".2f", ci: float | None = None) -> str:
        return cell([numbers[seed][stage][key] for seed in args.seeds], spec, ci)

    def policy_row(name: str) -> str:
        _, _, title, settings, batch = STAGES[name]
        settings = ", ".join([*filter(None, [settings]), *(f"{k} {v:g}" for k, v in RECIPE.get(name, {}).items())])
        win_rate = col(name, "win_rate", ".1%", numbers[args.seeds[0]][name]["win_rate_ci"])
        curve = f"{col(name, 'reward_start')} -> {col(name, 'reward_end')}" if name in ONLINE_KEYS else ""
        return (f"| {title}{f' ({settings})' if settings else ''} | **{win_rate}** | {col(name, 'gold_score')} "
                f"| {col(name, 'rm_score')} | {col(name, 'kl')} | {col(name, 'mean_length', '.1f')} | {curve} "
                f"| {col(name, 's_per_step', '.3f')} ({batch}) | {col(name, 'seconds', '.0f')} |")

    rows = [
        "| stage | gold win rate vs references | mean gold score | mean RM score | KL to SFT (nats) | length (tokens) "
        "| RM reward of samples, first -> last tenth | s/step (batch) | wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| tiny base model + data | | | | | | | | {base_seconds:.0f} |",
        f"| oracle (gold-optimal summaries: the facts that fit) | **{col('oracle', 'win_rate', '.1%')}** "
        f"| {col('oracle', 'gold_score')} | {col('oracle', 'rm_score')} | "
        f"| {col('oracle', 'mean_length', '.1f')} | | | |",
        policy_row("sft"),
        f"| reward model | (held-out preference accuracy: **{col('reward', 'accuracy', '.1%')}**) | | | | | "
        f"| {col('reward', 's_per_step', '.3f')} (16 pairs) | {col('reward', 'seconds', '.0f')} |",
        *[policy_row(name) for name in POLICIES[1:]],
        f"| evaluation ({len(POLICIES)} policies, each as soon as it is trained) | | | | | | | "
        f"| {col('evaluate', 'seconds', '.0f')} |",
        f"| total | | | | | | | | {total:.0f} |",
    ]
    # a rising RM score with a falling gold score would mean the RM is being gamed
    over_opt = ["| run | RM score | gold score |", "|---|---|---|"] + [
        f"| {name} | {fifths(steps[name], reward_key)} | {fifths(steps[name], GOLD_KEY)} |"
        for name, (reward_key, _) in ONLINE_KEYS.items()]

    # ---- WRITE the tables and the figures ----
    n, several = len(args.seeds), len(args.seeds) > 1
    command = " ".join(["python", os.path.relpath(sys.argv[0], ROOT),
                        *(a for a in sys.argv[1:] if a != "--report_only")])
    header = (
        f"Tiny TL;DR, produced {datetime.date.today()} by `{command}` (seed{'s' if several else ''} "
        f"{', '.join(map(str, args.seeds))}) on {os.cpu_count()} CPU cores ({platform.machine()}, {machine()['cpu']}; "
        f"the digits hold on that CPU model and thread count only), {args.jobs} stages "
        f"at a time with {args.threads} torch thread{'s' if args.threads > 1 else ''} each"
        + (f"; QUICK MODE (--max_steps {args.max_steps}): the numbers only show that the job runs"
           if args.max_steps > 0 else "") + ".\n\n"
        + f"On the greedy summaries of the first {args.eval_prompts} test prompts: the gold win rate is the share of "
        "prompts where the gold judge prefers the summary to the reference (ties 0.5)"
        + (f"; every number is the mean ± std over the {n} seeds. " if several
           else ", ± half a 95% interval over prompts. ")
        + "The mean RM score is the trained reward model's score of the same summaries; the length counts their tokens "
        f"(EOS included). KL to SFT: a Monte-Carlo estimate of KL(policy || SFT) per summary, in nats: one sample "
        f"(temperature 1, at most 48 tokens, seeded by the prompt's index) from the policy for each of the first "
        f"{args.kl_prompts} test prompts, and the mean over them of sum_t [log pi(y_t) - log pi_SFT(y_t)]. "
        "The RM reward of samples is the reward model's mean score of the completions the online runs sampled, "
        "over the first and the last tenth of their steps. Budgets: every online run samples "
        f"{args.completions if args.max_steps <= 0 else args.max_steps * 32} completions (32 per step; GKD 16 per "
        f"step, distilled from {STAGES[TEACHER][2]}'s policy, no reward model); DPO and KTO "
        "see each training preference pair once (KTO as two unpaired rows). s/step: median seconds per logged step; "
        "wall time: each stage's own (stages run side by side, so they add up to more than the total).\n\n")
    figure = lambda suffix: os.path.splitext(args.results)[0] + f"_{suffix}.png"  # noqa: E731
    figures = (f"\nFigures: `{os.path.basename(figure('win_rate'))}` (win rate per policy), "
               f"`{os.path.basename(figure('training'))}` (reward and KL along training of the online runs), "
               f"`{os.path.basename(figure('rm_vs_gold'))}` (RM score against gold score along training), "
               f"`{os.path.basename(figure('sample_efficiency'))}` (gold score of the samples against completions "
               "sampled).\n")
    table = (header + "\n".join(rows) + "\n\nRM score vs gold score of the sampled completions along training "
             f"(means over each fifth of the steps{', then over the seeds' if several else ''}):\n\n"
             + "\n".join(over_opt) + "\n" + figures)
    print("\n" + table)
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    with open(args.results, "w") as f:
        f.write(table)

    rates = {p: [numbers[seed][p]["win_rate"] for seed in args.seeds] for p in POLICIES}
    plots.win_rate_bars(
        [STAGES[p][2] for p in POLICIES], POLICIES, [statistics.mean(rates[p]) for p in POLICIES],
        [statistics.stdev(rates[p]) if several else numbers[args.seeds[0]][p]["win_rate_ci"] for p in POLICIES],
        [rates[p] for p in POLICIES], f"± std over {n} seeds" if several else "± half a 95% interval over prompts",
        figure("win_rate"))
    online = {name: steps[name] for name in ONLINE_KEYS}
    plots.training_curves(online, ONLINE_KEYS, figure("training"))
    plots.rm_vs_gold(online, {name: keys[0] for name, keys in ONLINE_KEYS.items()}, figure("rm_vs_gold"))
    plots.sample_efficiency(online, statistics.mean(numbers[s]["oracle"]["gold_score"] for s in args.seeds),
                            figure("sample_efficiency"))
    return numbers


if __name__ == "__main__":
    main(tyro.cli(Args))
