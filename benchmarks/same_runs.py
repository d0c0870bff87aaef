"""Same runs, bit for bit: the check for a refactor that changes nothing but the shape of the code (issue 56).

    python benchmarks/same_runs.py --out before.json --project /tmp/wt_before   # a `git worktree` of the old commit
    python benchmarks/same_runs.py --out after.json                             # this checkout
    python benchmarks/same_runs.py --compare before.json after.json             # "same" per run, or the first change

Runs every script on the tiny task for a few steps (--steps, default 3), each as `python <project>/algos/<x>.py`
with cwd <project> (so a worktree runs its own algos/ and common/), on the CPU with one torch thread, offline, in
a chain: sft from the tiny base model, reward from that sft model, the others from the sft model rewarded by
that reward model (gkd: taught by the tiny base model, as tests/test_multiprocess.py does; grpo with dynamic
sampling: tests.toy_rewards:constant_for_odd_prompts, so that some groups are dropped and redrawn; grpo and rloo
with tools: tests/scripted_episodes.py, the policy's turns scripted, tests.toy_tools:Calculator's reward). Records
each run's logged values, step by step (<output_dir>/logs/<run>.jsonl, the clock's fields left out), and a sha256
of every tensor of its saved *.safetensors. A run that fails is recorded with its error (and compares as a
difference). An sft or reward difference carries into every run after it in the chain.
"""

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

# the JSONL fields that read the wall clock (tests/test_common_checkpoint.py's TIMING_METRICS and any like them)
TIMING = {"time", "eps", "steps_per_second"}


SCORED = {"online_dpo", "grpo", "grpo_iterations2", "rloo", "ppo", "grpo_async"}  # by the reward run's model


def is_timing(key: str) -> bool:
    return key in TIMING or "seconds" in key or key.endswith("_time") or key.startswith("timing/")


def configurations(steps: int, work: str) -> dict[str, list[str]]:
    """name: the command line after `python`, relative to the project (paths under `work` are absolute).
    Listed in chain order: sft, then reward (from sft), then the rest (from sft, scored by reward)."""
    sft, rm, data = f"{work}/out/sft", f"{work}/out/reward", f"{work}/data"
    every = ["--max_steps", str(steps), "--logging_steps", "1"]
    online = ["--model_name_or_path", sft, "--reward_model_paths", rm]
    grpo = ["algos/grpo.py", *online, "--per_device_train_batch_size", "4", "--num_generations", "4",
            "--max_completion_length", "8"]
    rloo = ["--per_device_train_batch_size", "4", "--rloo_k", "2", "--num_mini_batches", "2"]
    tools = ["--model_name_or_path", sft, "--dataset_name", f"{data}/tools", "--reward_model_paths",
             "--environment_factory", "tests.toy_tools:Calculator", "--chat_template_path", f"{data}/tools.jinja",
             "--max_completion_length", "300", "--per_device_train_batch_size", "8"]
    runs = {
        "sft": ["algos/sft.py", "--dataset_name", f"{data}/tldr", "--per_device_train_batch_size", "8",
                "--eval_steps", str(steps), "--num_sample_generations", "0"],
        "reward": ["algos/reward.py", "--model_name_or_path", sft, "--dataset_name", f"{data}/tldr-preference",
                   "--per_device_train_batch_size", "8", "--eval_steps", str(steps), "--num_sample_pairs", "0"],
        **{s: [f"algos/{s}.py", "--model_name_or_path", sft, "--dataset_name", f"{data}/tldr-preference",
               "--per_device_train_batch_size", "4", "--eval_steps", str(steps), "--num_sample_generations", "0"]
           for s in ("dpo", "kto")},
        "online_dpo": ["algos/online_dpo.py", *online, "--per_device_train_batch_size", "4", "--max_new_tokens", "8"],
        "grpo": grpo,
        "grpo_iterations2": [*grpo, "--num_iterations", "2"],
        "grpo_dynamic": [*grpo, "--reward_model_paths", "--reward_funcs", "tests.toy_rewards:constant_for_odd_prompts",
                         "--dynamic_sampling"],
        "rloo": ["algos/rloo.py", *online, *rloo, "--max_completion_length", "8"],
        "ppo": ["algos/ppo.py", "--model_name_or_path", sft, "--reward_model_path", rm, "--per_device_train_batch_size",
                "4", "--num_mini_batches", "2", "--response_length", "8", "--local_rollout_forward_batch_size", "4"],
        "gkd": ["algos/gkd.py", "--model_name_or_path", sft, "--teacher_model_name_or_path", "tiny_tldr/tiny-pythia",
                "--per_device_train_batch_size", "4", "--max_new_tokens", "8", "--lmbda", "0.5"],  # beta: default 1
        "grpo_tools": ["tests/scripted_episodes.py", "grpo", *tools, "--num_generations", "4"],
        "rloo_tools": ["tests/scripted_episodes.py", "rloo", *tools, "--rloo_k", "4"],
        "grpo_async": [*grpo, "--max_staleness", "1"],
    }
    return {name: [*argv, *every, "--run_name", name, "--output_dir", f"{work}/out/{name}"]
            for name, argv in runs.items()}


