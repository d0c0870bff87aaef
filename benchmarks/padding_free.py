"""Padded against padding-free (--padding_free, issue 57): seconds per step, real tokens per second, peak memory.

For sft, dpo and grpo (kto too, with --scripts), on the tiny model or SmolLM2-135M-Instruct (--model), each script
runs padded and with --padding_free in fresh Python processes, interleaved (padded, packed, padded, packed, ...) so
that a machine whose speed drifts slows both alike, on a synthetic data set whose lengths are spread as in real
preference and RL data: prompts and completions log-uniform in token length (PROMPT_TOKENS, COMPLETION_TOKENS:
sequences of about 20 to 500 tokens), written to .jsonl files with a fixed seed (random words of the tiny task, cut
to the drawn number of the model's tokens). For grpo the spread comes from the prompts (left-padded) and from the
completions' lengths (each stops at its EOS; padded to the longest).

Measured per run, from the same clock and the same process as benchmarks/vs_trl.py (its spawn, run_ours,
step_times and seconds_per_update): the median seconds of one optimizer step over steps 2..N (the scripts' `time`
field in <output_dir>/logs/<run>.jsonl), the peak RSS of the process (os.wait4). Inside each child a counter on the
outermost transformers model call (not inside `generate`) adds up the token positions fed to the models and the
real (unmasked) ones among them, per step (a packed pass's room at the end of its packed rows, common.packing.pack,
counts as fed, not real): the pad share of a padded run is 1 - real / fed over steps 2..N (the padded passes' own
positions: where a pass shares a prompt's prefix cache, common.generation.shifted_logits, the prompt counts once).
Real tokens per second: the real tokens the padding-free run feeds per step (every row's real tokens in every pass)
over the seconds per step, the same numerator for both variants.

--profile (item 5): one more process per script and variant runs the script's main() in-process under
benchmarks.throughput's Meter (the outermost module call as forward, Accelerator.backward, GenerationMixin.generate,
the optimizer's step / zero_grad / clipping), and reports the share of a step's wall time spent outside the model's
forward and backward passes (and, for grpo, outside generation): the optimizer plus "other" (collation, tokenizing
and decoding, reward functions, loss and advantage math outside the model, logging, Python). Forward includes the
no-grad log-prob passes (reference, old policy); the Meter's wrappers cost a little Python per module call.

    python benchmarks/padding_free.py --quick                  # tiny model, sft and dpo, 1 run each way, 3 steps
    python benchmarks/padding_free.py                          # tiny: sft dpo grpo, 2 runs per variant
    python benchmarks/padding_free.py --model smollm2 --profile

Writes benchmarks/results/padding_free.json and .md (one section per --model; --quick writes its own section).
The ratio is padded seconds per step over padding-free: above 1, padding-free is faster.
"""

import dataclasses
import datetime
import json
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal

import tyro

from benchmarks import tiny_tldr
from benchmarks.throughput import NO_EVAL, ROOT, format_table, shell, summarize
from benchmarks.vs_trl import machine, seconds_per_update, spawn, step_times, versions

