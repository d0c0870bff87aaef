"""Side by side with TRL: each script against TRL's trainer for the same algorithm, on identical settings.

For every script that TRL 1.16 has a trainer for (sft: SFTTrainer, reward: RewardTrainer, dpo: DPOTrainer,
kto: KTOTrainer, grpo: GRPOTrainer, rloo: RLOOTrainer, online_dpo: trl.experimental's OnlineDPOTrainer;
ppo has none in 1.16 and is skipped with that reason), our script and TRL's trainer each run in a fresh
Python process, interleaved (ours, TRL, ours, TRL, ...) so that a machine whose speed drifts slows both
alike. Both sides get the same model folder, the same data file, the same batch sizes, lengths, number
of samples, loss settings, learning rate and schedule (warm-up steps computed once, here), AdamW
(torch.optim.AdamW, not fused, same betas / eps / weight decay), clipping norm, seed, float32, the same
torch threads, no evaluation, no checkpoints and printed logs every `logging_steps`; the online
algorithms score with the same Python reward function. The settings are the scripts' own defaults
(read from their `Args`) with only the number of steps set here; `--model smollm2` scales the shapes
down for a 135M model on a CPU. What cannot be matched is listed in NOT_MATCHED and in the report.

Measured per run: the median seconds of one optimizer update over steps 2..N (step 1 holds the
warm-up: first allocations, lazy imports), from the clock each side records after every step (our
scripts' `time` field in <output_dir>/logs/<run>.jsonl; for TRL a TrainerCallback writing
time.perf_counter() at on_step_end), and the process's peak RSS, read per process with os.wait4. For
rloo, one logged step of ours is a rollout with num_ppo_epochs x num_mini_batches updates: both sides
are timed per rollout and divided by the updates in it.

    pip install 'minimal-post-training[bench]'                  # trl==1.16.0
    python benchmarks/vs_trl.py                                 # tiny task, all scripts, 2 runs of 12 steps
    python benchmarks/vs_trl.py --scripts sft dpo --runs 3 --steps 20
    python benchmarks/vs_trl.py --model smollm2 --runs 2 --steps 4   # every script on SmolLM2-135M-Instruct
    python benchmarks/vs_trl.py --padding_free      # both sides padding-free, where TRL has it (TRL_PADDING_FREE)
    python benchmarks/vs_trl.py --ours_padding_free --scripts kto dpo   # ours padding-free, TRL as it trains

Writes benchmarks/results/vs_trl.json and vs_trl.md (one section per --model, another per --model with
--padding_free or --ours_padding_free; a new run replaces its section, or with --scripts naming some of them, only
their rows, and the section lists the rerun).
The ratio is TRL's seconds per step over ours: above 1, ours is faster.
"""

import dataclasses
import datetime
import importlib
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Literal

import tyro

from benchmarks import tiny_tldr
from common.runtime import flags
from benchmarks.throughput import ALGOS, NO_EVAL, ROOT, StopRun, build, format_table, shell

TRL_VERSION = "1.16.0"  # pinned in pyproject.toml's `bench` extra
# TRL's trainer and config for each script: (module, trainer, config)
TRL_TRAINERS = {
    "sft": ("trl", "SFTTrainer", "SFTConfig"),
    "reward": ("trl", "RewardTrainer", "RewardConfig"),
    "dpo": ("trl", "DPOTrainer", "DPOConfig"),
    "kto": ("trl", "KTOTrainer", "KTOConfig"),
    "grpo": ("trl", "GRPOTrainer", "GRPOConfig"),
    "rloo": ("trl", "RLOOTrainer", "RLOOConfig"),
    "online_dpo": ("trl.experimental.online_dpo", "OnlineDPOTrainer", "OnlineDPOConfig"),
    "ppo": ("trl", "PPOTrainer", "PPOConfig"),  # gone from trl and trl.experimental by 1.16: skipped
}
ONLINE = ("grpo", "rloo", "online_dpo")
# --padding_free: TRL's config fields for it, where TRL 1.16 trains padding-free. SFTTrainer flattens a batch into
# one row with position ids restarting per row (and flash-attention's cu_seq_lens, unused by SDPA); without packing
# it raises unless max_length=None (it would not truncate): the data must fit, as longest_in_tokens shows
TRL_PADDING_FREE = {"sft": {"padding_free": True, "max_length": None}}
NO_TRL_PADDING_FREE = {
    "dpo": "DPOConfig has padding_free, but TRL 1.16's DPOTrainer warns that it is disabled since a refactor and "
           "trains padded",
    **dict.fromkeys(("reward", "kto", "grpo", "rloo", "online_dpo"), "TRL 1.16's config has no padding_free"),
    "ppo": "no PPOTrainer in TRL 1.16"}

