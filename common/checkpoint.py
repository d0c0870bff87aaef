"""The finished model, saved the `from_pretrained` way, and resumable checkpoints with the ways a run
stops early (signals, non-finite values)."""

import math
import os
import shutil
import signal
import sys
from dataclasses import dataclass

import torch
import tyro

from common import runtime
from common.runtime import UserError


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # --save_steps, not --checkpoint.save-steps
@dataclass
class CheckpointArgs:
    """checkpoints and stopping (common/checkpoint.py)"""
    save_steps: int = 0
    """save a resumable checkpoint every this many steps (rloo, ppo: rollouts; 0: only on SIGTERM / Ctrl-C or a
    non-finite value)"""
    save_total_limit: int = 2
    """checkpoints kept (the newest)"""
    resume_from_checkpoint: str | None = None
    """continue a run from a checkpoint directory, or `latest` (the newest in <output_dir>/checkpoints)"""
    overwrite_output_dir: bool = False
    """start over in an output_dir with a finished model or another run's checkpoints (replaced when this run ends)"""
    skip_nonfinite_steps: bool = False
    """drop an update whose loss or gradient is not finite and go on (default: save a checkpoint and stop)"""
    ddp_timeout: int = 1800
    """seconds a process waits for the others in a collective (one failed or hangs) before the run stops"""


def save_model(accelerator, model, tokenizer, output_dir: str, part: str | None = None):
    """Model + tokenizer (with LoRA the adapters), written aside and renamed into place, so a crash never
    leaves a half-written file. On every process (a sharded model is gathered); `part`: one submodule."""
    state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards (to the main process); all ranks take part
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        if part:
            unwrapped = getattr(unwrapped, part)
            state_dict = {k.removeprefix(part + "."): v for k, v in state_dict.items() if k.startswith(part + ".")}
        tmp = os.path.join(output_dir, ".saving")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        unwrapped.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
        os.rmdir(tmp)
    accelerator.wait_for_everyone()