VARIANTS = ("padded", "packed")
# token lengths of the synthetic rows: log-uniform in [low, high]
PROMPT_TOKENS = {"sft": (10, 300), "dpo": (10, 300), "kto": (10, 300), "grpo": (20, 400)}
COMPLETION_TOKENS = (10, 200)  # sft's completion, dpo's / kto's chosen and rejected
# fixed shapes per model (passed explicitly, so that a change of a script's defaults does not move the numbers)
SHAPES = {
    "tiny": {
        "sft": ["--per_device_train_batch_size", "16", "--max_length", "512"],
        "dpo": ["--per_device_train_batch_size", "8", "--max_length", "512", "--max_prompt_length", "320",
                "--max_completion_length", "200"],
        "kto": ["--per_device_train_batch_size", "8", "--max_length", "512", "--max_prompt_length", "320",
                "--max_completion_length", "200"],
        "grpo": ["--per_device_train_batch_size", "16", "--num_generations", "4", "--max_prompt_length", "448",
                 "--max_completion_length", "32"],
    },
    "smollm2": {
        "sft": ["--per_device_train_batch_size", "4", "--max_length", "512"],
        "dpo": ["--per_device_train_batch_size", "2", "--max_length", "512", "--max_prompt_length", "320",
                "--max_completion_length", "200"],
        "kto": ["--per_device_train_batch_size", "2", "--max_length", "512", "--max_prompt_length", "320",
                "--max_completion_length", "200"],
        "grpo": ["--per_device_train_batch_size", "8", "--num_generations", "2", "--max_prompt_length", "448",
                 "--max_completion_length", "32"],
    },
}
STEP = {"sft": "sequences", "dpo": "pairs + reference", "kto": "rows + KL rows + reference",
        "grpo": "prompts x samples"}


@dataclass
class Args:
    model: Literal["tiny", "smollm2"] = "tiny"
    """tiny: tiny_tldr/tiny-pythia (the base model, for every script); smollm2: SmolLM2-135M-Instruct"""
    model_path: str | None = None
    """a model folder in place of --model's (its shapes stay --model's): e.g. SmolLM2's architecture with random
    weights where the shipped weights cannot be carried (a lent GPU machine)"""
    extra: str = ""
    """flags passed to every script run, in one string: e.g. --extra=--bf16 on a GPU"""
    scripts: list[Literal["sft", "dpo", "kto", "grpo"]] = dataclasses.field(
        default_factory=lambda: ["sft", "dpo", "grpo"])
    """scripts to measure"""
    runs: int = 2
    """runs per variant, interleaved: padded, packed, padded, packed, ..."""
    steps: int | None = None
    """logged steps per run (default: 6 tiny, 4 smollm2); the median is over steps 2..N"""
    threads: int = 2
    """torch CPU threads in every process"""
    rows: int = 256
    """rows of each synthetic data file"""
    seed: int = 1
    """seed of the synthetic data and of the scripts"""
    profile: bool = False
    """also one Meter-profiled run per script and variant: the share of a step outside forward / backward / generate"""
    quick: bool = False
    """a check that it works: tiny model, sft and dpo (grpo's sampling is slow on a CPU), one run per variant,
    3 steps, no profile (about a minute); its own section 'quick' in the results"""
    work_dir: str | None = None
    """data files and the runs' outputs (default: a temporary directory, removed at the end)"""
    results_dir: str = os.path.join(ROOT, "benchmarks", "results")
    """padding_free.json and .md are written here ('' writes none)"""
    note: str = ""
    """a line for the report (e.g. 'shared machine')"""
    timeout: int = 1200
    """seconds one process may take before it is stopped"""


def length_reward(prompts, completions, **kwargs) -> list[float]:
    """grpo's reward: any cheap function will do for timing (advantages only need some spread)."""
    return [len(c if isinstance(c, str) else c[-1]["content"]) / 100 for c in completions]