# ---------------------------------------------------------------------------------------------
# SETTINGS: one set of numbers per script, given to our script as flags and to TRL as config fields
# ---------------------------------------------------------------------------------------------
COMMON = ("seed", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "weight_decay",
          "lr_scheduler_type", "warmup_ratio", "max_grad_norm", "logging_steps")
SAMPLING = ("max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
SHARED = {
    "sft": ("max_length",),
    "reward": ("max_length",),
    "dpo": ("max_length", "max_prompt_length", "max_completion_length", "loss_type", "beta", "label_smoothing"),
    "kto": ("max_length", "max_prompt_length", "max_completion_length", "loss_type", "beta", "desirable_weight",
            "undesirable_weight"),
    "grpo": ("max_prompt_length", "num_generations", *SAMPLING, "loss_type", "scale_rewards", "beta", "epsilon",
             "num_iterations", "importance_sampling_level", "mask_truncated_completions"),
    "rloo": ("max_prompt_length", "rloo_k", *SAMPLING, "kl_coef", "cliprange", "num_ppo_epochs", "num_mini_batches",
             "normalize_advantages"),
    "online_dpo": ("max_length", "max_new_tokens", "temperature", "loss_type", "beta"),
}
# where TRL names a setting differently (rloo's are the GRPO-shaped RLOOTrainer's)
TRL_NAMES = {"rloo_k": "num_generations", "kl_coef": "beta", "cliprange": "epsilon", "num_ppo_epochs": "num_iterations",
             "num_mini_batches": "steps_per_generation", "warmup_ratio": "warmup_steps"}
# settings TRL 1.16 has no field for, per script: ours get them, and the report says whether they bind
NOT_IN_TRL = {"grpo": ("max_prompt_length",), "rloo": ("max_prompt_length",),
              "dpo": ("max_prompt_length", "max_completion_length"),
              "kto": ("max_prompt_length", "max_completion_length")}
# torch.optim.AdamW's defaults, which the scripts use (weight decay is a setting); TRL gets them spelled out
ADAMW = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8}
# TRL config fields that make it do what our scripts do (TRL's own defaults differ)
TRL_FIXED = {
    "bf16": False,  # TRL's configs default to bf16 (on a CPU too); the scripts train in float32
    "activation_checkpointing": False,  # TRL's default (as gradient_checkpointing, its old name) is on; ours is off
    "optim": "adamw_torch",  # torch.optim.AdamW; transformers' default is the fused variant
    **ADAMW,
    "eval_strategy": "no", "save_strategy": "no", "report_to": "none",
    "dataloader_num_workers": 0,
}
# shapes for SmolLM2-135M on a CPU: a step of a few seconds (the rest stays at the scripts' defaults)
SMOLLM2_SHAPES = {
    "sft": {"per_device_train_batch_size": 4, "max_length": 256},
    "reward": {"per_device_train_batch_size": 2, "max_length": 256},
    "dpo": {"per_device_train_batch_size": 2, "max_length": 256, "max_prompt_length": 192, "max_completion_length": 64},
    "kto": {"per_device_train_batch_size": 2, "max_length": 256, "max_prompt_length": 192, "max_completion_length": 64},
    "grpo": {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 32,
             "max_prompt_length": 256},
    "rloo": {"per_device_train_batch_size": 4, "rloo_k": 4, "max_completion_length": 32, "max_prompt_length": 256},
    "online_dpo": {"per_device_train_batch_size": 2, "max_new_tokens": 32, "max_length": 256},
}
MODELS = {"tiny": ALGOS, "smollm2": (*SMOLLM2_SHAPES, "ppo")}  # ppo: skipped, with the reason, where TRL has none