def prepare(project: str, work: str):
    """The tiny task (built in the project if missing), cut to 64 training and 16 validation rows for the
    offline scripts (tests/test_multiprocess.py's small_data), and tests/test_episodes.py's tools data."""
    if not os.path.exists(os.path.join(project, "tiny_tldr", "VERSION")):
        print("building the tiny task: python benchmarks/tiny_tldr.py", flush=True)
        subprocess.run([sys.executable, "benchmarks/tiny_tldr.py"], cwd=project, check=True, env=environment())
    for name in ("tldr", "tldr-preference"):
        os.makedirs(f"{work}/data/{name}")
        for split, rows in (("train", 64), ("validation", 16)):
            with open(os.path.join(project, "tiny_tldr", name, f"{split}.jsonl")) as f:
                head = [line for _, line in zip(range(rows), f)]
            with open(f"{work}/data/{name}/{split}.jsonl", "w") as f:
                f.writelines(head)
    os.makedirs(f"{work}/data/tools")
    for split in ("train", "validation"):
        with open(f"{work}/data/tools/{split}.jsonl", "w") as f:
            f.writelines(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} * 3 * 2?"}]}) + "\n"
                         for i in range(4))
    with open(os.path.join(project, "configs", "chatml_tools.jinja")) as f:  # turns end in the tiny model's EOS
        template = f.read().replace("<|im_end|>", "<|endoftext|>")
    with open(f"{work}/data/tools.jinja", "w") as f:
        f.write(template)


def environment() -> dict:
    """Offline, no wandb, one thread everywhere, the CPU (tests/conftest.py and the one_torch_thread fixture)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"}


def tensor_hashes(out: str) -> dict[str, str]:
    """sha256 of each saved tensor's dtype, shape and bytes, by name (file:name when there are several files)."""
    import torch
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    hashes = {}
    for file in files:
        with safe_open(os.path.join(out, file), "pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name).contiguous()
                h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)} ".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
                hashes[name if len(files) == 1 else f"{file}:{name}"] = h.hexdigest()
    return hashes


def record(project: str, argv: list[str], out: str, name: str) -> dict:
    start = time.time()
    proc = subprocess.run([sys.executable, *argv], cwd=project, env=environment(), capture_output=True, text=True)
    result = {"argv": argv, "seconds": round(time.time() - start, 1)}
    if proc.returncode != 0:
        return {**result, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-3000:]}"}
    with open(os.path.join(out, "logs", f"{name}.jsonl")) as f:
        result["log"] = [{k: v for k, v in json.loads(line).items() if not is_timing(k)} for line in f]
    result["tensors"] = tensor_hashes(out)
    return result


