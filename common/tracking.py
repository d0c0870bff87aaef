"""Metrics to stdout, to <output_dir>/logs/<run_name>.jsonl and to wandb (`--track`), a progress bar and
tables of sample completions, all on the main process."""

import json
import os
import re
import time
from dataclasses import dataclass

import torch
import tyro
from tqdm.auto import tqdm

from common.data import is_conversational, without_nulls


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # --track, not --tracking.track
@dataclass
class TrackingArgs:
    """tracking (common/tracking.py)"""
    run_name: str | None = None
    """name of the run (default: <script>__<seed>__<unix time>)"""
    logging_steps: int = 10
    """print metrics every this many steps (rloo, ppo: rollouts; all steps go to the JSONL file)"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project_name: str = "minimal-post-training"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team or user)"""


class Tracker:
    def __init__(self, accelerator, options: TrackingArgs, *, output_dir: str, config: dict, total_steps: int,
                 start_step: int = 0):
        """config: the flags (saved beside the log); start_step > 0: a resumed run, logged on in the same file
        (from step 0 a run of the same name starts the file again)."""
        self.main, self.every, self.start = accelerator.is_main_process, max(1, options.logging_steps), time.time()
        # disable=None: a progress bar on a terminal only (in a log file each redraw is another line); the metric
        # lines print either way
        self.bar = tqdm(total=total_steps, initial=start_step, disable=None if self.main else True, dynamic_ncols=True)
        self.wandb = None
        if not self.main:
            return
        self.path = os.path.join(output_dir, "logs", f"{options.run_name}.jsonl")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        # drop what was logged after the checkpoint (it is redone), or all of it for a run from step 0: a run of
        # the same name that was interrupted before its first checkpoint and started again logs in a clean file
        if os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= start_step]
            with open(self.path, "w") as f:
                f.writelines(kept)
        with open(os.path.join(os.path.dirname(self.path), f"{options.run_name}.args.json"), "w") as f:
            json.dump(config, f, indent=1)
        if options.track:
            import wandb
            self.wandb = wandb.init(project=options.wandb_project_name, entity=options.wandb_entity,
                                    name=options.run_name, config=config, dir=output_dir,
                                    id=re.sub(r"[^\w.-]", "_", options.run_name), resume="allow")

    def log(self, metrics: dict, step: int):
        """Record `metrics` (floats) at optimizer step `step`; printed every `logging_steps`."""
        if not self.main:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "time": round(time.time() - self.start, 3), **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if step % self.every == 0 or step == self.bar.total:
            self.bar.write(f"step {step}: " + "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

    def log_samples(self, rows: list[dict], step: int, title: str = "samples"):
        """Print a table of sample completions (dicts with the same keys) and send it to wandb; a conversation
        (a list of {"role", "content"} messages) as `role: content` turns, tool calls as their JSON."""
        if not self.main or not rows:
            return
        rows = [{k: " | ".join(f"{m['role']}: {m.get('content') or json.dumps(without_nulls(m.get('tool_calls')))}"
                               for m in v) if is_conversational(v) else v for k, v in row.items()} for row in rows]
        self.bar.write(f"--- {title} at step {step} ---")
        for i, row in enumerate(rows):
            for key, value in row.items():
                text = f"{value:.3f}" if isinstance(value, float) else str(value).replace("\n", " ")
                self.bar.write(f"[{i}] {key:>10}: {text[-300:] if key == 'prompt' else text}")
        if self.wandb is not None:
            import wandb
            self.wandb.log({title: wandb.Table(columns=list(rows[0]), data=[[*r.values()] for r in rows])}, step=step)

    def step(self, n: int = 1):
        self.bar.update(n)

    def close(self):
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def reduce_stats(accelerator, stats: dict, divide_by: float = 1, reduction: str = "mean") -> dict:
    """{name: value here} -> {name: its mean (or sum) over processes / divide_by}, in one collective."""
    values = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=accelerator.device) for v in stats.values()])
    return dict(zip(stats, (accelerator.reduce(values, reduction) / divide_by).tolist()))