NOT_MATCHED = [
    "Sampling RNG: our scripts draw each completion with its own seeded torch.Generator (common/generation.py, "
    "SeededSampler); TRL samples from torch's global generator. The completions, and so their lengths and the "
    "cost of the steps after sampling, differ between the sides.",
    "Data order: ours shuffles with random.Random(seed); TRL's dataloader uses its own sampler (RandomSampler, "
    "GRPO/RLOO's RepeatSampler; KTO's default is sequential, which its KL estimate needs). Different rows per "
    "batch mean different padded lengths per step.",
    "Data pipeline: ours tokenizes into Python lists and pads each batch itself; TRL tokenizes with datasets.map and "
    "collates through a torch DataLoader wrapped by accelerate. Both pad to the longest row of a batch.",
    "Truncation: TRL 1.16 has no max_prompt_length (GRPO, RLOO, DPO, KTO) and no max_completion_length for DPO/KTO, "
    "only max_length; the report gives the longest prompt / completion in tokens to show they do not bind.",
    "Models that are only evaluated: ours loads the reference from disk; TRL builds it from the policy's path "
    "(same weights). Reward heads (reward) start from random values on both sides, not the same ones.",
    "Conversational data (--model smollm2): TRL keeps what the chat template writes after the completion's "
    "<|im_end|> (a newline: one token more per sequence); ours ends each completion at its EOS.",
    "Dropout: TRL turns dropout off for DPO, KTO, reward and online DPO; the tiny model and SmolLM2 have none.",
    "RLOO: TRL 1.16's RLOOTrainer is GRPO-shaped (num_iterations passes over a generation batch of "
    "steps_per_generation micro-batches); ours is the PPO-style loop (num_ppo_epochs x num_mini_batches). With one "
    "mini-batch both do num_ppo_epochs updates per rollout of the same size, with the KL to the reference in the "
    "reward per sequence and the same clipped ratio.",
    "Per-step work besides the algorithm: each side computes and logs its own metrics (TRL aggregates more, e.g. "
    "reward std per function, clip ratios); ours writes one JSONL line per step. Both print every logging_steps.",
    "Peak RSS is the whole process: Python, imports (TRL imports more), data, models, optimizer state.",
]

OURS_PADDING_FREE_NOT_MATCHED = [
    "Ours padding-free (--padding_free), TRL padded, as it trains by default: TRL 1.16 has no padding-free for these "
    "trainers, so this is the comparison a user of each meets, not the same computation.",
]
PADDING_FREE_NOT_MATCHED = [
    "Padding-free (--padding_free): both sides pack a micro-batch's rows with position ids restarting per row and "
    "no attention mask (TRL into one row; ours, with SDPA, into packed rows no longer than the longest row); "
    "transformers builds the block-diagonal mask from those position ids on both sides. TRL's collator also passes "
    "cu_seq_lens / max_length (for "
    "flash-attention's variable-length kernels; SDPA ignores them) and takes max_length=None (it refuses "
    "padding_free with a max_length it would not enforce): ours keeps --max_length, which the data does not reach "
    "(longest in tokens).",
]


@dataclass
class Args:
    scripts: list[Literal["sft", "reward", "dpo", "kto", "grpo", "rloo", "online_dpo", "ppo"]] | None = None
    """scripts to compare (default: every one)"""
    model: Literal["tiny", "smollm2"] = "tiny"
    """tiny: the tiny TL;DR task (the SFT policy the scripts make); smollm2: SmolLM2-135M-Instruct on conversational
    prompts"""
    runs: int = 2
    """runs per side, interleaved: ours, TRL, ours, TRL, ..."""
    steps: int = 12
    """logged steps per run (rollouts for rloo); the median is taken over steps 2..N"""
    threads: int = 2
    """torch CPU threads in every process"""
    sft_model_path: str | None = None
    """tiny: the SFT policy the other scripts start from (default: trained here for chain_steps steps)"""
    chain_steps: int = 50
    """optimizer steps of sft.py when the SFT policy is built here"""
    work_dir: str | None = None
    """where built models, data files and the runs' outputs go (default: a temporary directory, removed at the end)"""
    results_dir: str = os.path.join(ROOT, "benchmarks", "results")
    """vs_trl.json and vs_trl.md are written here ('' writes none)"""
    note: str = ""
    """a line for the report (e.g. 'busy shared machine')"""
    timeout: int = 1800
    """seconds one process may take before it is stopped"""
    padding_free: bool = False
    """both sides padding-free (ours --padding_free, TRL padding_free=True: TRL_PADDING_FREE), for the scripts where
    TRL has it; its own section '<model> --padding_free' in the results"""
    ours_padding_free: bool = False
    """ours --padding_free, TRL as it trains by default (for the trainers where TRL has no padding-free: what a user
    of each meets); its own section '<model> --ours_padding_free'"""


def script_defaults(script: str) -> dict:
    """The defaults of algos/<script>.py's Args, by field name."""
    return flags(importlib.import_module(f"algos.{script}").Args())  # the groups' flags too


def settings_for(script: str, model: str) -> dict:
    """The shared settings of one pair: the script's defaults, with SmolLM2's smaller shapes where asked."""
    defaults = script_defaults(script)
    values = {name: defaults[name] for name in COMMON + SHARED[script]}
    if model == "smollm2":
        values.update(SMOLLM2_SHAPES[script])
    return values