class Checkpointer:
    """<output_dir>/checkpoints/step_<n>: accelerate's state (model, optimizer, scheduler, every process's
    RNGs) and the loop's state (a dict: counters, anything carried between steps), written aside and
    renamed into place; the newest --save_total_limit are kept (on each machine: without a shared file
    system each holds its own). `end_of_step` saves every --save_steps,
    and saves and exits after SIGTERM / Ctrl-C or a non-finite loss or gradient, whose update `finite`
    has dropped (in rloo/ppo a step is a rollout: its finite mini-batch updates still apply)."""

    def __init__(self, accelerator, scheduler, options: CheckpointArgs, *, output_dir: str, run_name: str):
        self.accelerator, self.run_name, self.resume_from = accelerator, run_name, options.resume_from_checkpoint
        self.save_steps, self.save_total_limit = options.save_steps, options.save_total_limit
        self.skip_nonfinite_steps = skip_nonfinite_steps = options.skip_nonfinite_steps
        self.root = os.path.join(output_dir, "checkpoints")
        # (metric, value) that made this step's update be dropped; DeepSpeed steps inside backward(), before
        # `finite` can drop the update (it skips overflows itself)
        self.nonfinite, self.skipped_backward = None, False
        self.engine = accelerator.deepspeed_engine_wrapped.engine if accelerator.state.deepspeed_plugin else None
        if self.engine is not None and skip_nonfinite_steps:
            raise UserError("--skip_nonfinite_steps cannot be used with DeepSpeed, whose engine applies each update "
                            "inside backward; without it a non-finite loss stops the run before backward")
        if not self.resume_from and accelerator.is_local_main_process:  # each machine may hold another run's
            shutil.rmtree(self.root, ignore_errors=True)  # (check_output_dir asked for --overwrite_output_dir)
        accelerator.wait_for_everyone()  # on a shared file system: before any process writes the first one
        accelerator.register_for_checkpointing(scheduler)  # not prepared (see the scripts), so registered

    def saved(self) -> list[str]:
        """The complete checkpoints, oldest first."""
        names = os.listdir(self.root) if os.path.isdir(self.root) else []
        return sorted((d for d in names if d.startswith("step_")), key=lambda d: int(d[5:]))

    def finite(self, **values) -> bool:
        """After clipping, before optimizer.step(): False (on every process) when a value (loss, grad_norm,
        ...) is not finite on some process; the caller then drops the update."""
        values = {k: float(v.detach() if torch.is_tensor(v) else v) for k, v in values.items() if v is not None}
        bad = [(k, v) for k, v in values.items() if not math.isfinite(v)]
        if self.accelerator.reduce(torch.tensor(float(bool(bad)), device=self.accelerator.device), "max").item() == 0:
            return True
        self.nonfinite = self.nonfinite or (bad[0] if bad else ("loss", float("nan")))  # else: on another process
        return False

    def finite_loss(self, loss) -> bool:
        """Before backward: under DeepSpeed, False (every process alike) once a loss of this step is not
        finite on some process: skip backward for the rest of the step, so the engine takes no update.
        Without DeepSpeed always True (`finite` drops the update after backward)."""
        if self.engine is None or (self.nonfinite is None and self.finite(loss=loss)):
            return True
        self.skipped_backward = True  # so the engine took no step, whatever it says of its last one
        return False

    def save(self, step: int, state: dict) -> str:
        """Write checkpoint step_<step> (collective: every process calls it); returns its path."""
        acc, final = self.accelerator, os.path.join(self.root, f"step_{step}")
        tmp = os.path.join(self.root, f".step_{step}.partial")

        def in_turn(work):
            """`work` on each machine's first process, machine after machine (one turn per rank: accelerate
            does not say which ranks share a machine): with a shared file system the later ones find it done."""
            for rank in range(acc.num_processes):
                if rank == acc.process_index and acc.is_local_main_process:
                    work()
                acc.wait_for_everyone()

        def publish():
            if os.path.isdir(tmp):  # else a machine sharing this file system has renamed it
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
            for old in self.saved()[:-max(1, self.save_total_limit)]:
                shutil.rmtree(os.path.join(self.root, old))

        in_turn(lambda: (shutil.rmtree(tmp, ignore_errors=True), os.makedirs(tmp)))
        acc.save_state(tmp)
        torch.save({**state, "step": step, "run_name": self.run_name, "world_size": acc.num_processes},
                   os.path.join(tmp, f"loop_state_{acc.process_index}.pt"))
        acc.wait_for_everyone()
        in_turn(publish)
        return final

    def end_of_step(self, step: int, state: dict):
        """Save every --save_steps; after a signal or a non-finite value, save and exit."""
        acc = self.accelerator
        stop = acc.reduce(torch.tensor(float(runtime.stop_signal or 0), device=acc.device), "max").item()
        nonfinite, self.nonfinite = self.nonfinite, None
        applied = nonfinite and self.engine is not None and not self.skipped_backward and self.engine.was_step_applied()
        self.skipped_backward = False
        if nonfinite and self.skip_nonfinite_steps:
            acc.print(f"step {step}: non-finite {nonfinite[0]} ({nonfinite[1]}); step skipped (--skip_nonfinite_steps)")
            nonfinite = None
        if applied:
            newest = self.saved()[-1] if self.saved() else None
            raise UserError(f"step {step}: non-finite {nonfinite[0]} ({nonfinite[1]}); DeepSpeed applied this update "
                            "inside backward, before it could be checked, so it could not be dropped and no checkpoint "
                            "was written; lower --learning_rate and continue from the newest checkpoint"
                            + (f" ({os.path.join(self.root, newest)}) with --resume_from_checkpoint latest" if newest
                               else " (there is none: pass --save_steps to keep some)"))
        if stop or nonfinite or (self.save_steps and step % self.save_steps == 0):
            path = self.save(step, state() if callable(state) else state)  # a function: built only to be saved
            if stop:
                acc.print(f"stopped by {signal.Signals(int(stop)).name} after step {step}; checkpoint in {path}; "
                          "continue with --resume_from_checkpoint latest")
                sys.exit(128 + int(stop))
            if nonfinite:
                raise UserError(f"step {step}: non-finite {nonfinite[0]} ({nonfinite[1]}); the update was dropped and "
                                f"the last good weights, untouched by it, saved in {path}; lower --learning_rate and "
                                "continue with --resume_from_checkpoint latest"
                                + ("" if self.engine else ", or pass --skip_nonfinite_steps"))