# ---------------------------------------------------------------------------------------------
# DATA: a fixed-seed synthetic set with spread lengths, cut in the model's own tokens
# ---------------------------------------------------------------------------------------------
def data_files(work: str, model_path: str, rows: int, seed: int) -> dict:
    """One .jsonl file per layout (prompt-completion for sft, paired preferences for dpo / kto, prompts for grpo)."""
    from transformers import AutoTokenizer

    tiny_tldr.build()
    with open(os.path.join(tiny_tldr.TINY_SFT_DATA, "train.jsonl")) as f:
        words = sorted({w for line in f for w in json.loads(line)["prompt"].split()})
    tokenizer, rng = AutoTokenizer.from_pretrained(model_path), random.Random(seed)
    tokenizer.model_max_length = 10**9  # only counting here: no warning about the model's length

    def text(low: int, high: int) -> str:
        n = round(math.exp(rng.uniform(math.log(low), math.log(high))))  # log-uniform: many short, some long
        ids = tokenizer(" ".join(rng.choices(words, k=n)), add_special_tokens=False).input_ids[:n]
        return tokenizer.decode(ids).strip()

    def write(name: str, make) -> str:
        path = os.path.join(work, name)
        with open(path, "w") as f:
            f.writelines(json.dumps(make()) + "\n" for _ in range(rows))
        return path
    pref = write("preference.jsonl", lambda: {"prompt": text(*PROMPT_TOKENS["dpo"]) + "\n",
                                              "chosen": " " + text(*COMPLETION_TOKENS),
                                              "rejected": " " + text(*COMPLETION_TOKENS)})
    return {"sft": write("sft.jsonl", lambda: {"prompt": text(*PROMPT_TOKENS["sft"]) + "\n",
                                               "completion": " " + text(*COMPLETION_TOKENS)}),
            "dpo": pref, "kto": pref, "grpo": write("prompts.jsonl", lambda: {"prompt": text(*PROMPT_TOKENS["grpo"])})}


# ---------------------------------------------------------------------------------------------
# CHILD PROCESSES (spawned through vs_trl.spawn with this module's run_child)
# ---------------------------------------------------------------------------------------------
def run_child(spec_path: str):
    """One run of a script: under the Meter (--profile, benchmarks.throughput.run_worker) or, for the timing runs,
    vs_trl's run_child with a token counter that writes its totals at every logged step."""
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("meter"):
        from benchmarks.throughput import run_worker

        return run_worker(spec_path)
    import torch
    from transformers import PreTrainedModel
    from transformers.generation.utils import GenerationMixin

    from benchmarks import vs_trl
    from common.tracking import Tracker

    from common import packing

    counts = {"fed": 0, "real": 0, "room": 0, "depth": 0, "generating": 0}
    pack = packing.pack

    def counted_pack(input_ids, attention_mask, *args, **kwargs):  # packed rows' room: fed, not real
        out = pack(input_ids, attention_mask, *args, **kwargs)
        if not (counts["depth"] or counts["generating"]):
            counts["room"] += out[0].numel() - int(attention_mask.sum())
        return out
    module_call, generate, log = torch.nn.Module.__call__, GenerationMixin.generate, Tracker.log

    def counted_call(model, *args, **kwargs):  # PreTrainedModel only: other modules keep nn.Module.__call__
        if counts["depth"] or counts["generating"]:
            return module_call(model, *args, **kwargs)
        ids, mask = kwargs.get("input_ids", args[0] if args else None), kwargs.get("attention_mask")
        if isinstance(ids, torch.Tensor):
            counts["fed"] += ids.numel()  # a continuation from a prefix cache: its mask covers the prefix too
            counts["real"] += int(mask[:, -ids.shape[1]:].sum()) if mask is not None else ids.numel()
        counts["depth"] += 1
        try:
            return module_call(model, *args, **kwargs)
        finally:
            counts["depth"] -= 1

    def counted_generate(*args, **kwargs):
        counts["generating"] += 1
        try:
            return generate(*args, **kwargs)
        finally:
            counts["generating"] -= 1

    def log_counts(tracker, metrics, step):
        gpu = {"gpu_mib": torch.cuda.max_memory_allocated() / 2**20} if torch.cuda.is_available() else {}
        with open(spec["counts"], "a") as f:
            f.write(json.dumps({"step": step, "fed": counts["fed"], "real": counts["real"] - counts["room"]} | gpu)
                    + "\n")
        return log(tracker, metrics, step)
    PreTrainedModel.__call__, GenerationMixin.generate, Tracker.log = counted_call, counted_generate, log_counts
    packing.pack = counted_pack
    vs_trl.run_child(spec_path)


