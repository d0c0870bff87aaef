"""Resuming a run (--resume_from_checkpoint): a checkpoint of common/checkpoint.py's loaded on every process, and
no file of it unpickled in full, so that a checkpoint from elsewhere cannot run code: DCP's `.metadata` files are
read first with an unpickler that rebuilds their classes only, and torch's weights-only unpickler loads the rest
(also where accelerate and DeepSpeed would unpickle in full)."""

import os
import pickle
import pkgutil
from unittest import mock

import torch
from accelerate.utils import gather_object

from common.runtime import UserError

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


def resume(ck) -> dict:
    """Load the Checkpointer ck's --resume_from_checkpoint (a directory, or `latest`); the loop state, with "step" and
    "run_name" (the run's, which the checkpointer takes on)."""
    path = ck.resume_from
    if path == "latest":  # the newest on every machine (without a shared file system each lists its own)
        if not (everywhere := set.intersection(*map(set, gather_object([ck.saved()])))):
            raise UserError(f"--resume_from_checkpoint latest: no checkpoint in '{ck.root}'" + (ck.saved() and
                            f" is on every machine (this one has {', '.join(ck.saved())})" or ""))
        path = os.path.join(ck.root, max(everywhere, key=lambda d: int(d[5:])))
    rank_file = os.path.join(path, f"loop_state_{ck.accelerator.process_index}.pt")
    # each rank checks its own files (without a shared file system, another copy): one bad, all ranks stop
    verdicts = gather_object([(os.path.isfile(rank_file), unsafe_metadata(path))])
    if missing := [r for r, (ok, _) in enumerate(verdicts) if not ok]:
        raise UserError(f"'{path}' is not a checkpoint of this script for {ck.accelerator.num_processes} "
                        f"process(es) (no loop_state_{missing[0]}.pt)")
    if bad := next(((r, v) for r, (_, v) in enumerate(verdicts) if v), None):  # before DCP unpickles in full
        by = f", as read by process {bad[0]}" if ck.accelerator.num_processes > 1 else ""
        raise UserError(f"'{path}' {bad[1]}{by}; it was not loaded")
    # no file of a checkpoint may run code: torch's weights-only unpickler also where accelerate (the
    # registered scheduler) and DeepSpeed would unpickle in full
    deepspeed_classes = [pkgutil.resolve_name(c) for c in DEEPSPEED_CLASSES] if ck.engine else []
    try:
        with (mock.patch.dict(os.environ, TORCH_FORCE_WEIGHTS_ONLY_LOAD="1", TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="0"),
              torch.serialization.safe_globals(deepspeed_classes)):
            state = torch.load(rank_file, weights_only=True)
            if state["world_size"] != ck.accelerator.num_processes:
                raise UserError(f"'{path}' was written by {state['world_size']} processes; resume it with as many")
            ck.accelerator.load_state(path)
    except pickle.UnpicklingError:  # torch refused a global or an instruction: not data alone
        raise UserError(f"'{path}' holds pickled code, not only data; it was not loaded") from None
    ck.run_name = state["run_name"]  # the metrics go on in the same JSONL (and wandb run)
    ck.accelerator.print(f"resumed from {path} at step {state['step']}")
    return state
