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


def setup(args, mixed_precision: str | None = None) -> Accelerator:
    """Accelerator with gradient accumulation, and seeds that differ per rank (so that ranks sample
    different completions) but are reproducible. Fills in `args.world_size`, `args.run_name`."""
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision=mixed_precision)
    set_seed(args.seed, device_specific=True)  # seed + process index
    args.world_size = accelerator.num_processes
    if not getattr(args, "run_name", None):
        script = os.path.splitext(os.path.basename(sys.argv[0]))[0]
        args.run_name = f"{script}__{args.seed}__{int(time.time())}"
    torch.backends.cuda.matmul.allow_tf32 = True
    return accelerator
