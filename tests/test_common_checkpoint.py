"""Checkpoints, resume, interruption, determinism and non-finite values (common/checkpoint.py).

For every script: a run stopped by SIGTERM saves a checkpoint and exits non-zero with one line, and
resuming it ends with weights bit-identical to an uninterrupted run and the same metrics JSONL
(timing fields aside). That also makes each script repeat itself: the stopped run is the same command
started afresh, so its steps before the stop must log what the uninterrupted run logged. sft under
gradient accumulation runs in the default suite; every script as CASES runs it, grpo under
accumulation, and sft resumed on two machines of one process each without a shared file system (two
launches on this host), under the `resume` marker (`python -m pytest -m resume`, ~6 min; .ci/run runs
them). Also: checkpoint files whose pickles would run code are refused, and the checkpoint folders of
two machines simulated by threads, with and without a shared file system."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from algos import sft
from common.checkpoint import CheckpointArgs, Checkpointer
from common import resume as resuming
from common.resume import unsafe_metadata
from common.runtime import UserError
from tests.conftest import ROOT, run_script, script_args
from tests.test_multiprocess import CASES, model_flags

# the JSONL fields that read the wall clock; the rest repeats for the same seed and command on a CPU
TIMING_METRICS = ("time", "steps_per_second", "eps", "vllm/push_seconds", "async/trainer_wait_seconds",
                  "async/sampler_wait_seconds")

STEPS = 6


def argv(script, out, models, *extra):
    (sft_model, rm_model), (flags, _) = models, CASES[script]
    if "--reward_funcs" in extra:  # extra's reward function replaces the case's
        i = flags.index("--reward_funcs")
        flags = flags[:i] + flags[i + 2:]
    quiet = ["--dataset_test_split", ""] if script in ("sft", "reward") else []  # no evaluation passes
    return [f"algos/{script}.py", "--max_steps", str(STEPS), "--logging_steps", "1", "--run_name", "r", *quiet,
            *model_flags(script, sft_model, rm_model), *flags, "--output_dir", str(out), *extra]


def records(out):
    """The run's metrics JSONL without the fields that read the clock."""
    with open(os.path.join(out, "logs", "r.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_METRICS} for line in f]


def weights(out):
    return load_file(os.path.join(out, "model.safetensors"))


# besides every script as CASES runs it: an offline (default suite) and an online script (`resume`) under
# gradient accumulation 2 (the data position and the accumulated micro-batches must resume exactly);
# grpo also with 2 iterations per generation batch (a stop between them), a KL term and a reward
# function that leaves some completions unscored
ACCUMULATION = ["--gradient_accumulation_steps", "2"]
GRPO_HARD = [*ACCUMULATION, "--beta", "0.1", "--reward_funcs", "tests.toy_rewards:short_or_none"]
VARIANTS = [pytest.param(s, [], marks=pytest.mark.resume, id=s) for s in CASES] + [
    pytest.param("sft", ACCUMULATION, id="sft-accumulation"),
    pytest.param("grpo", GRPO_HARD, marks=pytest.mark.resume, id="grpo-accumulation"),
    # asynchronous rollouts: the batch in flight goes into the checkpoint and is taken as it was drawn
    *[pytest.param(s, ["--max_staleness", "1"], marks=pytest.mark.resume, id=f"{s}-async") for s in ("grpo", "rloo")]]


@pytest.mark.parametrize("script, extra", VARIANTS)
def test_sigterm_then_resume_equals_an_uninterrupted_run(tmp_path, sft_model, rm_model, script, extra):
    models = (sft_model, rm_model)
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_script(*argv(script, full, models, *extra))
    assert len([r for r in records(full) if "lr" in r]) == STEPS

    proc = subprocess.Popen([sys.executable, *argv(script, cut, models, *extra)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    log, deadline = cut / "logs" / "r.jsonl", time.time() + 300
    while not (log.exists() and log.read_text().strip()) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # after the first logged step: the run finishes its current step
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr
    [line] = [x for x in stdout.splitlines() if x.startswith("stopped by SIGTERM")]
    stopped_at = int(line.split("after step ")[1].split(";")[0])
    assert 1 <= stopped_at < STEPS and line.endswith("continue with --resume_from_checkpoint latest")
    assert os.listdir(cut / "checkpoints") == [f"step_{stopped_at}"] and not (cut / "config.json").exists()

    resumed = run_script(*argv(script, cut, models, *extra, "--resume_from_checkpoint", "latest"))
    assert f"resumed from {cut / 'checkpoints' / f'step_{stopped_at}'} at step {stopped_at}" in resumed.stdout
    a, b = weights(full), weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical
    assert records(cut) == records(full)
    if script == "grpo":  # num_iterations 2: a checkpoint after step 1 holds the half-used generation batch
        mid = tmp_path / "mid"
        run_script(*argv(script, mid, models, *extra, "--save_steps", "1", "--save_total_limit", "9"))
        run_script(*argv(script, mid, models, *extra, "--resume_from_checkpoint", str(mid / "checkpoints" / "step_1"),
                         "--overwrite_output_dir"))
        b = weights(mid)
        assert all(torch.equal(a[k], b[k]) for k in a) and records(mid) == records(full)
    if extra == GRPO_HARD:  # the unscored completions were there, and were left out rather than scored 0
        assert 0 < max(r["completions/unscored_ratio"] for r in records(full)) < 1
    print(script, "stopped after step", stopped_at, "of", STEPS)


def sft_args(tmp_path, **kw):
    return script_args(sft.Args, **{**dict(max_steps=4, per_device_train_batch_size=2, dataset_test_split="",
                                           logging_steps=1, run_name="r", output_dir=str(tmp_path / "out")), **kw})


def test_a_resumed_run_logs_on_under_its_own_name(tmp_path):
    """Without --run_name a run is named by the clock; resumed later, it goes on in the same JSONL."""
    sft.main(sft_args(tmp_path, run_name=None, save_steps=2))
    time.sleep(1.1)  # a new run started now would get another name
    sft.main(sft_args(tmp_path, run_name=None, overwrite_output_dir=True,
                      resume_from_checkpoint=str(tmp_path / "out" / "checkpoints" / "step_2")))
    [log] = [f for f in os.listdir(tmp_path / "out" / "logs") if f.endswith(".jsonl")]
    assert log.startswith("sft__1__")
    with open(tmp_path / "out" / "logs" / log) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]  # 3 and 4 redone once, not twice


def nan_on_call(monkeypatch, n):
    """Make sft's loss NaN on its n-th call (1-based) and only then."""
    calls, loss = [0], sft.sft_loss

    def patched(*a, **k):
        calls[0] += 1
        return loss(*a, **k) * (float("nan") if calls[0] == n else 1.0)
    monkeypatch.setattr(sft, "sft_loss", patched)


def test_nonfinite_loss_stops_after_saving_the_last_good_weights(tmp_path, monkeypatch):
    clean = tmp_path / "clean"
    sft.main(sft_args(tmp_path, save_steps=2, output_dir=str(clean)))  # the same run without NaN, saved at step 2
    nan_on_call(monkeypatch, 3)
    with pytest.raises(UserError, match=r"step 3: non-finite loss \(nan\); the update was dropped and the last good "
                                        r"weights, untouched by it, saved in .*step_3; lower --learning_rate"):
        sft.main(sft_args(tmp_path))
    good = load_file(os.path.join(clean, "checkpoints", "step_2", "model.safetensors"))
    saved = load_file(os.path.join(tmp_path, "out", "checkpoints", "step_3", "model.safetensors"))
    assert good.keys() == saved.keys() and all(torch.equal(good[k], saved[k]) for k in good)  # step 3 changed nothing
    assert not (tmp_path / "out" / "config.json").exists()


def test_skip_nonfinite_steps_drops_only_that_update(tmp_path, monkeypatch):
    nan_on_call(monkeypatch, 3)
    sft.main(sft_args(tmp_path, skip_nonfinite_steps=True))
    rows = records(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] != r["loss"] for r in rows] == [False, False, True, False]  # NaN logged at step 3 only
    assert all(torch.isfinite(v).all() for v in weights(tmp_path / "out").values())


def test_checkpoints_are_pruned_and_never_half_written(tmp_path):
    sft.main(sft_args(tmp_path, save_steps=1, save_total_limit=2))
    assert sorted(os.listdir(tmp_path / "out" / "checkpoints")) == ["step_3", "step_4"]


def test_output_dir_of_a_finished_or_unfinished_run_is_not_reused_by_accident(tmp_path):
    sft.main(sft_args(tmp_path, max_steps=1, save_steps=1))
    before = weights(tmp_path / "out")
    with pytest.raises(UserError, match="already holds a finished model; pass --overwrite_output_dir"):
        sft.main(sft_args(tmp_path, max_steps=1))
    os.remove(tmp_path / "out" / "config.json")  # as if that run had been interrupted
    with pytest.raises(UserError, match="holds checkpoints of an unfinished run; continue it with "
                                        "--resume_from_checkpoint latest"):
        sft.main(sft_args(tmp_path, max_steps=1))
    with pytest.raises(UserError, match="no checkpoint in"):
        sft.main(sft_args(tmp_path, output_dir=str(tmp_path / "empty"), resume_from_checkpoint="latest"))
    sft.main(sft_args(tmp_path, max_steps=2, overwrite_output_dir=True, learning_rate=1e-2))
    after = weights(tmp_path / "out")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert not (tmp_path / "out" / "checkpoints").exists()  # the old run's checkpoints went with it


def test_tr_dpo_reference_is_part_of_the_checkpoint(tmp_path, sft_model):
    """TR-DPO moves the reference every step: resuming from step 2 must bring back the moved one, not the
    reference loaded from disk (which would change the step 3-4 losses and the final weights)."""
    from algos import dpo

    def args(out, **kw):
        return script_args(dpo.Args, model_name_or_path=sft_model, max_steps=4, per_device_train_batch_size=4,
                           dataset_test_split="", sync_ref_model=True, ref_model_sync_steps=1,
                           ref_model_mixup_alpha=0.5, learning_rate=1e-3, logging_steps=1, run_name="r",
                           output_dir=str(out), **kw)
    dpo.main(args(tmp_path / "full", save_steps=2))
    os.makedirs(tmp_path / "cut" / "logs")
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_2", tmp_path / "cut" / "checkpoints" / "step_2")
    shutil.copy(tmp_path / "full" / "logs" / "r.jsonl", tmp_path / "cut" / "logs" / "r.jsonl")
    dpo.main(args(tmp_path / "cut", resume_from_checkpoint="latest"))
    a, b = weights(tmp_path / "full"), weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert records(tmp_path / "cut") == records(tmp_path / "full")


class WritesAFile:
    """Pickled, it is a call of open(path, "w"), made when it is unpickled: what a crafted checkpoint could run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("name", ["loop_state_0.pt", "custom_checkpoint_0.pkl"])  # the loop's state, the scheduler's
def test_a_checkpoint_whose_pickle_would_run_code_is_not_loaded(tmp_path, name):
    """A checkpoint someone else made must not run code when resumed: one of its files, rewritten to hold
    besides its data an object whose unpickling writes a file, stops the run with one line, nothing written."""
    sft.main(sft_args(tmp_path, max_steps=1, save_steps=1))
    step, written = tmp_path / "out" / "checkpoints" / "step_1", tmp_path / "written"
    torch.save({**torch.load(step / name, weights_only=True), "extra": WritesAFile(str(written))}, step / name)
    with pytest.raises(UserError) as error:
        sft.main(sft_args(tmp_path, output_dir=str(tmp_path / "new"), resume_from_checkpoint=str(step)))
    assert str(error.value) == f"'{step}' holds pickled code, not only data; it was not loaded"
    assert not written.exists() and not (tmp_path / "new").exists()


class StandInRank:
    """One of 4 processes on 2 machines (ranks 0-1 and 2-3), run as a thread: the accelerator's part in the
    Checkpointer (save_state writes this rank's RNG file, as accelerate does; load_state notes the folder)."""

    def __init__(self, index, barrier, board):
        self.process_index, self.num_processes, self.barrier, self.board = index, 4, barrier, board
        self.is_main_process, self.is_local_main_process = index == 0, index % 2 == 0
        self.state, self.loaded = types.SimpleNamespace(deepspeed_plugin=None), None

    def wait_for_everyone(self):
        self.barrier.wait()

    def gather_object(self, items):  # as accelerate's: every rank's list, joined in rank order
        self.board[self.process_index] = items
        self.barrier.wait()
        joined = [x for rank in range(self.num_processes) for x in self.board[rank]]
        self.barrier.wait()  # every rank has read the board before it is written again
        return joined

    def register_for_checkpointing(self, obj):
        pass

    def save_state(self, path):
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, f"random_states_{self.process_index}.pkl"), "w").close()

    def load_state(self, path):
        self.loaded = path

    def print(self, *args):
        pass


def on_two_machines(tmp_path, monkeypatch, shared, work, **kw):
    """`work(checkpointer, rank)` on each of the 4 stand-in ranks (a Checkpointer of output_dir <tmp>/shared,
    or <tmp>/machine<m> without a shared file system); per rank what it returned or raised."""
    barrier, board, this = threading.Barrier(4, timeout=20), {}, threading.local()
    monkeypatch.setattr(resuming, "gather_object", lambda items: this.rank.gather_object(items))
    # resume() sets these around its loads in each thread: so that the last to restore them restores these
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0")

    def rank(i):
        this.rank = StandInRank(i, barrier, board)
        output_dir = str(tmp_path / ("shared" if shared else f"machine{i // 2}"))
        try:
            options = CheckpointArgs(**{"save_steps": 1, "save_total_limit": 2, **kw})
            return work(Checkpointer(this.rank, None, options, output_dir=output_dir, run_name="r"), this.rank)
        except UserError as e:
            return e

    with ThreadPoolExecutor(4) as pool:
        return [f.result() for f in [pool.submit(rank, i) for i in range(4)]]


def saving(*steps):
    return lambda ck, rank: [ck.save(step, {}) for step in steps] and ck.saved()


@pytest.mark.parametrize("shared", [True, False])
def test_checkpoints_on_two_machines_with_or_without_a_shared_file_system(tmp_path, monkeypatch, shared):
    """Without a shared file system each machine must end with its own complete, pruned step_<n>, holding
    its ranks' files (what --resume_from_checkpoint latest finds there), not a never-renamed .partial; and
    another run's checkpoints left on any machine go when a new run starts (else they would be kept, and
    the new ones pruned in their place)."""
    machines = {"shared": range(4)} if shared else {"machine0": (0, 1), "machine1": (2, 3)}
    for root in machines:
        for old in ("step_7", "step_8"):
            os.makedirs(tmp_path / root / "checkpoints" / old)
    assert on_two_machines(tmp_path, monkeypatch, shared, saving(1, 2, 3)) == [["step_2", "step_3"]] * 4
    for root, ranks in machines.items():
        assert sorted(os.listdir(tmp_path / root / "checkpoints")) == ["step_2", "step_3"]
        assert sorted(os.listdir(tmp_path / root / "checkpoints" / "step_3")) == sorted(
            f"{kind}_{r}.{ext}" for r in ranks for kind, ext in (("loop_state", "pt"), ("random_states", "pkl")))


def test_latest_is_the_newest_checkpoint_on_every_machine(tmp_path, monkeypatch):
    """Without a shared file system machine 1 may lack the newest checkpoint (stopped before renaming it):
    `latest` must then be the newest step both machines hold, on every rank (else each would load its own
    step, with other weights); with no step in common, every rank stops with one line."""
    on_two_machines(tmp_path, monkeypatch, False, saving(1, 2, 3), save_total_limit=3)
    shutil.rmtree(tmp_path / "machine1" / "checkpoints" / "step_3")  # machine 0: steps 1-3, machine 1: 1-2

    def resume(ck, rank):
        return resuming.resume(ck)["step"], rank.loaded
    assert on_two_machines(tmp_path, monkeypatch, False, resume, resume_from_checkpoint="latest") == [
        (2, str(tmp_path / f"machine{i // 2}" / "checkpoints" / "step_2")) for i in range(4)]
    for step in ("step_1", "step_2"):
        shutil.rmtree(tmp_path / "machine0" / "checkpoints" / step)  # machine 0: step 3, machine 1: 1-2
    errors = on_two_machines(tmp_path, monkeypatch, False, resume, resume_from_checkpoint="latest")
    assert all(isinstance(e, UserError) for e in errors)
    checkpoints = tmp_path / "machine0" / "checkpoints"
    assert str(errors[0]) == (f"--resume_from_checkpoint latest: no checkpoint in '{checkpoints}'"
                              " is on every machine (this one has step_3)")


@pytest.mark.resume
def test_two_machines_without_a_shared_file_system_resume_from_the_same_step(tmp_path):
    """Two machines of one process each (two launches on this host, gloo), each with its own output_dir as
    without a shared file system. Each keeps its own checkpoints; accelerate writes the model, optimizer and
    scheduler on machine 0 only, so machine 0's step folder is copied over machine 1's (docs/checkpoints.md), with the
    newest step on machine 0 alone; `latest` must then resume both from the step both hold, and end where
    an uninterrupted run ended."""
    import socket

    import psutil  # accelerate's dependency

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])

    def on_both(*outs_and_extra):
        procs = [subprocess.Popen(
            [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2", "--machine_rank",
             str(m), "--num_processes", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", port,
             "--mixed_precision", "no", "--dynamo_backend", "no",
             "algos/sft.py", "--max_steps", "4", "--save_steps", "2", "--dataset_test_split", "",
             "--logging_steps", "1", "--run_name", "r", "--output_dir", str(out), *extra],
            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "ACCELERATE_USE_CPU": "true"}) for m, (out, *extra) in enumerate(outs_and_extra)]
        try:
            outputs = [p.communicate(timeout=300) for p in procs]
        finally:  # machines that disagree wait on each other for ever: end both launchers and their workers
            for p in procs:
                for child in psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []:
                    child.kill()
                p.kill()
        assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for _, e in outputs]
        return [o for o, _ in outputs]

    full = [tmp_path / "full0", tmp_path / "full1"]
    on_both((full[0],), (full[1],))
    assert sorted(os.listdir(full[1] / "checkpoints" / "step_4")) == ["loop_state_1.pt", "random_states_1.pkl"]
    cut = [tmp_path / "cut0", tmp_path / "cut1"]
    for step in ("step_2", "step_4"):
        shutil.copytree(full[0] / "checkpoints" / step, cut[0] / "checkpoints" / step)
    shutil.copytree(full[1] / "checkpoints" / "step_2", cut[1] / "checkpoints" / "step_2")
    shutil.copytree(full[0] / "checkpoints" / "step_2", cut[1] / "checkpoints" / "step_2", dirs_exist_ok=True)
    shutil.copytree(full[0] / "logs", cut[0] / "logs")
    outputs = on_both(*[(out, "--resume_from_checkpoint", "latest") for out in cut])
    for out, stdout in zip(cut, outputs):
        assert f"resumed from {out / 'checkpoints' / 'step_2'} at step 2" in stdout
    a, b = weights(full[0]), weights(cut[0])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert records(cut[0]) == records(full[0])