def updates_per_step(script: str, settings: dict) -> int:
    """Optimizer updates in one logged step of our script: a rollout's epochs x mini-batches for rloo."""
    return settings["num_ppo_epochs"] * settings["num_mini_batches"] if script == "rloo" else 1


def our_flags(settings: dict) -> list[str]:
    """The settings as flags of our scripts."""
    argv = []
    for name, value in settings.items():
        if isinstance(value, bool):
            argv.append(f"--{name}" if value else f"--no-{name}")
        elif isinstance(value, (list, tuple)):
            argv += [f"--{name}", *map(str, value)]
        else:
            argv += [f"--{name}", str(value)]
    return argv


def trl_config(settings: dict, script: str, steps: int) -> dict:
    """The settings as TRL config fields, for `steps` logged steps of ours (rloo: steps x updates per rollout)."""
    total = steps * updates_per_step(script, settings)
    config = {"max_steps": total, **TRL_FIXED}
    for name, value in settings.items():
        if name in NOT_IN_TRL.get(script, ()):
            continue
        if name == "warmup_ratio":  # as the scripts count them; TRL reads an integer >= 1 as a number of steps
            value = math.ceil(value * total)
        elif name == "num_mini_batches":  # a generation batch of this many optimizer steps' micro-batches
            value = settings["gradient_accumulation_steps"] * value
        elif name == "min_p" and value == 0.0:
            value = None  # TRL's "off"
        elif name == "loss_type" and script == "dpo":
            value = [value]  # TRL's DPO takes a list of losses
        config[TRL_NAMES.get(name, name)] = value
    return config


# ---------------------------------------------------------------------------------------------
# DATA AND MODELS: the same files for both sides
# ---------------------------------------------------------------------------------------------
def gold_reward(prompts, completions, **kwargs) -> list[float]:
    """The tiny task's gold judge as a reward function for both sides, for plain or conversational rows
    (the text of the last message). Called by keyword, as TRL and our scripts both do."""
    def text(x):
        return x[-1]["content"] if isinstance(x, list) else x
    return [tiny_tldr.gold_score(text(p), text(c)) for p, c in zip(prompts, completions)]