# ---------------------------------------------------------------------------------------------
# DRIVER
# ---------------------------------------------------------------------------------------------
def script_argv(script: str, args: Args, model_path: str, data_file: str, variant: str, output_dir: str) -> list:
    argv = ["--model_name_or_path", model_path, "--dataset_name", data_file, "--output_dir", output_dir,
            "--run_name", "padding_free", "--seed", str(args.seed), "--max_steps", str(args.steps),
            "--gradient_accumulation_steps", "1", *SHAPES[args.model][script], *NO_EVAL[script],
            *shlex.split(args.extra)]
    if script == "grpo":
        argv += ["--reward_model_paths", "--reward_funcs", "benchmarks.padding_free:length_reward"]
    return argv + (["--padding_free"] if variant == "packed" else [])


def count_window(path: str) -> dict:
    """Token positions fed to the models (outside generate) and the real ones among them, over steps 2..N."""
    with open(path) as f:
        rows = {}
        for line in f:
            row = json.loads(line)
            rows.setdefault(row["step"], row)
    first, last = rows[min(rows)], rows[max(rows)]
    gpu = {"peak_gpu_mib": last["gpu_mib"]} if "gpu_mib" in last else {}  # torch.cuda.max_memory_allocated
    return {k: last[k] - first[k] for k in ("fed", "real")} | {"steps": max(rows) - min(rows)} | gpu


def measure(script: str, args: Args, work: str, model_path: str, data_file: str) -> dict:
    runs = {v: [] for v in VARIANTS}
    folder = os.path.join(work, script)
    os.makedirs(folder, exist_ok=True)
    for run in range(args.runs):
        for variant in VARIANTS:
            out = os.path.join(folder, f"{variant}-{run}")
            spec = {"side": "ours", "variant": variant, "script": script, "threads": args.threads,
                    "steps": args.steps, "argv": script_argv(script, args, model_path, data_file, variant, out),
                    "counts": out + ".counts.jsonl"}
            print(f"{script}: run {run + 1}/{args.runs}, {variant}", flush=True)
            rss = spawn(spec, out + ".spec.json", args.timeout, child="benchmarks.padding_free")
            times = step_times(os.path.join(out, "logs", "padding_free.jsonl"))
            tokens = count_window(spec["counts"])
            runs[variant].append({"seconds_per_step": seconds_per_update(times), "window_seconds": times[-1] - times[0],
                                  "peak_rss_mib": rss, "clock": times, **tokens,
                                  "pad_share": 1 - tokens["real"] / tokens["fed"]})
    result = {"step": STEP[script], "shapes": SHAPES[args.model][script],
              "command": f"python algos/{script}.py " + shell(script_argv(
                  script, args, model_path, data_file, "packed", os.path.join(folder, "packed-0"))).replace(
                      work, "<work_dir>").replace(ROOT + os.sep, "").replace(os.path.expanduser("~"), "~"),
              "runs": runs}
    # real tokens: what the padding-free runs feed per step (every row's real tokens, every pass; not the room)
    real_per_step = statistics.median(r["real"] / r["steps"] for r in runs["packed"])
    for variant, rs in runs.items():
        s = statistics.median(r["seconds_per_step"] for r in rs)
        result[variant] = {"seconds_per_step": s, "tokens_per_second": real_per_step / s,
                           "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
                           **({"peak_gpu_mib": statistics.median(r["peak_gpu_mib"] for r in rs)}
                              if "peak_gpu_mib" in rs[0] else {}),
                           "fed_per_step": statistics.median(r["fed"] / r["steps"] for r in rs),
                           "pad_share": statistics.median(r["pad_share"] for r in rs)}
    result["real_tokens_per_step"] = real_per_step
    result["ratio"] = result["padded"]["seconds_per_step"] / result["packed"]["seconds_per_step"]
    if args.profile:
        result["profile"] = {}
        for variant in VARIANTS:
            out = os.path.join(folder, f"profile-{variant}")
            spec = {"meter": True, "algo": script, "side": "ours", "script": script, "threads": args.threads,
                    "warmup_steps": 1, "steps": args.steps - 1,
                    "argv": script_argv(script, args, model_path, data_file, variant, out)}
            print(f"{script}: profile, {variant}", flush=True)
            spawn(spec, out + ".spec.json", args.timeout, child="benchmarks.padding_free")
            with open(out + ".spec.json.result") as f:
                measured = json.load(f)
            share = summarize(measured)["share"]
            result["profile"][variant] = {
                "seconds_per_step": statistics.median(measured["step_seconds"]), "share": share,
                "outside": 1 - share["forward"] - share["backward"] - share["generate"],
                "calls": measured["calls"]}
    return result


