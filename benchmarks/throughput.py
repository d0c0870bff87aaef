"""Training throughput of the eight scripts: steps/s, tokens/s, peak memory, and where a step's time goes.

Each script runs on the tiny model with fixed shapes (the batch sizes and lengths in SHAPES, passed
explicitly so that a change of a script's defaults does not move the numbers), with evaluations,
sample tables switched off, in its own fresh Python process (so that
peak memory belongs to that script alone). The clock starts when the last warm-up step logs and
stops when the last measured step logs, so model loading, the warm-up and saving are never timed;
the worker then stops the script (nothing after the last step runs).

The scripts are not edited: the worker wraps, from the outside, the outermost `torch.nn.Module`
call (nested module calls are part of it and never counted twice), `Accelerator.backward`,
`GenerationMixin.generate` (model calls inside it count as generate), the optimizer
(`AcceleratedOptimizer.step` / `zero_grad`, `Accelerator.clip_grad_norm_`), and reads the step
boundaries from `Tracker.log` (common/tracking.py), called once at the end of every logged step. On
CUDA the device is synchronised before every clock reading. Whatever is left of a step is "other":
data collation, tokenizing and decoding text, reward bookkeeping, loss and advantage math outside
the model, logging, Python (and sampling with vLLM, --use_vllm, which is not wrapped).

A step is one logged step of the script: one optimizer step for sft, reward, dpo, kto, grpo and
online_dpo; one rollout with its optimizer steps (epochs x mini-batches) for rloo and ppo.

    python benchmarks/throughput.py                         # all eight; writes benchmarks/results/throughput.json
    python benchmarks/throughput.py --algos grpo ppo --markdown
    python benchmarks/throughput.py --algos ppo --profile_dir /tmp/prof   # + cProfile of the measured steps
"""

import datetime
import functools
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import tyro

from benchmarks import tiny_tldr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGOS = ("sft", "reward", "dpo", "kto", "grpo", "rloo", "online_dpo", "ppo")
KINDS = ("forward", "backward", "generate", "optimizer")  # timed regions; the rest of a step is "other"

# fixed shapes per script (the tiny chain's defaults, spelled out) and what one step holds
SHAPES = {
    "sft": (["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1", "--max_length", "512"],
            "16 sequences"),
    "reward": (["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1", "--max_length", "512"],
               "16 pairs"),
    "dpo": (["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1", "--max_length", "512",
             "--max_prompt_length", "384", "--max_completion_length", "128"], "16 pairs + reference"),
    "kto": (["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1", "--max_length", "512",
             "--max_prompt_length", "384", "--max_completion_length", "128"], "16 rows + KL rows + reference"),
    "grpo": (["--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "1", "--num_generations", "8",
              "--max_prompt_length", "512", "--max_completion_length", "48", "--num_iterations", "1"],
             "4 prompts x 8 samples of 48 tokens"),
    "rloo": (["--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "1", "--rloo_k", "4",
              "--max_prompt_length", "512", "--max_completion_length", "48", "--num_ppo_epochs", "2",
              "--num_mini_batches", "1"], "8 prompts x 4 samples of 48 tokens, 2 epochs"),
    "online_dpo": (["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1", "--max_length", "512",
                    "--max_new_tokens", "48"], "16 prompts x 2 samples of 48 tokens"),
    "ppo": (["--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "1", "--max_prompt_length", "512",
             "--response_length", "48", "--num_ppo_epochs", "4", "--num_mini_batches", "1",
             "--local_rollout_forward_batch_size", "64"], "32 samples of 48 tokens, 4 epochs"),
}
# everything that is not a training step: evaluations and sample tables
NO_EVAL = {"sft": ["--dataset_test_split", ""],
           "reward": ["--dataset_test_split", ""],
           "dpo": ["--dataset_test_split", ""],
           "kto": ["--dataset_test_split", ""]}
for _name in ("grpo", "rloo", "online_dpo", "ppo"):
    NO_EVAL[_name] = ["--eval_steps", str(10**9), "--num_sample_generations", "0"]