def _write_jsonl(path: str, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def post_body(prompt: str) -> str:
    """The post of a tiny TL;DR prompt, without the subreddit, title and TL;DR cue."""
    return prompt.split("POST:", 1)[-1].split("TL;DR:", 1)[0].strip()


def data_files(work: str, model: str) -> dict:
    """Training data per script (a .jsonl file both sides read). Tiny: the task's own files (prompts only
    for the online scripts). SmolLM2: the same posts as one-turn conversations asking for a summary."""
    tiny_tldr.build()
    sft_dir, pref_dir = tiny_tldr.TINY_SFT_DATA, tiny_tldr.TINY_PREFERENCE_DATA
    sft, pref = os.path.join(sft_dir, "train.jsonl"), os.path.join(pref_dir, "train.jsonl")
    os.makedirs(work, exist_ok=True)
    if model == "tiny":
        prompts = _write_jsonl(os.path.join(work, "prompts.jsonl"), ({"prompt": r["prompt"]} for r in _read_jsonl(sft)))
        return {"sft": sft, "reward": pref, "dpo": pref, "kto": pref, **dict.fromkeys(ONLINE, prompts)}

    def ask(prompt):
        return [{"role": "user", "content": f"Summarize in one sentence: {post_body(prompt)}"}]
    pairs = _write_jsonl(os.path.join(work, "chat_preference.jsonl"), (
        {"prompt": ask(r["prompt"]), "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
         "rejected": [{"role": "assistant", "content": r["rejected"].strip()}]} for r in _read_jsonl(pref)))
    rows = _read_jsonl(sft)
    prompts = _write_jsonl(os.path.join(work, "chat_prompts.jsonl"), ({"prompt": ask(r["prompt"])} for r in rows))
    completions = _write_jsonl(os.path.join(work, "chat_sft.jsonl"), (
        {"prompt": ask(r["prompt"]), "completion": [{"role": "assistant", "content": r["completion"].strip()}]}
        for r in rows))
    return {"sft": completions, "reward": pairs, "dpo": pairs, "kto": pairs, **dict.fromkeys(ONLINE, prompts)}


def longest_in_tokens(model_path: str, data_file: str) -> dict:
    """Longest prompt and completion (chosen / rejected / completion) of a data file in tokens, as our
    scripts encode them: shows whether a length limit that only one side has binds."""
    from common.data import encode_completion, encode_prompt
    from common.models import load_tokenizer

    tokenizer, longest = load_tokenizer(model_path), {}
    for row in _read_jsonl(data_file):
        longest["prompt"] = max(longest.get("prompt", 0), len(encode_prompt(tokenizer, row["prompt"])))
        for key in ("completion", "chosen", "rejected"):
            if key in row:
                n = len(encode_completion(tokenizer, row["prompt"], row[key]))
                longest["completion"] = max(longest.get("completion", 0), n)
    return longest


def starting_models(args: Args, work: str, scripts: list[str]) -> dict:
    """Model folder per script: tiny: the base model for sft, the SFT policy for the rest; smollm2: the model."""
    if args.model == "smollm2":
        from benchmarks import smollm2

        return dict.fromkeys(ALGOS, smollm2.build())
    sft = args.sft_model_path
    if sft is None and set(scripts) - {"sft"}:
        sft = build(os.path.join(work, "chain_sft"), ["algos/sft.py", *NO_EVAL["sft"]], args)
    return {s: tiny_tldr.TINY_MODEL if s == "sft" else sft for s in ALGOS}


# ---------------------------------------------------------------------------------------------
# CHILD PROCESSES: one script or one TRL trainer, nothing else
# ---------------------------------------------------------------------------------------------
def run_child(spec_path: str):
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    torch.set_num_threads(spec["threads"])
    (run_ours if spec["side"] == "ours" else run_trl)(spec)


def run_ours(spec: dict):
    """algos/<script>.py's main, stopped right after its last step logs (no saving, as on TRL's side)."""
    from common.tracking import Tracker

    module = importlib.import_module(f"algos.{spec['script']}")
    script_args = tyro.cli(module.Args, args=spec["argv"])
    log = Tracker.log

    def log_then_stop(tracker, metrics, step):
        log(tracker, metrics, step)
        if step >= spec["steps"]:
            raise StopRun
    Tracker.log = log_then_stop
    try:
        module.main(script_args)
    except StopRun:
        pass
    if "trl" in sys.modules:  # the scripts must stand on their own
        raise RuntimeError(f"algos/{spec['script']}.py or common/ imported trl")


def run_trl(spec: dict):
    """TRL's trainer on the same model folder and data file, with a callback that records the clock."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    module_name, trainer_name, config_name = TRL_TRAINERS[spec["script"]]
    module = importlib.import_module(module_name)
    clock_path = spec["clock"]

    class StepClock(TrainerCallback):
        """One JSONL line per optimizer step, with the seconds since training began (as our `time` field)."""

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.start = time.perf_counter()
            # what TRL really runs with, for the report: the settings above took effect
            with open(clock_path + ".facts.json", "w") as f:
                json.dump({"dtype": str(model.dtype), "activation_checkpointing": model.is_activation_checkpointing,
                           "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
                           "optimizer_groups": [{k: v for k, v in g.items() if k != "params"}
                                                for g in optimizer.param_groups],
                           "torch_threads": torch.get_num_threads()}, f, default=str)

        def on_step_end(self, args, state, control, **kwargs):
            with open(clock_path, "a") as f:
                f.write(json.dumps({"step": state.global_step, "time": time.perf_counter() - self.start}) + "\n")

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    if spec["script"] == "reward":  # a one-output head on the SFT policy, as reward.py makes
        model = AutoModelForSequenceClassification.from_pretrained(spec["model"], num_labels=1, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    rewards = {"reward_funcs": [gold_reward]} if spec["script"] in ONLINE else {}
    trainer = getattr(module, trainer_name)(
        model=model, args=getattr(module, config_name)(**spec["config"]), processing_class=tokenizer,
        train_dataset=load_dataset("json", data_files=spec["data"], split="train"), callbacks=[StepClock()], **rewards)
    trainer.train()


def spawn(spec: dict, spec_path: str, timeout: int, child: str = "benchmarks.vs_trl") -> float:
    """Run one child to the end (`child`'s run_child on the spec); its peak RSS in MiB (os.wait4: this process
    alone, not the other children)."""
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(spec["threads"]))
    with open(spec_path + ".log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", f"import sys; from {child} import run_child; "
                                 "run_child(sys.argv[1])", spec_path], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:  # Ctrl-C: leave no child running
        proc.kill()
        proc.wait()
        raise
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        with open(spec_path + ".log") as f:
            raise RuntimeError(f"{spec['side']} {spec['script']} exited {proc.returncode}"
                               f"{' (stopped after --timeout)' if proc.returncode == -9 else ''}:\n{f.read()[-5000:]}")
    return usage.ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


# ---------------------------------------------------------------------------------------------
# MEASUREMENT AND REPORT
# ---------------------------------------------------------------------------------------------
def step_times(clock_path: str) -> list[float]:
    """The cumulative `time` of each logged step (one line per step; a repeated step keeps its first line)."""
    times = {}
    for row in _read_jsonl(clock_path):
        times.setdefault(row["step"], row["time"])
    return [times[s] for s in sorted(times)]


def seconds_per_update(times: list[float], updates_per_unit: int = 1, records_per_unit: int = 1) -> float:
    """Median seconds of one optimizer update over units 2..N, from cumulative clock readings.

    A unit is one logged step of our script (for rloo a rollout of `updates_per_unit` updates); the
    clock has `records_per_unit` readings per unit (1 for ours, updates_per_unit for TRL's rloo). The
    first unit is left out: it holds the warm-up (first allocations, lazy imports, the first sampling)."""
    ends = times[records_per_unit - 1::records_per_unit]
    durations = [b - a for a, b in zip(ends, ends[1:])]
    if not durations:
        raise ValueError(f"{len(ends)} units of {records_per_unit} clock readings: at least 2 are needed")
    return statistics.median(durations) / updates_per_unit


def trl_missing(script: str) -> str | None:
    """Why TRL has no trainer for this script (None when it has one)."""
    module_name, trainer_name, _ = TRL_TRAINERS[script]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        return f"{module_name} does not import ({e})"
    if not hasattr(module, trainer_name):
        return f"TRL {version('trl')} ships no {trainer_name} (neither in trl nor in trl.experimental)"
    return None


def our_argv(script: str, settings: dict, steps: int, model_path: str, data_file: str, output_dir: str) -> list[str]:
    """Flags of algos/<script>.py for one run: the settings, the files, no evaluation, the shared reward function."""
    reward = ["--reward_model_paths", "--reward_funcs", "benchmarks.vs_trl:gold_reward"] if script in ONLINE else []
    return ["--model_name_or_path", model_path, "--dataset_name", data_file, "--output_dir", output_dir,
            "--run_name", "vs_trl", "--max_steps", str(steps), *our_flags(settings), *NO_EVAL[script], *reward]


def compare(script: str, args: Args, work: str, model_path: str, data_file: str) -> dict:
    """`runs` interleaved runs per side of one pair: per-run clocks and peak RSS, and their medians."""
    settings = settings_for(script, args.model)
    per = updates_per_step(script, settings)
    config = trl_config(settings, script, args.steps) | (TRL_PADDING_FREE[script] if args.padding_free else {})
    ours_extra = ["--padding_free"] if args.padding_free or args.ours_padding_free else []
    runs = {"ours": [], "trl": []}
    os.makedirs(os.path.join(work, script), exist_ok=True)
    for run in range(args.runs):
        for side in ("ours", "trl"):
            out = os.path.join(work, script, f"{side}-{run}")
            spec = {"side": side, "script": script, "threads": args.threads, "steps": args.steps, "model": model_path,
                    "data": data_file}
            if side == "ours":
                spec["argv"] = our_argv(script, settings, args.steps, model_path, data_file, out) + ours_extra
                clock, readings = os.path.join(out, "logs", "vs_trl.jsonl"), 1
            else:
                clock, readings = os.path.join(work, script, f"trl-{run}.clock.jsonl"), per
                spec.update(config={**config, "output_dir": out}, clock=clock)
            print(f"{script}: run {run + 1}/{args.runs}, {side}", flush=True)
            shutil.rmtree(out, ignore_errors=True)  # a reused --work_dir: our log would append to the old run's
            if os.path.exists(clock):
                os.remove(clock)
            rss = spawn(spec, os.path.join(work, script, f"{side}-{run}.spec.json"), args.timeout)
            times = step_times(clock)
            runs[side].append({"seconds_per_update": seconds_per_update(times, per, readings), "peak_rss_mib": rss,
                               "clock": times})
            if side == "trl" and os.path.exists(clock + ".facts.json"):
                with open(clock + ".facts.json") as f:
                    runs[side][-1]["facts"] = json.load(f)
    summary = {side: {"seconds_per_update": statistics.median(r["seconds_per_update"] for r in rs),
                      "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs)} for side, rs in runs.items()}
    command = our_argv(script, settings, args.steps, model_path, data_file,
                       os.path.join(work, script, "ours-0")) + ours_extra
    return {"trl_trainer": ".".join(TRL_TRAINERS[script][:2]), "settings": settings, "updates_per_step": per,
            "ours_only": list(NOT_IN_TRL.get(script, ())), "trl_config": config,
            "our_command": f"python algos/{script}.py {shell(command)}".replace(work, "<work_dir>").replace(
                os.path.expanduser("~"), "~"),
            "longest_in_tokens": longest_in_tokens(model_path, data_file), "runs": runs, **summary,
            "ratio": summary["trl"]["seconds_per_update"] / summary["ours"]["seconds_per_update"]}


def table(results: dict, markdown: bool = False) -> str:
    """One row per script: both sides' median seconds per update, TRL's over ours, both peak RSS."""
    head = ["script", "TRL trainer", "ours s/step", "TRL s/step", "TRL/ours", "ours RSS (MiB)", "TRL RSS (MiB)"]
    lines = [[script, r["trl_trainer"], f"{r['ours']['seconds_per_update']:.3f}",
              f"{r['trl']['seconds_per_update']:.3f}", f"{r['ratio']:.2f}x", f"{r['ours']['peak_rss_mib']:,.0f}",
              f"{r['trl']['peak_rss_mib']:,.0f}"]
             for script, r in results.items()]
    return format_table(head, lines, markdown)


MATCHED = [
    "Model: the same folder on both sides, loaded in float32 (TRL's bf16 default turned off), no gradient "
    "checkpointing (TRL's default turned off), no LoRA.",
    "Data: the same .jsonl file, read by both sides (online scripts: prompts only).",
    "Batch: per-device batch size, gradient accumulation, lengths (max_length, max_completion_length / "
    "max_new_tokens), samples per prompt, sampling temperature / top-p / top-k / min-p / repetition penalty.",
    "Loss: loss type, beta, epsilon (clip range), iterations per generation batch, reward scaling, as in SETTINGS.",
    "Optimizer: torch.optim.AdamW (TRL: optim=adamw_torch, not the fused default), betas (0.9, 0.999), eps 1e-8, "
    "the same weight decay, learning rate, scheduler and warm-up steps (computed once from warmup_ratio), "
    "max_grad_norm, seed.",
    "Reward (grpo, rloo, online_dpo): the same Python function (benchmarks.vs_trl:gold_reward, the tiny task's "
    "gold judge), called by keyword on both sides.",
    "Process: a fresh Python process per run, the same torch threads and OMP_NUM_THREADS, no evaluation, no "
    "checkpoints, no sample tables, no wandb; printed logs every logging_steps on both sides.",
]


def machine() -> dict:
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"nproc": usable, "cpu_count": os.cpu_count(), "cpu": cpu or "unknown", "python": platform.python_version()}


def versions() -> dict:
    found = {}
    for package in ("torch", "transformers", "trl", "accelerate", "datasets"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def markdown(report: dict) -> str:
    """All sections of vs_trl.json as a page."""
    out = ["# Our scripts vs TRL, side by side", "",
           "Written by `benchmarks/vs_trl.py` (see its docstring for the method). s/step: median seconds of one "
           "optimizer update over steps 2..N of a run, then the median over runs; TRL/ours > 1: ours is faster. "
           "RSS: peak resident memory of the whole process (median over runs).", ""]
    for model, section in report.items():
        m, v = section["machine"], section["versions"]
        out += [f"## --model {model}", "", f"- date: {section['date']}",
                f"- machine: {m['cpu']}, nproc {m['nproc']} (of {m['cpu_count']}), "
                f"torch threads {section['args']['threads']}",
                "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + f", python {m['python']}",
                f"- command: `{section['command']}`"] + ([f"- note: {section['note']}"] if section["note"] else []) + [
                f"- rerun {r['date']}, rows {', '.join(r['scripts'])}: `{r['command']}`"
                + (f" ({r['note']})" if r["note"] else "")
                + (f"; {r['machine']['cpu']}, " + ", ".join(f"{k} {val}" for k, val in r["versions"].items())
                   if "machine" in r else "") for r in section.get("reruns", [])] + [
                "", table(section["results"], markdown=True), ""]
        out += [f"- {script}: skipped, {why}" for script, why in section["skipped"].items()]
        for script, r in section["results"].items():
            ours = ", ".join(f"{x['seconds_per_update']:.3f}" for x in r["runs"]["ours"])
            trl = ", ".join(f"{x['seconds_per_update']:.3f}" for x in r["runs"]["trl"])
            out += ["", f"### {script} vs {r['trl_trainer']}", "",
                    f"Per run, s/step: ours {ours}; TRL {trl}. Longest in tokens: "
                    + ", ".join(f"{k} {n}" for k, n in r["longest_in_tokens"].items())
                    + (f" (ours only: {', '.join(r['ours_only'])})" if r["ours_only"] else "")
                    + (f". One logged step of ours = {r['updates_per_step']} updates." if r["updates_per_step"] > 1
                       else "."),
                    "", "| setting | ours | TRL |", "|---|---|---|"]
            for name, value in r["settings"].items():
                trl_name = TRL_NAMES.get(name, name)
                out.append(f"| {name} | {value} | "
                           + ("(no such field)" if name in r["ours_only"]
                              else f"{trl_name} = {r['trl_config'][trl_name]}")
                           + " |")
            out += ["", f"Ours: `{r['our_command']}`", "",
                    "TRL config besides the settings: " + ", ".join(
                        f"{k}={val}" for k, val in r["trl_config"].items() if k in TRL_FIXED or k == "max_steps")]
        out += ["", "### Matched", ""] + [f"- {x}" for x in section["matched"]]
        out += ["", "### Not matched", ""] + [f"- {x}" for x in section["not_matched"]] + [""]
    return "\n".join(out)


def main(args: Args) -> dict:
    if args.steps < 2 or args.runs < 1:
        raise SystemExit("error: --steps must be >= 2 (the median is over steps 2..N) and --runs >= 1")
    args.scripts = list(args.scripts or MODELS[args.model])
    if set(args.scripts) - set(MODELS[args.model]):
        raise SystemExit(f"error: --model {args.model} runs {', '.join(MODELS[args.model])}")
    try:
        trl = importlib.import_module("trl")
    except ImportError:
        raise SystemExit("error: TRL is not installed: pip install 'minimal-post-training[bench]'") from None
    if trl.__version__ != TRL_VERSION:
        print(f"warning: TRL {trl.__version__}, not the pinned {TRL_VERSION}", file=sys.stderr)
    if args.padding_free and args.ours_padding_free:
        raise SystemExit("error: --padding_free (both sides) or --ours_padding_free (ours only), not both")
    skipped = {s: why for s in args.scripts if (why := trl_missing(s))}
    if args.padding_free:
        skipped |= {s: NO_TRL_PADDING_FREE[s] for s in args.scripts if s in NO_TRL_PADDING_FREE and s not in skipped}
    for script, why in skipped.items():
        print(f"skipping {script}: {why}", flush=True)
    work = args.work_dir or tempfile.mkdtemp(prefix="vs_trl-")
    os.makedirs(work, exist_ok=True)
    results = {}
    try:
        todo = [s for s in args.scripts if s not in skipped]
        models, data = starting_models(args, work, todo), data_files(work, args.model)
        for script in todo:
            results[script] = compare(script, args, work, models[script], data[script])
    finally:
        if args.work_dir is None:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    section = {"date": datetime.date.today().isoformat(), "machine": machine(), "versions": versions(),
               "note": args.note, "command": shlex.join(["python", "benchmarks/vs_trl.py", *sys.argv[1:]]),
               "args": dataclasses.asdict(args), "skipped": skipped, "matched": MATCHED,
               "not_matched": NOT_MATCHED + (PADDING_FREE_NOT_MATCHED if args.padding_free else [])
               + (OURS_PADDING_FREE_NOT_MATCHED if args.ours_padding_free else []), "results": results}
    print(table(results))
    if args.results_dir:
        path = os.path.join(args.results_dir, "vs_trl.json")
        report = {}
        if os.path.exists(path):
            with open(path) as f:
                report = json.load(f)
        key = args.model + (" --padding_free" if args.padding_free else " --ours_padding_free" if args.ours_padding_free
                            else "")  # padded rows stay in their section
        old = report.get(key)
        if old and set(args.scripts) < set(MODELS[args.model]):  # a rerun of some scripts: the others' rows stay
            merged = {**old["results"], **results}
            section.update(results={s: merged[s] for s in MODELS[args.model] if s in merged},
                           skipped={**old["skipped"], **skipped}, date=old["date"], command=old["command"],
                           note=old["note"], machine=old["machine"], versions=old["versions"],
                           reruns=[*old.get("reruns", []), {
                               "date": section["date"], "command": section["command"], "note": section["note"],
                               "scripts": list(results), "machine": section["machine"],
                               "versions": section["versions"]}])
        report[key] = section
        os.makedirs(args.results_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.results_dir, "vs_trl.md"), "w") as f:
            f.write(markdown(report))
        print(f"wrote {path} and vs_trl.md")
    return section


if __name__ == "__main__":
    main(tyro.cli(Args))
