"""Every script on 2 processes (`ACCELERATE_USE_CPU=true accelerate launch --multi_gpu
--num_processes 2`, gloo) against 1 process with the same global batch (2 micro-batches of
accumulation instead of 2 ranks): the logged losses of the first steps agree to 1e-5. This holds
for the online scripts too, because each completion is sampled with a seed given by its place in
the run, and rollouts are updated in micro-batches drawn from one global shuffle.

Not in the default run (~3 min on 2 cores): `python -m pytest -m multiproc`; .ci/run runs them in one
session with the DeepSpeed and FSDP2 tests, which compare against the same 1-process runs."""

import atexit
import itertools
import os
import shutil
import sys
import tempfile
import time

import pytest
from transformers import AutoModelForCausalLM

from benchmarks import tiny_tldr
from tests.conftest import run_script
from tests.test_sft import read_log

CASES = {  # script: (flags, logged losses to compare); per-device batch sizes fixed, accumulation set below
    "sft": (["--per_device_train_batch_size", "4", "--eval_steps", "2"], ["loss", "eval_loss"]),
    "reward": (["--per_device_train_batch_size", "4", "--eval_steps", "2"], ["loss", "eval_loss"]),
    "dpo": (["--per_device_train_batch_size", "4", "--precompute_ref_logps"], ["loss"]),
    "kto": (["--per_device_train_batch_size", "4"], ["loss", "kl"]),
    "grpo": (["--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
              "--reward_model_paths", "--reward_funcs", "tests.toy_rewards:short", "--num_iterations", "2"], ["loss"]),
    "rloo": (["--per_device_train_batch_size", "2", "--num_mini_batches", "2", "--rloo_k", "2",
              "--max_completion_length", "8", "--reward_model_paths", "--reward_funcs", "tests.toy_rewards:short"],
             ["loss/policy_avg", "objective/kl"]),
    "online_dpo": (["--per_device_train_batch_size", "2", "--max_new_tokens", "8", "--reward_model_paths",
                    "--reward_funcs", "tests.toy_rewards:short"], ["loss", "objective/kl"]),
    "ppo": (["--per_device_train_batch_size", "2", "--num_mini_batches", "2", "--response_length", "8",
             "--local_rollout_forward_batch_size", "4"], ["loss/policy_avg", "loss/value_avg", "objective/kl"]),
    # half the prompts sampled by the student, half the dataset's completions; the teacher: the tiny base model
    "gkd": (["--per_device_train_batch_size", "4", "--max_new_tokens", "8", "--lmbda", "0.5", "--beta", "0.5"],
            ["loss", "objective/kl"]),
}
# reward: its pairwise loss does not change when every score shifts alike (the final layer norm's bias, the
# attention key biases), so the gradient along such a shift is float noise, which Adam turns into steps of
# the learning rate's size; the runs sum their gradients in different orders, and their weights end up to 3e-4
# apart there, the eval loss 4e-5 (the training losses agree to 1e-7)
TOLERANCE = {"reward": 1e-3}
# what these tests leave out to save time (test_deepspeed.py keeps it all on): sample tables, evaluations
QUIET = {"sft": ["--num_sample_generations", "0"], "reward": ["--num_sample_pairs", "0"],
         "dpo": ["--dataset_test_split", ""], "kto": ["--dataset_test_split", ""]}


def model_flags(script, sft_model, rm_model):
    flags = [] if script == "sft" else ["--model_name_or_path", sft_model]
    if script in ("sft", "reward", "dpo", "kto"):  # the offline scripts: whole-split passes
        flags += ["--dataset_name", small_data(tiny_tldr.TINY_SFT_DATA if script == "sft" else
                                               tiny_tldr.TINY_PREFERENCE_DATA)]
    if script == "gkd":  # the SFT model distilled from the tiny base model: they differ, so the loss is not 0
        flags += ["--teacher_model_name_or_path", tiny_tldr.TINY_MODEL]
    return flags + (["--reward_model_path", rm_model] if script == "ppo" else [])


_small_data = {}


def small_data(source: str) -> str:
    """A tiny task's dataset folder cut to 64 training and 16 validation rows (once per session): dpo's
    precomputed reference log-probabilities and the evaluations go over a whole split (~3500 training pairs: 9 of
    the 2-process step's minutes in CI on a slow day, for dpo under ZeRO-2 alone; ~500 validation rows), where
    two steps read 16 rows."""
    if source not in _small_data:
        out = tempfile.mkdtemp(prefix="tiny-tldr-")
        atexit.register(shutil.rmtree, out, True)
        for split, rows in (("train", 64), ("validation", 16)):
            with open(os.path.join(source, f"{split}.jsonl")) as f:
                head = list(itertools.islice(f, rows))
            with open(os.path.join(out, f"{split}.jsonl"), "w") as f:
                f.writelines(head)
        _small_data[source] = out
    return _small_data[source]


TWO_PROCESSES = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                 "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
_one_process = {}


def one_process_run(script, sft_model, rm_model, tmp_path_factory):
    """The reference: 1 process, 2 micro-batches of accumulation, QUIET (once per script and session: the
    DeepSpeed and FSDP2 tests compare against the same runs when .ci/run runs them in one session)."""
    if script not in _one_process:
        out = tmp_path_factory.mktemp(f"one_{script}")
        flags, _ = CASES[script]
        run_script(f"algos/{script}.py", "--max_steps", "2", "--logging_steps", "1",
                   *model_flags(script, sft_model, rm_model),
                   *flags, *QUIET.get(script, []), "--gradient_accumulation_steps", "2", "--output_dir", str(out))
        _one_process[script] = str(out)
    return _one_process[script]