def fastest_step(runs: list[dict]) -> float:
    """The shortest of steps 2..N over all runs: on a shared machine, the nearest to an uncontended step."""
    return min(b - a for r in runs for a, b in zip(r["clock"], r["clock"][1:]))


def table(results: dict, markdown: bool = False) -> str:
    head = ["script", "step", "padded s/step", "packed s/step", "padded/packed", "fastest padded / packed",
            "tokens/s padded", "tokens/s packed", "RSS padded (MiB)", "RSS packed (MiB)", "pad share (padded)"]
    lines = [[script, r["step"], f"{r['padded']['seconds_per_step']:.3f}", f"{r['packed']['seconds_per_step']:.3f}",
              f"{r['ratio']:.2f}x", " / ".join(f"{fastest_step(r['runs'][v]):.2f}" for v in VARIANTS),
              f"{r['padded']['tokens_per_second']:,.0f}",
              f"{r['packed']['tokens_per_second']:,.0f}", f"{r['padded']['peak_rss_mib']:,.0f}",
              f"{r['packed']['peak_rss_mib']:,.0f}", f"{100 * r['padded']['pad_share']:.1f}%"]
             for script, r in results.items()]
    if all("peak_gpu_mib" in r["padded"] for r in results.values()):
        head += ["GPU peak padded (MiB)", "GPU peak packed (MiB)"]
        for line, r in zip(lines, results.values()):
            line += [f"{r[v]['peak_gpu_mib']:,.0f}" for v in VARIANTS]
    return format_table(head, lines, markdown)


def profile_table(results: dict, markdown: bool = False) -> str:
    head = ["script", "variant", "s/step", "forward", "backward", "generate", "optimizer", "other",
            "outside fwd/bwd/gen"]
    lines = [[script, variant, f"{p['seconds_per_step']:.3f}"]
             + [f"{100 * p['share'][k]:.1f}%" for k in ("forward", "backward", "generate", "optimizer", "other")]
             + [f"{100 * p['outside']:.1f}%"]
             for script, r in results.items() if "profile" in r for variant, p in r["profile"].items()]
    return format_table(head, lines, markdown)