@dataclass
class Args:
    algos: list[Literal["sft", "reward", "dpo", "kto", "grpo", "rloo", "online_dpo", "ppo"]] = field(
        default_factory=lambda: list(ALGOS))
    """scripts to measure, each in its own process"""
    warmup_steps: int = 1
    """logged steps run before the clock starts (>= 1: the clock starts when the last of them logs)"""
    steps: int = 5
    """logged steps measured after the warm-up"""
    sft_model_path: str | None = None
    """SFT model the other scripts start from (default: trained here for chain_steps steps)"""
    reward_model_path: str | None = None
    """reward model of grpo / rloo / online_dpo / ppo (default: trained here for chain_steps steps)"""
    chain_steps: int = 50
    """optimizer steps of sft.py and reward.py when the two models are built here"""
    script_args: list[str] = field(default_factory=list)
    """extra flags given to every script (e.g. --bf16 on a GPU)"""
    threads: int = 1
    """torch CPU threads in each worker (0: torch's default); the tiny model's small matrices gain little
    from more, and one thread keeps timings steadier on a shared CPU"""
    work_dir: str | None = None
    """where built models and the scripts' outputs go (default: a temporary directory, removed at the end)"""
    output_json: str = os.path.join(ROOT, "benchmarks", "results", "throughput.json")
    """results file ('' writes none)"""
    markdown: bool = False
    """also print the table as markdown"""
    profile_dir: str | None = None
    """write a cProfile of each script's measured steps here (<algo>.prof, <algo>.txt); slows the steps down"""
    timeout: int = 1800
    """seconds a worker may take before it is stopped"""


# ---------------------------------------------------------------------------------------------
# INSTRUMENTATION (runs inside the worker process)
# ---------------------------------------------------------------------------------------------
class StopRun(BaseException):
    """Raised from Tracker.log after the last measured step: nothing after it (saving, evaluation) runs.
    A BaseException, so that a script's `except Exception` cannot swallow it."""


def _num_tokens(args, kwargs) -> int:
    """Token positions in the input of a model call: input_ids (keyword or first argument) or inputs_embeds."""
    import torch

    ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    if ids is not None:
        return ids.numel()
    embeds = kwargs.get("inputs_embeds")
    return embeds.shape[0] * embeds.shape[1] if embeds is not None else 0


class Meter:
    """Wall time of the outermost call of each kind (forward, backward, generate, optimizer) while `on`,
    the model time spent inside generate, and the token positions fed to the models.

    Only the outermost instrumented call is timed: a module called inside another module, inside
    generate, backward (activation recomputation) or the optimizer is part of that call's time. Tokens
    are counted at every `PreTrainedModel` call not nested in another one (policy, reference, reward
    and value models; each prefill and decoding step of generate), split by whether it ran in generate."""

    def __init__(self):
        import torch

        self.sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.generate_model_seconds = 0.0  # outermost module calls inside generate (decoding's model time)
        self.tokens = {"forward": 0, "generate": 0}
        self.calls = dict.fromkeys(KINDS, 0)
        self.on = False
        self.active = None  # the kind of the outermost instrumented call under way
        self.in_module = False  # a module call is under way (its nested module calls are not timed)
        self.in_model = False  # a PreTrainedModel call is under way (its inner models are not counted)
        self._undo = []

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def _timed(self, kind, fn):
        meter = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not meter.on or meter.active is not None:
                return fn(*args, **kwargs)
            start, meter.active = meter.now(), kind
            try:
                return fn(*args, **kwargs)
            finally:
                meter.seconds[kind] += meter.now() - start
                meter.calls[kind] += 1
                meter.active = None
        return wrapper

    def _module_call(self, call):
        from transformers import PreTrainedModel

        meter = self

        @functools.wraps(call)
        def wrapper(module, *args, **kwargs):
            if not meter.on:
                return call(module, *args, **kwargs)
            is_model = not meter.in_model and isinstance(module, PreTrainedModel)
            if is_model:
                meter.tokens["generate" if meter.active == "generate" else "forward"] += _num_tokens(args, kwargs)
                meter.in_model = True
            outermost = not meter.in_module
            meter.in_module = True
            # time the outermost module call: as forward, or as generate's model time inside generate
            kind = ("forward" if meter.active is None else "generate_model" if meter.active == "generate"
                    else None) if outermost else None
            if kind == "forward":
                meter.active = "forward"
            start = meter.now() if kind else 0.0
            try:
                return call(module, *args, **kwargs)
            finally:
                if kind == "forward":
                    meter.seconds["forward"] += meter.now() - start
                    meter.calls["forward"] += 1
                    meter.active = None
                elif kind:
                    meter.generate_model_seconds += meter.now() - start
                if outermost:
                    meter.in_module = False
                if is_model:
                    meter.in_model = False
        return wrapper

    def _patch(self, owner, name, wrapper):
        original = owner.__dict__[name]
        setattr(owner, name, wrapper(original))
        self._undo.append((owner, name, original))

    def install(self):
        import torch
        from accelerate import Accelerator
        from accelerate.optimizer import AcceleratedOptimizer
        from transformers.generation.utils import GenerationMixin

        self._patch(torch.nn.Module, "__call__", self._module_call)
        self._patch(Accelerator, "backward", functools.partial(self._timed, "backward"))
        self._patch(GenerationMixin, "generate", functools.partial(self._timed, "generate"))
        for owner, name in ((AcceleratedOptimizer, "step"), (AcceleratedOptimizer, "zero_grad"),
                            (Accelerator, "clip_grad_norm_")):
            self._patch(owner, name, functools.partial(self._timed, "optimizer"))
        return self

    def uninstall(self):
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()