@pytest.mark.multiproc
@pytest.mark.parametrize("script", list(CASES))
def test_two_processes_match_one_process(tmp_path, tmp_path_factory, sft_model, rm_model, script):
    flags, keys = CASES[script]
    common = [f"algos/{script}.py", "--max_steps", "2", "--logging_steps", "1", *QUIET.get(script, []),
              *model_flags(script, sft_model, rm_model), *flags]
    os.environ["ACCELERATE_USE_CPU"] = "true"
    try:
        run_script(*common, "--gradient_accumulation_steps", "1", "--output_dir", str(tmp_path / "two"),
                   launcher=TWO_PROCESSES)
    finally:
        del os.environ["ACCELERATE_USE_CPU"]
    one = one_process_run(script, sft_model, rm_model, tmp_path_factory)
    two, one = read_log(str(tmp_path / "two")), read_log(one)
    assert len(two) == len(one) >= 2
    for a, b in zip(two, one):
        for key in keys:
            if key in a or key in b:
                assert a[key] == pytest.approx(b[key], abs=TOLERANCE.get(script, 1e-5)), (script, key, a[key], b[key])
    print(script, {k: max(abs(a[k] - b[k]) for a, b in zip(two, one) if k in a) for k in keys})
    if script != "reward":
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "two"))


@pytest.mark.multiproc
def test_grpo_dynamic_sampling_two_processes_match_one_process(tmp_path, sft_model):
    """Dynamic sampling decides on the rows of every rank, in global order: 2 processes keep the same groups,
    draw as many rounds and log the same losses as 1 process with 2 micro-batches."""
    common = ["algos/grpo.py", "--max_steps", "2", "--logging_steps", "1", "--model_name_or_path", sft_model,
              "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
              "--reward_model_paths", "--reward_funcs", "tests.toy_rewards:constant_for_odd_prompts",
              "--dynamic_sampling"]
    run_script(*common, "--gradient_accumulation_steps", "1", "--output_dir", str(tmp_path / "two"),
               launcher=TWO_PROCESSES,
               env={**os.environ, "ACCELERATE_USE_CPU": "true"})
    run_script(*common, "--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "one"))
    two, one = read_log(str(tmp_path / "two")), read_log(str(tmp_path / "one"))
    assert len(two) == len(one) == 2 and sum(r["dynamic_sampling/rounds"] for r in one) > 2  # groups were dropped
    for a, b in zip(two, one):
        assert a["dynamic_sampling/rounds"] == b["dynamic_sampling/rounds"] and a["reward"] == b["reward"]
        assert a["frac_reward_zero_std"] == b["frac_reward_zero_std"] == 0.0
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


@pytest.mark.multiproc
@pytest.mark.parametrize("hangs", [False, True], ids=["exits", "hangs"])
def test_a_failure_on_rank_1_alone_is_on_the_console(tmp_path, sft_model, hangs):
    """A reward that fails on rank 1 only: the job ends non-zero with rank 1's error line on the console (it
    used to print on rank 0 only, so nothing was said), also when rank 1 cannot exit after failing: then rank
    0 gives up in its next collective after --ddp_timeout seconds (default 1800) and says why."""
    start = time.time()
    proc = run_script("algos/grpo.py", "--max_steps", "1", "--model_name_or_path", sft_model,
                      "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
                      "--reward_model_paths", "--reward_funcs", "tests.toy_rewards:missing_file_on_rank_1",
                      "--ddp_timeout", "20", "--output_dir", str(tmp_path),
                      launcher=TWO_PROCESSES, check=False, timeout=240,
                      env={**os.environ, "ACCELERATE_USE_CPU": "true",
                           **({"HANG_AFTER_FAILING": "1"} if hangs else {})})
    console = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert ("\n[rank 1] error: reward function 'missing_file_on_rank_1' raised FileNotFoundError: [Errno 2] "
            "No such file "
            "or directory: '/nonexistent/reward_table.json'\n") in console
    if hangs:
        assert "[rank 0] error: RuntimeError: " in console
        assert "this process waited longer than --ddp_timeout for the others: one failed (see its error)" in console
        assert time.time() - start < 20 + 150, time.time() - start


@pytest.mark.multiproc
def test_a_reward_function_that_hangs_on_rank_1_alone_ends_the_job_within_reward_timeout(tmp_path, sft_model):
    """Rank 1's reward function never returns, rank 0 waits for it in the rewards' gather: after --reward_timeout
    (3 s) rank 1 ends with its line, and rank 0, its peer gone, with its own, long before --ddp_timeout (600 s)."""
    start = time.time()
    proc = run_script("algos/grpo.py", "--max_steps", "1", "--model_name_or_path", sft_model,
                      "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "4",
                      "--reward_model_paths", "--reward_funcs", "tests.toy_rewards:hangs_on_rank_1",
                      "--reward_timeout", "3", "--ddp_timeout", "600", "--output_dir", str(tmp_path),
                      launcher=TWO_PROCESSES, check=False, timeout=300,
                      env={**os.environ, "ACCELERATE_USE_CPU": "true"})
    lines = proc.stderr.splitlines()
    assert proc.returncode != 0
    assert "[rank 1] error: reward function 'hangs_on_rank_1' ran past --reward_timeout (3 s)" in lines
    assert any(line.startswith("[rank 0] error: RuntimeError: ") and line.endswith(
        "another process ended first: see its error") for line in lines), proc.stderr[-3000:]
    assert time.time() - start < 150, time.time() - start