def markdown(report: dict) -> str:
    out = ["# Padded vs padding-free (--padding_free)", "",
           "Written by `benchmarks/padding_free.py` (its docstring has the method). s/step: median seconds of one "
           "optimizer step over steps 2..N of a run, then the median over runs; padded/packed > 1: padding-free is "
           "faster. fastest: the shortest single step (2..N, all runs), the nearest to an uncontended step on a "
           "shared machine. tokens/s: the real tokens fed per step (every pass, as the padding-free run feeds them) "
           "over s/step. RSS: peak resident memory of the process. Pad share: padding among the token positions the "
           "padded run feeds to the models outside generation.", ""]
    for key, section in report.items():
        m = section["machine"]
        out += [f"## {key}", "", f"- date: {section['date']}",
                f"- machine: {m['cpu']}, nproc {m['nproc']} (of {m['cpu_count']}), torch threads "
                f"{section['args']['threads']}" + (f"; GPU {section['gpu']}" if section.get("gpu") else ""),
                "- versions: " + ", ".join(f"{k} {v}" for k, v in section["versions"].items() if v),
                f"- command: `{section['command']}`", f"- model: {section['model_path']}",
                "- data: token lengths log-uniform, prompts " + ", ".join(
                    f"{s} {lo}-{hi}" for s, (lo, hi) in PROMPT_TOKENS.items()) + f", completions {COMPLETION_TOKENS[0]}"
                f"-{COMPLETION_TOKENS[1]} (grpo: sampled)"] + (
                    [f"- note: {section['note']}"] if section["note"] else []) + [
                "", table(section["results"], markdown=True), ""]
        for script, r in section["results"].items():
            per = "; ".join(f"{v} " + ", ".join(f"{x['seconds_per_step']:.3f}" for x in r["runs"][v]) for v in VARIANTS)
            out += [f"- {script}: per run s/step {per}; positions fed per step padded "
                    f"{r['padded']['fed_per_step']:,.0f}, packed {r['packed']['fed_per_step']:,.0f}. "
                    f"`{r['command']}` (padded: without --padding_free)"]
        if any("profile" in r for r in section["results"].values()):
            out += ["", "Share of a step's wall time (one Meter-profiled run per variant, steps 2..N): forward "
                    "(outermost module calls, no-grad log-prob passes included), backward, generate, optimizer "
                    "(step, zero_grad, clipping), other (collation, tokenizing, rewards, loss math, logging, "
                    "Python).", "", profile_table(section["results"], markdown=True)]
        out.append("")
    return "\n".join(out)


def main(args: Args) -> dict:
    if args.quick:
        args.model, args.scripts, args.runs, args.steps, args.profile = "tiny", ["sft", "dpo"], 1, 3, False
        args.rows = 64
    args.steps = args.steps or {"tiny": 6, "smollm2": 4}[args.model]
    if args.steps < 3 or args.runs < 1:
        raise SystemExit("error: --steps must be >= 3 (a median over steps 2..N) and --runs >= 1")
    if args.model_path:
        model_path = os.path.abspath(args.model_path)
    elif args.model == "smollm2":
        from benchmarks import smollm2

        model_path = smollm2.build()
    else:
        tiny_tldr.build()
        model_path = tiny_tldr.TINY_MODEL
    work = args.work_dir or tempfile.mkdtemp(prefix="padding_free-")
    os.makedirs(work, exist_ok=True)
    import torch

    results = {}
    try:
        data = data_files(work, model_path, args.rows, args.seed)
        for script in args.scripts:
            results[script] = measure(script, args, work, model_path, data[script])
    finally:
        if args.work_dir is None:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    section = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "machine": machine(), "versions": versions(), "torch_default_threads": torch.get_num_threads(),
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "note": args.note, "command": shlex.join(["python", "benchmarks/padding_free.py", *sys.argv[1:]]),
               "model_path": os.path.relpath(model_path, ROOT) if model_path.startswith(ROOT)
               else model_path.replace(os.path.expanduser("~"), "~"), "args": dataclasses.asdict(args),
               "results": results}
    print(f"{section['machine']['cpu']}, nproc {section['machine']['nproc']}, torch threads {args.threads}")
    print(table(results))
    if args.profile:
        print(profile_table(results))
    if args.results_dir:
        path, report = os.path.join(args.results_dir, "padding_free.json"), {}
        if os.path.exists(path):
            with open(path) as f:
                report = json.load(f)
        key = "quick" if args.quick else f"--model {args.model}" + (f" ({section['gpu']})" if section["gpu"] else "")
        report[key] = section
        os.makedirs(args.results_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.results_dir, "padding_free.md"), "w") as f:
            f.write(markdown(report))
        print(f"wrote {path} and padding_free.md")
    return section


if __name__ == "__main__":
    main(tyro.cli(Args))
