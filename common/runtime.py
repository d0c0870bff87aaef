"""Process setup: accelerator, seeds, checks of the flags, one-line user errors, stop signals, the learning-rate
schedule."""

import contextlib
import datetime
import json
import math
import os
import signal
import sys
from dataclasses import is_dataclass

import datasets
import torch
import transformers
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs, set_seed
from tqdm.auto import tqdm


class UserError(Exception):
    """Something the user can fix (a flag, a path, a column): one line, no traceback, exit status 2."""


@contextlib.contextmanager
def exit_on_user_error():
    """A UserError ends the process with one `error:` line and exit status 2. Every process that fails says
    so, with its rank when there are several (a failure on one rank alone, a file missing on one machine,
    must not end the job in silence); then any other exception gets the line too, before its traceback."""
    rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    try:
        yield
        end_processes()
    except Exception as e:
        for bar in list(getattr(tqdm, "_instances", ())):  # end the progress bar's line first
            bar.close()
        if isinstance(e, UserError):
            sys.stderr.write(f"{rank}error: {e}\n")  # one write: ranks' lines never share a line
            sys.exit(2)
        if rank:  # one process alone: its traceback is enough
            why = str(e).lower()
            hint = ("; this process waited longer than --ddp_timeout for the others: one failed (see its error) or "
                    "hangs; raise --ddp_timeout if a step can take that long" if "timed out" in why else
                    "; another process ended first: see its error" if "peer" in why else " (traceback below)")
            sys.stderr.write(f"{rank}error: {type(e).__name__}: {str(e)[:300]}{hint}\n")
        raise


def exit_now(message: str):
    """From any thread: the `error:` line exit_on_user_error writes for a UserError, then the process ends at once
    (status 2). For a user's function that hangs (common/rewards.called), which cannot be stopped, only left; with
    several processes the launcher then stops the others."""
    with contextlib.suppress(SystemExit), exit_on_user_error():
        raise UserError(message)
    os._exit(2)


def end_processes():
    """A finished run of several processes ends here: every rank waits for the others, flushes its output and
    leaves at once (os._exit(0)), without the interpreter's teardown, in which tearing down torch.distributed's
    gloo threads aborts one rank now and then (SIGABRT after the work is done and saved; docs/troubleshooting.md).
    One process: nothing (the interpreter ends as usual)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_built(path: str, what: str):
    """The defaults name the tiny task's folders (tiny_tldr/...), which a benchmark writes."""
    if path.startswith("tiny_tldr/") and not os.path.exists(path):
        raise UserError(f"{what} '{path}' does not exist; build the tiny task first (from the project root): "
                        "python benchmarks/tiny_tldr.py")


# flags that size, count or scale something: 0 or less is never meaningful (and some divide by them)
POSITIVE = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
            "learning_rate", "max_grad_norm", "num_train_epochs", "eval_steps", "max_length", "max_prompt_length",
            "max_completion_length", "max_new_tokens", "response_length", "num_iterations", "num_ppo_epochs",
            "num_mini_batches", "local_rollout_forward_batch_size", "ref_model_sync_steps", "lora_r", "lora_alpha",
            "temperature", "top_entropy_quantile", "sapo_temperature_pos", "sapo_temperature_neg", "ddp_timeout",
            "max_dynamic_sampling_rounds", "vllm_tensor_parallel_size", "vllm_max_num_batched_tokens")


def flags(args) -> dict:
    """A script's flag values by name: its Args' own fields and those of its groups (VLLMArgs, ModelArgs, ...)."""
    return {k: w for k, v in vars(args).items() for k, w in (flags(v) if is_dataclass(v) else {k: v}).items()}


def check_flags(args):
    """Before anything loads: sizes and rates > 0, an output_dir free to use. args: the script's Args (its groups
    included)."""
    values = flags(args)
    for name in (*POSITIVE, "reward_timeout", "tool_timeout"):  # the timeouts: 0 is no limit
        if (value := values.get(name)) is not None and (value < 0 or value == 0 and name in POSITIVE):
            why = {"temperature": "; online RL samples its completions (the loss uses their probabilities), so it "
                   "needs a temperature > 0, e.g. 0.7 or 1.0"}.get(name, "" if name in POSITIVE else "; 0 is no limit")
            raise UserError(f"--{name} must be {'>' if name in POSITIVE else '>='} 0 (got {value}){why}")
    if values.get("dataset_name") == "" and not values.get("environment_factory"):  # TRL's environment-owned data
        raise UserError('--dataset_name "": no dataset, in grpo/rloo with an --environment_factory giving prompts')
    check_output_dir(values["output_dir"], values["overwrite_output_dir"], values["resume_from_checkpoint"])


stop_signal: int | None = None  # set by SIGTERM / Ctrl-C under `stop_on_signal`; read by the Checkpointer


