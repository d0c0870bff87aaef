"""Runs a script as `python algos/X.py <flags>` would (argv: a folder for its records, the script, its flags),
launched by tests/test_deepspeed.py and tests/test_fsdp.py on 2 sharded processes, and records on each rank, in
<folder>/rank<r>.json (rewritten after each event: the scripts leave through os._exit):
- `generation`: per `unwrapped_for_generation` context (sample tables, rollouts), how many module forwards this
  rank ran in it, and per part of the model (ppo: policy, value_model) the most parameter elements whole at
  once during them (gathered: all; decoded sharded: at most a layer's, `largest_layer`), beside its elements;
- `frozen`: per frozen model (`prepare_frozen`), the bytes of its parameters on this rank and whole, and at each
  logged step how many of its parameters are still alive (weak references: freed ones are gone)."""

import json
import os
import runpy
import sys
import weakref
from contextlib import contextmanager

from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project, as for algos/X.py
import common.generation  # noqa: E402
import common.models  # noqa: E402
import common.tracking  # noqa: E402

folder, script, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
rank = int(os.environ.get("RANK", 0))
records = {"generation": [], "frozen": []}
refs = []  # per frozen model: weak references to its parameters


def save():
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(records, f)


def whole(p) -> bool:
    """A ZeRO-3 parameter gathered (its data the full size) or an FSDP2 one unsharded (a plain tensor)."""
    return p.data.numel() == p.ds_numel if hasattr(p, "ds_numel") else not isinstance(p, DTensor)


original_context = common.generation.unwrapped_for_generation


@contextmanager
def recorded_context(accelerator, model, *args, **kwargs):
    full = accelerator.unwrap_model(model)
    part_of = (lambda name: name.split(".")[0]) if hasattr(full, "value_model") else (lambda name: "model")
    params = [(part_of(name), p) for name, p in full.named_parameters()]
    size = lambda p: p.ds_numel if hasattr(p, "ds_numel") else p.numel()  # noqa: E731
    kinds = set(getattr(full, "_no_split_modules", None) or [])
    layers = [m for m in full.modules() if type(m).__name__.removeprefix("FSDP") in kinds]  # FSDP2 renames classes
    record = {"forwards": 0, "whole_peak": {part: 0 for part, _ in params},
              "elements": {part: sum(size(p) for q, p in params if q == part) for part, _ in params},
              "largest_layer": max(sum(size(p) for p in m.parameters()) for m in layers)}
    in_layers = {id(p) for m in layers for p in m.parameters()}
    record["outside_layers"] = {part: sum(size(p) for q, p in params if q == part and id(p) not in in_layers)
                                for part, _ in params}

    def look(*_):
        record["forwards"] += 1
        now_params = [(part_of(name), p) for name, p in full.named_parameters()]  # FSDP2 swaps them as it gathers
        for part in record["whole_peak"]:
            now = sum(size(p) for q, p in now_params if q == part and whole(p))
            record["whole_peak"][part] = max(record["whole_peak"][part], now)

    hooks = [h for m in full.modules() for h in (m.register_forward_pre_hook(look), m.register_forward_hook(look))]
    try:
        with original_context(accelerator, model, *args, **kwargs) as unwrapped:
            yield unwrapped
    finally:
        for h in hooks:
            h.remove()
        records["generation"].append(record)
        save()


original_prepare = common.models.prepare_frozen


def recorded_prepare(accelerator, model):
    model = original_prepare(accelerator, model)
    here, whole_bytes = common.models.rank_bytes(model)
    records["frozen"].append({"bytes_here": here, "bytes_whole": whole_bytes, "alive_at_steps": {}})
    refs.append([weakref.ref(p) for p in model.parameters()])
    save()
    return model


original_log = common.tracking.Tracker.log


def recorded_log(self, metrics, step):
    for record, kept in zip(records["frozen"], refs):
        record["alive_at_steps"][step] = sum(r() is not None for r in kept)
    save()
    return original_log(self, metrics, step)


common.generation.unwrapped_for_generation = recorded_context
common.models.prepare_frozen = recorded_prepare
common.tracking.Tracker.log = recorded_log
sys.argv = [script, *flags]
runpy.run_path(script, run_name="__main__")
