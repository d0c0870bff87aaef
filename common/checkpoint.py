"""The finished model, saved the `from_pretrained` way, and resumable checkpoints with the ways a run
stops early (signals, non-finite values)."""

import math
import os
import pickle
import pkgutil
import shutil
import signal
import sys
from dataclasses import dataclass
from unittest import mock

import torch
import tyro
from accelerate.utils import gather_object

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


# what DeepSpeed (0.19) pickles into its optimizer files besides data: plain classes, safe to rebuild
DEEPSPEED_CLASSES = ("deepspeed.runtime.fp16.loss_scaler:LossScaler", "deepspeed.runtime.zero.config:ZeroStageEnum",
                     "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
                     "deepspeed.utils.tensor_fragment:fragment_address")


# what torch.distributed.checkpoint (torch 2.13) pickles into the `.metadata` file of an FSDP2 sharded state
# dict (model and optimizer, as accelerate saves them), found by reading real ones with pickletools; a torch
# dtype is admitted by its type. DCP's reader unpickles the file in full (FileSystemReader.read_metadata).
DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                                              "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"}, "torch": {"Size"},
    "torch.serialization": {"_get_layout"}, "pathlib": {"PosixPath", "WindowsPath"}}  # the save's checkpoint_id


class RefusedGlobal(pickle.UnpicklingError):
    pass


class DCPMetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's metadata classes only: any other global (a function to call, a class) is refused
    unloaded. https://docs.python.org/3/library/pickle.html#restricting-globals"""

    def find_class(self, module, name):
        if name in DCP_METADATA_CLASSES.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise RefusedGlobal(f"{module}.{name}")


def unsafe_metadata(path: str) -> str | None:
    """What is wrong with the first DCP `.metadata` file under checkpoint `path` (None: nothing, or none there)."""
    for root, _, files in sorted(os.walk(path, followlinks=True)):  # a linked folder too
        for name in sorted(f for f in files if f.endswith(".metadata")):  # also DCP's per-rank __<r>.metadata
            file = os.path.join(root, name)
            try:
                with open(file, "rb") as f:
                    DCPMetadataUnpickler(f).load()
            except RefusedGlobal as e:
                return f"holds pickled code, not only data ({os.path.relpath(file, path)} calls {e})"
            except Exception as e:  # truncated, not a pickle: DCP would fail with a traceback
                return f"is damaged ({os.path.relpath(file, path)}: {type(e).__name__}: {e})"
    return None


class Checkpointer:
    """<output_dir>/checkpoints/step_<n>: accelerate's state (model, optimizer, scheduler, every process's
    RNGs) and the loop's state (a dict: counters, anything carried between steps), written aside and
    renamed into place; the newest --save_total_limit are kept (on each machine: without a shared file
    system each holds its own). `end_of_step` saves every --save_steps,
    and saves and exits after SIGTERM / Ctrl-C or a non-finite loss or gradient, whose update `finite`
    has dropped (in rloo/ppo a step is a rollout: its finite mini-batch updates still apply)."""

    def __init__(self, accelerator, scheduler, *, output_dir: str, run_name: str, resume_from: str | None,
                 save_steps: int, save_total_limit: int, skip_nonfinite_steps: bool):
        self.accelerator, self.run_name, self.resume_from = accelerator, run_name, resume_from
        self.save_steps, self.save_total_limit = save_steps, save_total_limit
        self.skip_nonfinite_steps = skip_nonfinite_steps
        self.root = os.path.join(output_dir, "checkpoints")
        # (metric, value) that made this step's update be dropped; DeepSpeed steps inside backward(), before
        # `finite` can drop the update (it skips overflows itself)
        self.nonfinite, self.skipped_backward = None, False
        self.engine = accelerator.deepspeed_engine_wrapped.engine if accelerator.state.deepspeed_plugin else None
        if self.engine is not None and skip_nonfinite_steps:
            raise UserError("--skip_nonfinite_steps cannot be used with DeepSpeed, whose engine applies each update "
                            "inside backward (it skips overflowing gradients itself); without the flag a non-finite "
                            "loss is caught before backward, and the run saves the last good weights and stops")
        if not resume_from and accelerator.is_local_main_process:  # each machine may hold another run's
            shutil.rmtree(self.root, ignore_errors=True)  # (check_output_dir asked for --overwrite_output_dir)
        accelerator.wait_for_everyone()  # on a shared file system: before any process writes the first one
        accelerator.register_for_checkpointing(scheduler)  # not prepared (see the scripts), so registered

    def saved(self) -> list[str]:
        """The complete checkpoints, oldest first."""
        names = os.listdir(self.root) if os.path.isdir(self.root) else []
        return sorted((d for d in names if d.startswith("step_")), key=lambda d: int(d[5:]))

    def resume(self) -> dict:
        """Load --resume_from_checkpoint (a directory, or `latest`); the loop state with "step", "run_name" ({})."""
        if not (path := self.resume_from):
            return {}
        if path == "latest":  # the newest on every machine (without a shared file system each lists its own)
            if not (everywhere := set.intersection(*map(set, gather_object([self.saved()])))):
                raise UserError(f"--resume_from_checkpoint latest: no checkpoint in '{self.root}'" + (self.saved() and
                                f" is on every machine (this one has {', '.join(self.saved())})" or ""))
            path = os.path.join(self.root, max(everywhere, key=lambda d: int(d[5:])))
        rank_file = os.path.join(path, f"loop_state_{self.accelerator.process_index}.pt")
        # each rank checks its own files (without a shared file system, another copy): one bad, all ranks stop
        verdicts = gather_object([(os.path.isfile(rank_file), unsafe_metadata(path))])
        if missing := [r for r, (ok, _) in enumerate(verdicts) if not ok]:
            raise UserError(f"'{path}' is not a checkpoint of this script for {self.accelerator.num_processes} "
                            f"process(es) (no loop_state_{missing[0]}.pt)")
        if bad := next(((r, v) for r, (_, v) in enumerate(verdicts) if v), None):  # before DCP unpickles in full
            by = f", as read by process {bad[0]}" if self.accelerator.num_processes > 1 else ""
            raise UserError(f"'{path}' {bad[1]}{by}; it was not loaded")
        # no file of a checkpoint may run code: torch's weights-only unpickler also where accelerate (the
        # registered scheduler) and DeepSpeed would unpickle in full
        deepspeed_classes = [pkgutil.resolve_name(c) for c in DEEPSPEED_CLASSES] if self.engine else []
        try:
            with (mock.patch.dict(os.environ, TORCH_FORCE_WEIGHTS_ONLY_LOAD="1", TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="0"),
                  torch.serialization.safe_globals(deepspeed_classes)):
                state = torch.load(rank_file, weights_only=True)
                if state["world_size"] != self.accelerator.num_processes:
                    raise UserError(f"'{path}' was written by {state['world_size']} processes; resume it with as many")
                self.accelerator.load_state(path)
        except pickle.UnpicklingError:  # torch refused a global or an instruction: not data alone
            raise UserError(f"'{path}' holds pickled code, not only data; it was not loaded") from None
        self.run_name = state["run_name"]  # the metrics go on in the same JSONL (and wandb run)
        self.accelerator.print(f"resumed from {path} at step {state['step']}")
        return state

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