def peak_memory_mib() -> tuple[float, str]:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20, "torch.cuda.max_memory_allocated"
    return max_rss_mib(), "peak RSS of the process"


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


def run_worker(spec_path: str):
    """Run one script in this process with the instrumentation on; write its measurements beside `spec_path`."""
    with open(spec_path) as f:
        spec = json.load(f)
    import importlib

    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    from common.tracking import Tracker

    module = importlib.import_module(f"algos.{spec['algo']}")
    script_args = tyro.cli(module.Args, args=spec["argv"])
    rss_after_imports = max_rss_mib()
    meter = Meter()
    warmup, last = spec["warmup_steps"], spec["warmup_steps"] + spec["steps"]
    state = {"seen": 0, "start": None, "prev": None, "step_seconds": []}
    profiler = None
    if spec.get("profile"):
        import cProfile

        profiler = cProfile.Profile()

    def boundary(log):
        @functools.wraps(log)
        def wrapper(tracker, metrics, step):
            if step <= state["seen"]:  # a second record for the same step (none with evaluations off)
                return log(tracker, metrics, step)
            state["seen"] = step
            t = meter.now()
            if step == warmup:
                state["start"] = state["prev"] = t
                meter.on = True
                if profiler:
                    profiler.enable()
            elif warmup < step <= last:
                state["step_seconds"].append(t - state["prev"])
                state["prev"] = t
                if step == last:
                    meter.on = False
                    if profiler:
                        profiler.disable()
                    raise StopRun
            return log(tracker, metrics, step)
        return wrapper

    meter._patch(Tracker, "log", boundary)
    with meter:
        try:
            module.main(script_args)
        except StopRun:
            pass
    if len(state["step_seconds"]) != spec["steps"]:
        raise RuntimeError(f"{spec['algo']}: measured {len(state['step_seconds'])} of {spec['steps']} steps "
                           "(does the script log every step through Tracker.log?)")
    memory, memory_kind = peak_memory_mib()
    result = {"algo": spec["algo"], "steps": spec["steps"], "window_seconds": state["prev"] - state["start"],
              "step_seconds": state["step_seconds"], "seconds": dict(meter.seconds),
              "generate_model_seconds": meter.generate_model_seconds, "tokens": dict(meter.tokens),
              "calls": dict(meter.calls), "peak_memory_mib": memory, "memory_kind": memory_kind,
              "rss_after_imports_mib": rss_after_imports, "torch_threads": torch.get_num_threads(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"}
    if profiler:
        import io
        import pstats

        os.makedirs(spec["profile"], exist_ok=True)
        profiler.dump_stats(os.path.join(spec["profile"], f"{spec['algo']}.prof"))
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).strip_dirs()
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(60)
        with open(os.path.join(spec["profile"], f"{spec['algo']}.txt"), "w") as f:
            f.write(text.getvalue())
    with open(spec_path + ".result", "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------------
# DRIVER: build the chain's starting models, one worker per script, the table
# ---------------------------------------------------------------------------------------------
def python(argv: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"python {' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    return proc


def shell(argv: list[str]) -> str:
    return " ".join(a if a else '""' for a in argv)


def build(output_dir: str, argv: list[str], args: Args) -> str:
    """A starting model of the chain, trained for chain_steps steps (kept from an earlier run in the same work_dir)."""
    if os.path.isfile(os.path.join(output_dir, "config.json")):
        print(f"reusing {output_dir}", flush=True)
        return output_dir
    print(f"building {output_dir} ({args.chain_steps} steps): python {shell(argv)}", flush=True)
    python(argv + ["--max_steps", str(args.chain_steps), "--output_dir", output_dir], args.timeout)
    return output_dir


def script_argv(algo: str, args: Args, sft: str | None, reward: str | None, output_dir: str) -> list[str]:
    argv = ["--seed", "1", "--output_dir", output_dir, "--run_name", f"throughput_{algo}",
            "--max_steps", str(args.warmup_steps + args.steps), *SHAPES[algo][0], *NO_EVAL[algo]]
    if algo != "sft":
        argv += ["--model_name_or_path", sft]
    if algo in ("grpo", "rloo", "online_dpo"):
        argv += ["--reward_model_paths", reward]
    elif algo == "ppo":
        argv += ["--reward_model_path", reward]
    return argv + list(args.script_args)


def summarize(result: dict) -> dict:
    """Rates and shares of one worker's measurements (shares of the measured step time, summing to 1)."""
    total = result["window_seconds"]
    seconds = dict(result["seconds"], other=total - sum(result["seconds"].values()))
    tokens = sum(result["tokens"].values())
    return {"steps_per_second": result["steps"] / total, "seconds_per_step": total / result["steps"],
            "tokens_per_second": tokens / total, "tokens_per_step": tokens / result["steps"],
            "share": {k: v / total for k, v in seconds.items()},
            "generate_model_share": result["generate_model_seconds"] / total}


def table(rows: dict, markdown: bool) -> str:
    head = ["script", "step", "steps/s", "s/step", "tokens/s", "peak mem (MiB)", "forward", "backward", "generate",
            "(its model calls)", "optimizer", "other"]
    lines = []
    for algo, r in rows.items():
        s = r["share"]
        lines.append([algo, SHAPES[algo][1], f"{r['steps_per_second']:.2f}", f"{r['seconds_per_step']:.3f}",
                      f"{r['tokens_per_second']:,.0f}", f"{r['peak_memory_mib']:,.0f}"]
                     + [f"{100 * s[k]:.1f}%" for k in ("forward", "backward", "generate")]
                     + [f"({100 * r['generate_model_share']:.1f}%)"]
                     + [f"{100 * s[k]:.1f}%" for k in ("optimizer", "other")])
    return format_table(head, lines, markdown)


def format_table(head: list[str], lines: list[list[str]], markdown: bool) -> str:
    """Rows of cells as a markdown table, or as aligned text (the first two columns flush left)."""
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(line) + " |" for line in lines])
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    return "\n".join("  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(line, widths)))
                     for line in [head, *lines])


def main(args: Args) -> dict:
    if args.warmup_steps < 1 or args.steps < 1:
        raise SystemExit("error: --warmup_steps and --steps must be >= 1 (the clock starts when the last warm-up "
                         "step logs)")
    tiny_tldr.build()  # the scripts' default data and base model
    work = args.work_dir or tempfile.mkdtemp(prefix="throughput-")
    os.makedirs(work, exist_ok=True)
    try:
        sft, reward = args.sft_model_path, args.reward_model_path
        online = set(args.algos) & {"grpo", "rloo", "online_dpo", "ppo"}
        if sft is None and set(args.algos) - {"sft"}:
            sft = build(os.path.join(work, "chain_sft"), ["algos/sft.py", "--dataset_test_split", ""],
                        args)
        if reward is None and online:
            reward = build(os.path.join(work, "chain_reward"),
                           ["algos/reward.py", "--model_name_or_path", sft, "--dataset_test_split", ""], args)

        rows, commands = {}, {}
        for algo in args.algos:
            output_dir = os.path.join(work, algo)
            shutil.rmtree(output_dir, ignore_errors=True)  # a fresh run: no checkpoint or finished model from before
            argv = script_argv(algo, args, sft, reward, output_dir)
            commands[algo] = f"python algos/{algo}.py {shell(argv)}".replace(work, "<work_dir>")
            spec_path = os.path.join(work, f"{algo}.spec.json")
            with open(spec_path, "w") as f:
                json.dump({"algo": algo, "argv": argv, "warmup_steps": args.warmup_steps, "steps": args.steps,
                           "threads": args.threads, "profile": args.profile_dir}, f)
            print(f"measuring {algo}: {commands[algo]}", flush=True)
            python(["-c", "import sys; from benchmarks.throughput import run_worker; run_worker(sys.argv[1])",
                    spec_path], args.timeout)
            with open(spec_path + ".result") as f:
                result = json.load(f)
            rows[algo] = {**result, **summarize(result), "step": SHAPES[algo][1], "command": commands[algo]}
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)

    import torch

    first = next(iter(rows.values()))
    report = {
        "date": datetime.date.today().isoformat(), "device": first["device"], "cuda": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(), "torch_threads": first["torch_threads"], "torch": torch.__version__,
        "python": platform.python_version(), "args": asdict(args),
        "definitions": {
            "step": "one logged step: one optimizer step (sft, reward, dpo, kto, grpo, online_dpo), one rollout "
                    "with its epochs x mini-batches optimizer steps (rloo, ppo)",
            "tokens": "token positions fed to a model call (policy, reference, reward and value models, with or "
                      "without gradients; generate counts the prompt once and one position per decoding step), "
                      "padding included, not counted again for the backward pass",
            "share": "share of the measured wall time: forward = outermost model calls outside generate, backward = "
                     "Accelerator.backward, generate = GenerationMixin.generate (generate_model_share: its model "
                     "calls), optimizer = optimizer step, zero_grad and gradient clipping, other = the rest",
            "peak_memory_mib": "torch.cuda.max_memory_allocated on CUDA, else the worker process's peak RSS "
                               "(imports, data and models included; rss_after_imports_mib is the part before main)"},
        "results": rows}
    print(table(rows, markdown=False))
    if args.markdown:
        print("\n" + table(rows, markdown=True))
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.output_json}")
    return report


if __name__ == "__main__":
    main(tyro.cli(Args))