def test_steps_past_9_are_ordered_by_number_when_pruned_and_resumed(tmp_path, monkeypatch):
    """step_10 sorts before step_9 as a string: the newest --save_total_limit must be kept by number, and
    `latest` must be step_11, not step_9 (the bigger string)."""
    kept = on_two_machines(tmp_path, monkeypatch, True, saving(2, 9, 10, 11), save_total_limit=3)
    assert kept == [["step_9", "step_10", "step_11"]] * 4
    assert sorted(os.listdir(tmp_path / "shared" / "checkpoints")) == ["step_10", "step_11", "step_9"]

    def resume(ck, rank):
        return resuming.resume(ck)["step"], rank.loaded
    assert on_two_machines(tmp_path, monkeypatch, True, resume, resume_from_checkpoint="latest") == [
        (11, str(tmp_path / "shared" / "checkpoints" / "step_11"))] * 4


def dcp_checkpoint(path):
    """The two DCP folders accelerate writes for an FSDP2 model (SHARDED_STATE_DICT), in one process: a model's
    weights, and its AdamW state after a step (tensors, and plain values such as lr and betas)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    for name, state in (("pytorch_model_fsdp_0", {"model": get_model_state_dict(model)}),
                        ("optimizer_0", {"optimizer": get_optimizer_state_dict(model, optimizer)})):
        dcp.save(state, checkpoint_id=path / name, no_dist=True)
    return model


class Runs:
    """Pickled, a call of `function(*args)` made when it is unpickled."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def crafted(marker):
    """Ways a `.metadata` file could write `marker` when unpickled: a shell command, Python code, torch functions
    (the last one changes torch's default dtype instead, a global of module `torch`, where dtypes are admitted)."""
    return {"os.system": Runs(os.system, f"touch '{marker}'"),
            "exec": Runs(exec, f"open({str(marker)!r}, 'w').close()"), "torch.save": Runs(torch.save, {}, str(marker)),
            "torch.set_default_dtype": Runs(torch.set_default_dtype, torch.float64)}


