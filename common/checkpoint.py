"""Saving a model the `from_pretrained` way, so that an interrupted save never leaves a broken one."""

import os
import shutil


def save_model(accelerator, model, tokenizer, output_dir: str, part: str | None = None):
    """Write model + tokenizer into a temp dir inside `output_dir`, then move each file into place
    with an atomic rename: a reader (or a crash) sees either the old file or the new one, never a
    half-written one. Called on every process (a sharded model is gathered collectively). `part`:
    save only this submodule (PPO's policy). With LoRA, only the adapters are written."""
    state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards; all ranks take part
    unwrapped = accelerator.unwrap_model(model)
    if part:
        unwrapped = getattr(unwrapped, part)
        state_dict = {k.removeprefix(part + "."): v for k, v in state_dict.items() if k.startswith(part + ".")}
    if accelerator.is_main_process:
        tmp = os.path.join(output_dir, ".saving")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        unwrapped.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
        os.rmdir(tmp)
    accelerator.wait_for_everyone()
