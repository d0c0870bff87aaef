"""Process setup: accelerator, per-rank seeds, batch-size arithmetic, and one-line user errors."""

import contextlib
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


class UserError(Exception):
    """Something the user can fix (a flag, a path, a dataset column). Printed as one line, no
    traceback, exit status 2."""


@contextlib.contextmanager
def exit_on_user_error():
    try:
        yield
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":  # once, not once per process
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def exact_div(a: int, b: int, message: str) -> int:
    """a / b when b divides a; otherwise a UserError with `message` (which should name the flags)."""
    if b <= 0 or a % b != 0:
        raise UserError(f"{message} ({a} is not divisible by {b})")
    return a // b


def setup(args) -> Accelerator:
    """Accelerator with gradient accumulation (and bf16 with --bf16), and the same seed on every rank
    (new weights, such as a fresh score head, start alike everywhere; sampling is seeded per completion). Fills in `args.world_size`, `args.run_name`, and under DeepSpeed the batch
    size and clipping norm it would otherwise expect from a prepared DataLoader or its config."""
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision="bf16" if getattr(args, "bf16", False) else None)
    set_seed(args.seed)
    args.world_size = accelerator.num_processes
    if not getattr(args, "run_name", None):
        script = os.path.splitext(os.path.basename(sys.argv[0]))[0]
        args.run_name = f"{script}__{args.seed}__{int(time.time())}"
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
        plugin.deepspeed_config["gradient_clipping"] = args.max_grad_norm
    torch.backends.cuda.matmul.allow_tf32 = True
    return accelerator