ONE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as meant


@ONE_PROCESS
@pytest.mark.parametrize("how", ["os.system", "exec", "torch.save", "torch.set_default_dtype"])
def test_dcp_metadata_that_would_run_code_is_refused(tmp_path, how):
    """accelerate loads an FSDP2 checkpoint through torch.distributed.checkpoint, whose reader unpickles each
    `.metadata` in full: a real one (model and optimizer) passes the check and loads; one holding besides its
    metadata a call that writes a file is refused with nothing run; so is a damaged one."""
    import torch.distributed.checkpoint as dcp

    model, marker = dcp_checkpoint(tmp_path), tmp_path / "marker"
    assert unsafe_metadata(str(tmp_path)) is None
    state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=tmp_path / "pytorch_model_fsdp_0", no_dist=True)
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    file = tmp_path / "pytorch_model_fsdp_0" / ".metadata"
    with open(file, "rb") as f:
        metadata = pickle.load(f)  # the test's own file
    metadata.planner_data = crafted(marker)[how]  # the real metadata, and a call among its fields
    with open(file, "wb") as f:
        pickle.dump(metadata, f)
    called = {"os.system": f"{os.system.__module__}.system", "exec": "builtins.exec",  # posix.system on Linux
              "torch.save": "torch.serialization.save"}.get(how, how)  # a module whose _get_layout is admitted
    try:
        assert unsafe_metadata(str(tmp_path)) == (
            f"holds pickled code, not only data (pytorch_model_fsdp_0/.metadata calls {called})")
        assert not marker.exists() and torch.get_default_dtype() == torch.float32
    finally:
        torch.set_default_dtype(torch.float32)
    file.write_bytes(file.read_bytes()[:100])
    assert unsafe_metadata(str(tmp_path)) == ("is damaged (pytorch_model_fsdp_0/.metadata: UnpicklingError: "
                                                         "pickle data was truncated)")


@ONE_PROCESS
def test_dcp_metadata_that_would_run_code_on_one_machine_stops_every_rank(tmp_path, monkeypatch):
    """Without a shared file system machine 1's copy of the checkpoint may be the crafted one: every rank must
    stop with the same line before loading anything (a rank going on to load would wait for the others forever)."""
    on_two_machines(tmp_path, monkeypatch, False, saving(1))
    for m in (0, 1):
        dcp_checkpoint(tmp_path / f"machine{m}" / "checkpoints" / "step_1")
    marker, file = tmp_path / "marker", tmp_path / "machine1" / "checkpoints" / "step_1" / "optimizer_0" / ".metadata"
    with open(file, "wb") as f:
        pickle.dump(crafted(marker)["os.system"], f)

    def resume(ck, rank):
        return resuming.resume(ck), rank.loaded
    errors = on_two_machines(tmp_path, monkeypatch, False, resume, resume_from_checkpoint="latest")
    assert [str(e) for e in errors] == [
        f"'{tmp_path / f'machine{i // 2}' / 'checkpoints' / 'step_1'}' holds pickled code, not only data (optimizer_0/"
        f".metadata calls {os.system.__module__}.system), as read by process 2; it was not loaded" for i in range(4)]
    assert not marker.exists()