@contextlib.contextmanager
def stop_on_signal():
    """SIGTERM or Ctrl-C: finish the step, save a checkpoint, exit (common/checkpoint.py); twice: stop now."""
    def ask_to_stop(signum, frame):
        global stop_signal
        if stop_signal is not None:
            raise KeyboardInterrupt
        stop_signal = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, ask_to_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def setup(*, seed: int, gradient_accumulation_steps: int, per_device_train_batch_size: int, max_grad_norm: float,
          bf16: bool = False, ddp_timeout: int = 1800) -> Accelerator:
    """Accelerator with gradient accumulation (and bf16), the same seed on every rank (a new score head
    starts alike everywhere; sampling is seeded per completion), collectives that give up after
    `ddp_timeout` seconds, and under DeepSpeed the accumulation, batch size and clipping norm of the
    flags (the engine would otherwise read them from a prepared DataLoader or its config)."""
    # one accumulation value, the flag's: the scripts build and normalise micro-batches by it, while accelerate
    # lets a launcher's value (a yaml's deepspeed_config.gradient_accumulation_steps, `accelerate launch
    # --gradient_accumulation_steps`) or a DeepSpeed json's replace it, with only a warning in its log
    ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    launcher = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    for where, value in (("the accelerate launch config (ACCELERATE_GRADIENT_ACCUMULATION_STEPS, from its "
                          "deepspeed_config or --gradient_accumulation_steps)", launcher),
                         (f"the DeepSpeed config {ds_file}",
                          ds_file != "none" and json.load(open(ds_file)).get("gradient_accumulation_steps"))):
        if value not in (None, False, "auto") and int(value) != gradient_accumulation_steps:
            raise UserError(f"--gradient_accumulation_steps is {gradient_accumulation_steps} but {where} says "
                            f"{value}; the script accumulates by its flag: make the two equal")
    # DeepSpeed without CUDA (ZeRO on a CPU, as the tests do): accelerate leaves the backend unset, and
    # every process would believe it is alone
    cpu_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true" and not torch.cuda.is_available()
    timeout = InitProcessGroupKwargs(backend="gloo" if cpu_deepspeed else None,
                                     timeout=datetime.timedelta(seconds=ddp_timeout))
    accelerator = Accelerator(gradient_accumulation_steps=gradient_accumulation_steps,
                              mixed_precision="bf16" if bf16 else None, kwargs_handlers=[timeout])
    if os.environ.get("ACCELERATE_USE_FSDP") == "true" and accelerator.distributed_type != DistributedType.FSDP:
        # accelerate (1.15) turns FSDP on for accelerators only; on a CPU (gloo, as the tests run it) it would
        # quietly run DDP. The plugin reads the launcher's FSDP_* variables; the shared state keeps the type; bf16
        # as on a GPU: FSDP2's mixed-precision policy (weights cast to bf16 as each module gathers; no autocast)
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
        if accelerator.mixed_precision != "no":
            accelerator.state.fsdp_plugin.set_mixed_precision(accelerator.mixed_precision)
        accelerator.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    set_seed(seed)
    if not sys.stderr.isatty():  # progress bars (loading, saving, mapping) on a terminal only, as common/tracking.py's
        transformers.utils.logging.disable_progress_bar()  # the hub's too
        datasets.disable_progress_bars()
    if (plugin := accelerator.state.deepspeed_plugin) is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = per_device_train_batch_size
        plugin.deepspeed_config["gradient_accumulation_steps"] = gradient_accumulation_steps  # a json without it: 1
        plugin.deepspeed_config["gradient_clipping"] = max_grad_norm
    torch.backends.cuda.matmul.allow_tf32 = True
    return accelerator


def lr_scheduler(name: str, optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int):
    """transformers' `get_scheduler(name, optimizer, warmup_steps, total_steps)`, the schedules the scripts offer
    by default built here on torch's LambdaLR with the same multipliers of the peak rate at step s (w: warm-up
    steps, T: total): s / w while s < w, then "linear" (T - s) / (T - w), "cosine" (1 + cos(pi (s - w) / (T - w))) / 2,
    "constant_with_warmup" 1; "constant" 1 from the start. Other names go to transformers. Why not transformers' for
    all: importing it imports transformers.trainer_utils and, when installed, peft: ~5 s of every launch on a CPU."""
    if name not in ("linear", "cosine", "constant", "constant_with_warmup"):
        from transformers import get_scheduler

        return get_scheduler(name, optimizer, warmup_steps, total_steps)

    def multiplier(step: int) -> float:
        if step < warmup_steps and name != "constant":  # constant: 1 from the start
            return step / max(1, warmup_steps)
        decay_steps = max(1, total_steps - warmup_steps)
        if name == "linear":
            return max(0.0, (total_steps - step) / decay_steps)
        if name == "cosine":
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((step - warmup_steps) / decay_steps))))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def check_output_dir(d: str, overwrite: bool, resume: str | None):
    """Never overwrite a finished model or another run's checkpoints in output_dir `d` by accident."""
    finished = any(os.path.exists(os.path.join(d, f)) for f in ("config.json", "adapter_config.json"))
    if overwrite or resume and not finished:
        return
    if finished:
        raise UserError(f"output_dir '{d}' already holds a finished model; pass --overwrite_output_dir to replace "
                        "it (it is replaced only when the new run finishes) or choose another --output_dir")
    if os.path.isdir(os.path.join(d, "checkpoints")) and os.listdir(os.path.join(d, "checkpoints")):
        raise UserError(f"output_dir '{d}' holds checkpoints of an unfinished run; continue it with "
                        "--resume_from_checkpoint latest, or start over with --overwrite_output_dir")