def git_state(project: str) -> dict:
    """The commit and the files changed beside it (read only), so that a difference can be traced."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=project, capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "changed": git("status", "--porcelain", "--untracked-files=no")}


def run_all(args) -> int:
    project = os.path.abspath(args.project)
    unknown = set(args.only or ()) - set(configurations(args.steps, ""))
    if unknown:
        raise SystemExit(f"error: no configuration {sorted(unknown)}; there are {list(configurations(1, ''))}")
    if args.workdir and os.path.exists(f"{args.workdir}/data"):
        raise SystemExit(f"error: {args.workdir} holds an earlier pass: name an empty --workdir")
    work = os.path.abspath(args.workdir) if args.workdir else tempfile.mkdtemp(prefix="same-runs-")
    runs = configurations(args.steps, work)
    wanted = set(args.only or runs)
    wanted |= {"reward"} if wanted & SCORED else set()
    wanted |= {"sft"} if wanted - {"sft"} else set()  # every run but sft starts from sft's model
    prepare(project, work)
    result = {"project": project, "steps": args.steps, **git_state(project), "runs": {}}
    total = time.time()
    try:
        for name, argv in runs.items():
            if name not in wanted:
                continue
            r = result["runs"][name] = record(project, argv, f"{work}/out/{name}", name)
            status = r.get("error", "").splitlines()[-1:] or [f"{len(r['log'])} steps logged"]
            print(f"{name:>17}: {r['seconds']:6.1f} s  {status[0]}", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = round(time.time() - total, 1)
    print(f"{'total':>17}: {result['seconds']:6.1f} s -> {args.out}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 1 if any("error" in r for r in result["runs"].values()) else 0


def equal(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def first_difference(a: dict, b: dict) -> str | None:
    """None when run a and run b logged the same values and saved the same tensors, else the first difference."""
    if "error" in a or "error" in b:
        return f"failed: {(a.get('error') or b.get('error')).splitlines()[-1]}"
    for i, (x, y) in enumerate(zip(a["log"], b["log"])):
        for key in list(x) + [k for k in y if k not in x]:
            if key not in x or key not in y or not equal(x[key], y[key]):
                values = (str(r.get(key, "(not logged)")) for r in (x, y))
                return f"{key} at step {x.get('step', i + 1)}: " + " != ".join(values)
    if len(a["log"]) != len(b["log"]):
        return f"{len(a['log'])} records logged != {len(b['log'])}"
    for name in sorted(set(a["tensors"]) | set(b["tensors"])):
        if a["tensors"].get(name) != b["tensors"].get(name):
            return f"tensor {name}: " + (f"{str(a['tensors'].get(name))[:12]} != {str(b['tensors'].get(name))[:12]}"
                                         if name in a["tensors"] and name in b["tensors"] else "saved in one run only")
    return None


def compare(path_a: str, path_b: str) -> int:
    with open(path_a) as f:
        a = json.load(f)
    with open(path_b) as f:
        b = json.load(f)
    differ = 0
    for name in list(a["runs"]) + [n for n in b["runs"] if n not in a["runs"]]:
        if name not in a["runs"] or name not in b["runs"]:
            diff = f"run only in {path_a if name in a['runs'] else path_b}"
        else:
            diff = first_difference(a["runs"][name], b["runs"][name])
        differ += diff is not None
        print(f"{name:>17}: {diff or 'same'}")
    print(f"{differ} of {len(set(a['runs']) | set(b['runs']))} differ" if differ else "all same")
    return 1 if differ else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the runs' logged values and tensor hashes here (JSON)")
    parser.add_argument("--project", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the checkout whose scripts run (default: this one)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--only", nargs="+", help="these configurations (and the sft / reward runs they start from)")
    parser.add_argument("--workdir", help="keep the runs' data and outputs here (default: a temporary folder)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --out files; exit 1 if any differs")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        parser.error("give --out FILE (to run) or --compare A B")
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
