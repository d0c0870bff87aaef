"""Process setup: accelerator, seeds, checks of the flags, one-line user errors, stop signals."""

import contextlib
import os
import signal
import sys

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs, set_seed
from tqdm.auto import tqdm


class UserError(Exception):
    """Something the user can fix (a flag, a path, a column): one line, no traceback, exit status 2."""


@contextlib.contextmanager
def exit_on_user_error():
    try:
        yield
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":  # once, not once per process
            for bar in list(getattr(tqdm, "_instances", ())):  # end the progress bar's line first
                bar.close()
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def check_built(path: str):
    """The defaults name the tiny task's folders (tiny_tldr/...), which a benchmark writes."""
    if path.startswith("tiny_tldr/") and not os.path.exists(path):
        raise UserError(f"'{path}' does not exist; build the tiny task first (from the project root): "
                        "python benchmarks/tiny_tldr.py")


# flags that size, count or scale something: 0 or less is never meaningful (and some divide by them)
POSITIVE = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
            "learning_rate", "max_grad_norm", "num_train_epochs", "eval_steps", "max_length", "max_prompt_length",
            "max_completion_length", "max_new_tokens", "response_length", "num_iterations", "num_ppo_epochs",
            "num_mini_batches", "local_rollout_forward_batch_size", "ref_model_sync_steps", "lora_r", "lora_alpha",
            "temperature", "top_entropy_quantile", "sapo_temperature_pos", "sapo_temperature_neg",
            "max_dynamic_sampling_rounds")


def check_positive(flags: dict):
    """flags: the script's flag values by name (`vars(args)`)."""
    for name in POSITIVE:
        if (value := flags.get(name)) is not None and value <= 0:
            why = ("; online RL samples its completions (the loss uses their probabilities), so it needs a "
                   "temperature > 0, e.g. 0.7 or 1.0" if name == "temperature" else "")
            raise UserError(f"--{name} must be > 0 (got {value}){why}")


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
          bf16: bool = False) -> Accelerator:
    """Accelerator with gradient accumulation (and bf16), the same seed on every rank (a new score head
    starts alike everywhere; sampling is seeded per completion), and under DeepSpeed the batch size and
    clipping norm the engine would otherwise read from a prepared DataLoader or its config."""
    # DeepSpeed without CUDA (ZeRO on a CPU, as the tests do): accelerate leaves the backend unset, and
    # every process would believe it is alone
    cpu_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true" and not torch.cuda.is_available()
    accelerator = Accelerator(gradient_accumulation_steps=gradient_accumulation_steps,
                              mixed_precision="bf16" if bf16 else None,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if cpu_deepspeed else None)
    if os.environ.get("ACCELERATE_USE_FSDP") == "true" and accelerator.distributed_type != DistributedType.FSDP:
        # accelerate (1.15) turns FSDP on for accelerators only; on a CPU (gloo, as the tests run it) it would
        # quietly run DDP. The plugin reads the launcher's FSDP_* variables; the shared state keeps the type.
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
        accelerator.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    set_seed(seed)
    if (plugin := accelerator.state.deepspeed_plugin) is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = per_device_train_batch_size
        plugin.deepspeed_config["gradient_clipping"] = max_grad_norm
    torch.backends.cuda.matmul.allow_tf32 = True
    return accelerator


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
