"""benchmarks/run_tiny_tldr.py and its evaluation: the KL estimator against hand computations, and the
whole job in quick mode."""

import glob
import importlib
import itertools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch
import tyro

from benchmarks import run_tiny_tldr, study_tiny_tldr, tiny_tldr
from benchmarks.tiny_tldr_eval import load_checkpoint, sequence_kl
from common.generation import Samples
from tests.conftest import FixedLogits, run_script
from tests.test_sft import read_log

# next-token distributions over a 3-token vocabulary that depend only on the current token (row)
P = [[0.1, 0.2, 0.7], [0.5, 0.25, 0.25], [0.6, 0.3, 0.1]]
Q = [[0.3, 0.3, 0.4], [0.2, 0.6, 0.2], [0.6, 0.2, 0.2]]


def fixed(table):
    return FixedLogits(torch.log(torch.tensor(table)))


def test_sequence_kl_sums_log_ratios_over_completion_tokens():
    # prompts [2] (left-padded; pad id 1) and [0, 1]; completions 0 1 2 and 1 1 (then padding)
    prompt_ids, prompt_mask = torch.tensor([[1, 2], [0, 1]]), torch.tensor([[0, 1], [1, 1]])
    completion_ids, completion_mask = torch.tensor([[0, 1, 2], [1, 1, 1]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    samples = Samples(prompt_ids, prompt_mask, completion_ids, completion_mask, finished=None)
    kl = sequence_kl(fixed(P), fixed(Q), samples)
    # by hand: each token's log P(y | previous token) - log Q(y | previous token)
    first = math.log(P[2][0] / Q[2][0]) + math.log(P[0][1] / Q[0][1]) + math.log(P[1][2] / Q[1][2])
    second = math.log(P[1][1] / Q[1][1]) + math.log(P[1][1] / Q[1][1])
    assert kl.tolist() == pytest.approx([first, second], abs=1e-6)
    assert sequence_kl(fixed(P), fixed(P), samples).abs().max() < 1e-6


def test_sequence_kl_mean_over_samples_estimates_the_exact_kl():
    # exact KL(P || Q) of 3-token sequences after token 2, by enumerating all 27 of them
    def prob(table, seq):
        return math.prod(table[prev][y] for prev, y in zip((2,) + seq, seq))
    exact = sum(prob(P, s) * math.log(prob(P, s) / prob(Q, s)) for s in itertools.product(range(3), repeat=3))
    # Monte Carlo: sequences sampled from P, as the evaluation samples from the policy
    generator, n = torch.Generator().manual_seed(0), 20000
    tokens, current = [], torch.full((n,), 2)
    for _ in range(3):
        current = torch.multinomial(torch.tensor(P)[current], 1, generator=generator).squeeze(1)
        tokens.append(current)
    completion_ids = torch.stack(tokens, 1)
    samples = Samples(torch.full((n, 1), 2), torch.ones(n, 1, dtype=torch.long), completion_ids,
                      torch.ones_like(completion_ids), finished=None)
    kl = sequence_kl(fixed(P), fixed(Q), samples, batch_size=5000)
    assert abs(kl.mean().item() - exact) < 4 * kl.std().item() / math.sqrt(n)
    assert exact > 0.1  # the two tables differ enough for the check to mean something


@pytest.mark.parametrize("prefix", ["", "policy."], ids=["policy", "ppo"])
def test_load_checkpoint_puts_the_checkpoints_weights_into_the_saved_policy(prefix, tiny_model, tokenizer, tmp_path):
    # a checkpoint is accelerate's save_state of the prepared model: PPO's holds policy.* and value_model.*;
    # the loaded policy must have the checkpoint's weights, not the final model's (issue 27, the frontier)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(tiny_model)
    final.save_pretrained(tmp_path / "run")
    tokenizer.save_pretrained(tmp_path / "run")
    earlier = {k: v + 0.5 for k, v in final.state_dict().items()}
    state = {prefix + k: v.clone() for k, v in earlier.items()}
    if prefix:  # the value model's weights, not the policy's
        state.update({"value_model." + k: torch.zeros_like(v) for k, v in earlier.items()})
    os.makedirs(tmp_path / "run" / "checkpoints" / "step_3")
    save_file(state, str(tmp_path / "run" / "checkpoints" / "step_3" / "model.safetensors"))
    loaded = load_checkpoint(str(tmp_path / "run"), str(tmp_path / "run" / "checkpoints" / "step_3")).state_dict()
    assert loaded.keys() == earlier.keys()
    assert all(torch.equal(loaded[k], earlier[k]) for k in earlier)


class Launched(Exception):
    """Raised in place of the report, once every stage has been started."""


def launched(monkeypatch, command, args_class, flags):
    """(command line, environment) of every stage that `command`'s main() starts, in the order it starts
    them; each stage "finishes" at once and nothing is trained."""
    started = []

    class Finished:  # stands in for subprocess.Popen: a stage that is already done
        returncode = 0

        def __init__(self, cmd, stdout=None, stderr=None, env=None):
            started.append((cmd, env))

        def poll(self):
            return 0

    monkeypatch.setattr(run_tiny_tldr.subprocess, "Popen", Finished)
    waits = itertools.count()

    def sleep(seconds):  # the scheduler's wait; a stage whose inputs never come would wait forever
        assert next(waits) < 10_000, f"stages never started: {len(started)} of them did"

    def report(*args, **kwargs):
        raise Launched

    monkeypatch.setattr(run_tiny_tldr.time, "sleep", sleep)
    monkeypatch.setattr(command, "report", report)
    with pytest.raises(Launched):
        command.main(tyro.cli(args_class, args=flags))
    return started


def chain(started, run_dir):
    """The stages that write into `run_dir` (one seed's chain and its evaluations), with `run_dir` and the
    run names' time stamp replaced by placeholders (the only parts that may differ between commands)."""
    runs = []
    for cmd, env in started:
        written = cmd[cmd.index("--output_dir" if "--output_dir" in cmd else "--out") + 1]
        if not os.path.relpath(written, run_dir).startswith(".."):
            runs.append(([re.sub(r"__\d{9,}$", "__<stamp>", a.replace(run_dir, "<run_dir>")) for a in cmd], env))
    return runs


@pytest.mark.parametrize("quick", [[], ["--max_steps", "2", "--eval_prompts", "16", "--kl_prompts", "8"]],
                         ids=["full", "quick"])
def test_study_runs_the_main_jobs_chain_for_its_seed_1(quick, tmp_path, monkeypatch):
    # issue 27: the study's seed-1 chain must give the main job's numbers, so each of its stages must get
    # the main job's script, arguments (but the output paths), place in the order and environment (the
    # torch threads); both commands at their defaults, full budget and quick mode, nothing trained
    main = launched(monkeypatch, run_tiny_tldr, run_tiny_tldr.Args,
                    ["--output_dir", str(tmp_path / "main"), "--results", str(tmp_path / "main.md"), *quick])
    study = launched(monkeypatch, study_tiny_tldr, study_tiny_tldr.StudyArgs,
                     ["--output_dir", str(tmp_path / "study"), "--results", str(tmp_path / "study.md"), *quick])
    main_chain, study_chain = chain(main, str(tmp_path / "main")), chain(study, str(tmp_path / "study" / "seed_1"))
    assert len(main_chain) == len(main) == 17  # 9 training stages and 8 evaluations
    assert {os.path.relpath(cmd[1], run_tiny_tldr.ROOT) for cmd, _ in main_chain} == {
        *(f"algos/{name}.py" for name in run_tiny_tldr.STAGES), "benchmarks/tiny_tldr_eval.py"}
    assert all(env["OMP_NUM_THREADS"] == "1" for _, env in main_chain)
    for (main_cmd, main_env), (study_cmd, study_env) in zip(main_chain, study_chain, strict=True):
        assert study_cmd == main_cmd
        assert study_env == main_env, {k: (main_env.get(k), study_env.get(k)) for k in {*main_env, *study_env}
                                       if main_env.get(k) != study_env.get(k)}
    # RECIPE's settings reach their scripts once each, with their values; 1600 completions: 50 steps of 32
    # (GKD: 100 of 16), unless in quick mode
    for name, settings in run_tiny_tldr.RECIPE.items():
        [cmd] = [cmd for cmd, _ in main_chain if cmd[1].endswith(f"algos/{name}.py")]
        for flag, value in settings.items():
            assert cmd.count(f"--{flag}") == 1 and float(cmd[cmd.index(f"--{flag}") + 1]) == value, (name, flag)
    for name, steps in (("grpo", 50), ("rloo", 50), ("online_dpo", 50), ("ppo", 50), ("gkd", 100)):
        [cmd] = [cmd for cmd, _ in main_chain if cmd[1].endswith(f"algos/{name}.py")]
        assert cmd.count("--max_steps") == 1 and cmd[cmd.index("--max_steps") + 1] == str(2 if quick else steps)
    # seeds 2 and 3 train the methods from seed 1's SFT and reward models: no SFT or reward stage of their own,
    # and their sft/ and reward/ are links to seed 1's
    for seed in (2, 3):
        scripts = [os.path.basename(cmd[1]) for cmd, _ in chain(study, str(tmp_path / "study" / f"seed_{seed}"))]
        assert "sft.py" not in scripts and "reward.py" not in scripts and scripts.count("tiny_tldr_eval.py") == 8
        assert len(scripts) == 15
        for name in ("sft", "reward"):
            link = tmp_path / "study" / f"seed_{seed}" / name
            assert os.path.realpath(link) == str(tmp_path / "study" / "seed_1" / name)
    # GKD at half its budget distils from the seed's full-budget teacher (RLOO), not from the half-budget one beside it
    for seed in (1, 2, 3):
        [half_gkd] = [cmd for cmd, _ in study if f"gkd__half{seed}__" in " ".join(cmd)]
        teacher = half_gkd[half_gkd.index("--teacher_model_name_or_path") + 1]
        assert teacher == str(tmp_path / "study" / f"seed_{seed}" / "rloo"), teacher


def test_resumed_study_runs_only_the_stages_not_finished_and_those_after_a_changed_one(tmp_path, monkeypatch):
    # the study takes hours here: started again with --resume after an interruption, it must run the stages its
    # progress file does not record as finished, with the same command lines (and so the same run names), and
    # every stage after one whose command line changed; without --resume, everything again
    flags = ["--output_dir", str(tmp_path / "study"), "--results", str(tmp_path / "study.md")]
    study = lambda *more: launched(monkeypatch, study_tiny_tldr, study_tiny_tldr.StudyArgs, [*flags, *more])  # noqa: E731
    first = study()
    progress = tmp_path / "study" / "progress.jsonl"
    lines = progress.read_text().splitlines()
    assert len(lines) == 1 + len(first) > 100  # the time stamp, then one line per finished stage
    progress.write_text("\n".join(lines[:-7]) + "\n")  # interrupted before the last 7 stages finished
    assert study("--resume") == first[-7:]
    assert json.loads((tmp_path / "study" / "stages.json").read_text())["runs"] == 2  # the whole study's time: both
    assert study("--resume") == []  # the resumed run recorded them
    # seed 2's GRPO recorded with another beta: it and its evaluation run again, nothing else
    changed = [json.loads(line) for line in progress.read_text().splitlines()]
    [grpo] = [r for r in changed if r.get("key") == json.dumps([2, "grpo"])]
    grpo["argv"][grpo["argv"].index("--beta") + 1] = "0.5"
    progress.write_text("".join(json.dumps(r) + "\n" for r in changed))
    rerun = study("--resume")
    assert [os.path.basename(cmd[1]) for cmd, _ in rerun] == ["grpo.py", "tiny_tldr_eval.py"]
    assert rerun[1][0][rerun[1][0].index("--out") + 1] == str(tmp_path / "study" / "seed_2" / "eval" / "grpo.json")
    assert rerun[0][0] == next(cmd for cmd, _ in first if "grpo__2__" in " ".join(cmd))
    assert len(study()) == len(first)


def test_stopped_job_stops_the_stages_it_runs(tmp_path):
    # a job stopped by SIGTERM (`kill`, a scheduler's time limit) must not leave its stages running unattended,
    # training on and writing into its output folder (it used to: its children went on)
    stage = tmp_path / "stage.py"  # a stage that says its process id, then runs for 10 minutes
    stage.write_text("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    pid_file = tmp_path / "pid"
    job = subprocess.Popen([sys.executable, "-c", "import sys; from benchmarks.run_tiny_tldr import run_stages; "
                            "run_stages({'stage': (sys.argv[1:3], [], sys.argv[3])}, 1, 1)",
                            str(stage), str(pid_file), str(tmp_path / "stage.log")], cwd=run_tiny_tldr.ROOT)
    deadline = time.time() + 120
    while not (pid_file.exists() and pid_file.read_text()) and job.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    stage_pid = int(pid_file.read_text())
    job.terminate()
    job.wait(timeout=60)
    try:
        os.kill(stage_pid, 0)  # the stage's process, if it still exists
    except ProcessLookupError:
        assert job.returncode == 128 + signal.SIGTERM  # as a shell reports a process that SIGTERM ended
        return
    os.kill(stage_pid, signal.SIGKILL)
    pytest.fail("the stage went on after its job was stopped")


@pytest.mark.slow
@pytest.mark.long  # 17 s or more: in .ci/run's lane 1, out of the default suite
def test_quick_job_writes_a_row_per_policy_and_the_figures(tmp_path):
    results = tmp_path / "results" / "tiny_tldr.md"
    run_script("benchmarks/run_tiny_tldr.py", "--max_steps", "2", "--eval_prompts", "16", "--kl_prompts", "8",
               "--track", "--output_dir", str(tmp_path / "out"), "--results", str(results))
    lines = results.read_text().splitlines()
    for title in ("SFT", "DPO", "KTO", "GRPO", "RLOO", "Online DPO", "PPO", "GKD"):
        row = next(line for line in lines if line.startswith(f"| {title}"))
        cells = row.split("|")[2:-1]
        # win rate, gold score, RM score, KL, length, s/step, wall time
        for i in (0, 1, 2, 3, 4, 6, 7):
            assert re.search(r"-?\d+\.?\d*", cells[i]), (title, i, row)
    assert any(re.search(r"held-out preference accuracy: \*\*\d+\.\d%", line) for line in lines)
    assert any(line.startswith("| oracle") for line in lines)
    for name in ("win_rate", "training", "rm_vs_gold", "sample_efficiency"):
        assert (tmp_path / "results" / f"tiny_tldr_{name}.png").stat().st_size > 10000
    # every training stage got --track and --overwrite_output_dir
    stage_args = [json.load(open(p)) for p in glob.glob(str(tmp_path / "out" / "*" / "logs" / "*.args.json"))]
    assert len(stage_args) == 9 and all(a["track"] and a["overwrite_output_dir"] for a in stage_args)
    # every policy was evaluated, next to the oracle
    evals = {p: json.load(open(tmp_path / "out" / "eval" / f"{p}.json")) for p in
             ("sft", "dpo", "kto", "grpo", "rloo", "online_dpo", "ppo", "gkd")}
    assert all(set(e) == {p, "oracle"} for p, e in evals.items())
    with open(os.path.join(tiny_tldr.TINY_SFT_DATA, "test.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f][:16]
    oracle = statistics.mean(tiny_tldr.gold_score(p, tiny_tldr.oracle_summary(p)) for p in prompts)
    assert evals["sft"]["oracle"]["gold_score"] == pytest.approx(oracle) and oracle > 6.5
    # the table's numbers are the evaluation's and the logs' (recomputed here from the files)
    titles = {"sft": "SFT", "dpo": "DPO", "kto": "KTO", "grpo": "GRPO", "rloo": "RLOO", "online_dpo": "Online DPO",
              "ppo": "PPO", "gkd": "GKD"}
    for policy, title in titles.items():
        e = evals[policy][policy]
        cells = [c.strip() for c in next(line for line in lines if line.startswith(f"| {title}")).split("|")[2:-1]]
        assert cells[0] == f"**{e['win_rate']:.1%} ± {e['win_rate_ci']:.1%}**", (title, cells[0])
        assert cells[1:5] == [f"{e['gold_score']:.2f}", f"{e['rm_score']:.2f}", f"{e['kl']:.2f}",
                              f"{e['mean_length']:.1f}"]
        times = [r["time"] for r in read_log(str(tmp_path / "out" / policy)) if "lr" in r]
        assert cells[6].startswith(f"{statistics.median(b - a for a, b in zip(times, times[1:])):.3f} (")
    accuracy = [r["eval_accuracy"] for r in read_log(str(tmp_path / "out" / "reward")) if "eval_accuracy" in r][-1]
    assert f"held-out preference accuracy: **{accuracy:.1%}**" in results.read_text()


@pytest.mark.study
def test_quick_study_writes_its_sections_and_figures(tmp_path):
    results = tmp_path / "results" / "study.md"
    run_script("benchmarks/study_tiny_tldr.py", "--max_steps", "2", "--eval_prompts", "16", "--kl_prompts", "8",
               "--seeds", "1", "2", "--kl_scales", "4", "--output_dir", str(tmp_path / "out"),
               "--results", str(results), timeout=1800)
    text = results.read_text()
    for section in ("## Resolving power", "## A code change that slows learning", "## KL-reward frontier",
                    "## Over-optimisation"):
        assert section in text
    # the frontier, along training: every run saved a checkpoint a step (2 steps: a fifth is < 1), each
    # evaluated; the last one holds the final model's weights (PPO's too, saved with its value model)
    frontier = (tmp_path / "results" / "study_frontier.md").read_text()
    for m in ("dpo", "kto", "grpo", "rloo", "online_dpo", "ppo"):
        for x in ("x1", "x4"):
            saved = json.load(open(tmp_path / "out" / "frontier" / x / "eval" / f"{m}.json"))[m]["along_training"]
            assert [(c["step"], c["final"]) for c in saved] == [(1, False), (2, True)], (m, x)
    assert re.search(r"^\| GRPO \| 4 \| 0: 0\.00 / -?[\d.]+ → 1: -?[\d.]+ / -?[\d.]+ → 2: ", frontier, re.M)
    # the x1 runs are the main runs again, with checkpoints: the same final models
    assert "identical evaluations for 6 of 6 methods" in frontier
    for method in ("DPO", "KTO", "GRPO", "RLOO", "Online DPO", "PPO", "GKD"):
        assert re.search(rf"^\| {method} \| [\d.]+% ± [\d.]+% \| [\d.]+% ± [\d.]+% \|", text, re.M), method
    for name in ("frontier", "overoptimisation", "win_rate", "sample_efficiency"):
        assert (tmp_path / "results" / f"study_{name}.png").stat().st_size > 10000
    # the frontier runs got their scaled KL strength: DPO's beta 0.1 x 4, RLOO's kl_coef (RECIPE's 0.5) x 4
    dpo = json.load(open(glob.glob(str(tmp_path / "out" / "frontier" / "x4" / "dpo" / "logs" / "*.args.json"))[0]))
    rloo = json.load(open(glob.glob(str(tmp_path / "out" / "frontier" / "x4" / "rloo" / "logs" / "*.args.json"))[0]))
    assert dpo["beta"] == pytest.approx(0.4) and rloo["kl_coef"] == pytest.approx(2.0)
    # the slowdown runs: half the learning rate (the scripts' defaults: neither is in RECIPE)
    for m in ("grpo", "dpo"):
        [slow] = glob.glob(str(tmp_path / "out" / "slow" / "seed_2" / m / "logs" / "*.args.json"))
        default = getattr(importlib.import_module(f"algos.{m}").Args(), "learning_rate")
        assert json.load(open(slow))["learning_rate"] == pytest.approx(default / 2), m
    grpo = json.load(open(glob.glob(str(tmp_path / "out" / "overopt" / "grpo_small_rm" / "logs" / "*.args.json"))[0]))
    assert grpo["beta"] == 0 and grpo["reward_model_paths"] == [str(tmp_path / "out" / "overopt" / "reward_small")]
