"""The real-scale TL;DR recipes and their judge: every command in benchmarks/tldr/*.sh parses against
the current Args of the script it launches (so the recipes cannot rot when a flag is renamed), and
benchmarks/judge_tldr.py runs end to end on the tiny task against a fake OpenAI-compatible judge."""

import collections
import glob
import importlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import tyro

from tests.conftest import ROOT, run_script

ALGOS = ["sft", "reward", "dpo", "kto", "online_dpo", "rloo", "grpo", "ppo"]
POLICIES = ["dpo", "kto", "online_dpo", "rloo", "grpo", "ppo"]
RECIPES = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "tldr", "*.sh")))

# Stands in for `accelerate` and `python` on PATH: writes its name and arguments, NUL-separated,
# to the next numbered file in $RECORD_DIR, and does nothing else.
RECORDER = """#!/bin/sh
n=$(ls "$RECORD_DIR" | wc -l)
printf '%s\\0' "$(basename "$0")" "$@" > "$RECORD_DIR/$(printf %04d "$n")"
"""


# ---------------------------------------------------------------------------------------------
# benchmarks/tldr/*.sh against the scripts' Args
# ---------------------------------------------------------------------------------------------
def recorded_calls(script: str, tmp_path) -> list[list[str]]:
    """Run a recipe with `accelerate` and `python` replaced by recorders; the argv of each call, in order.
    The shell expands its own variables, loops and arithmetic, as it would on a GPU machine."""
    bin_dir, record_dir = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    record_dir.mkdir()
    for name in ("accelerate", "python"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD_DIR": str(record_dir),
           "OUT": str(tmp_path / "out"), "OPENAI_API_KEY": "sk-test"}
    proc = subprocess.run(["bash", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stderr}"
    return [(record_dir / f).read_bytes().decode().split("\0")[:-1] for f in sorted(os.listdir(record_dir))]


def parse_call(argv: list[str]) -> tuple[str, object]:
    """(script path, its parsed Args) of one recorded call; AssertionError naming the call when the
    launcher or the script refuses its arguments (an unknown flag, a bad value)."""
    where = " ".join(argv)
    i = next((k for k, a in enumerate(argv) if a.endswith(".py")), None)
    assert i is not None, f"no script in: {where}"
    script, script_args = argv[i], argv[i + 1:]
    if argv[0] == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        assert argv[1] == "launch", where
        try:
            launch_command_parser().parse_args(argv[2:])
        except SystemExit:
            raise AssertionError(f"accelerate launch refuses its arguments: {where}") from None
        config = argv[argv.index("--config_file") + 1] if "--config_file" in argv[:i] else None
        assert config is None or os.path.isfile(os.path.join(ROOT, config)), f"no config file {config}: {where}"
    else:
        assert argv[0] == "python" and i == 1, f"expected `accelerate launch` or `python <script>`: {where}"
    assert os.path.isfile(os.path.join(ROOT, script)), f"no script {script}: {where}"
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    try:
        return script, tyro.cli(module.Args, args=script_args)
    except SystemExit:
        raise AssertionError(f"{script} refuses its arguments (see the message above): {where}") from None


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_recipe_commands_parse_against_args(recipe, tmp_path):
    calls = [parse_call(argv) for argv in recorded_calls(recipe, tmp_path)]
    scripts = [script for script, _ in calls]
    trained = {os.path.basename(s).removesuffix(".py"): args for s, args in calls if s.startswith("algos/")}
    assert sorted(trained) == sorted(ALGOS)
    assert len(trained) == len(ALGOS) == sum(s.startswith("algos/") for s in scripts)
    assert scripts[:2] == ["algos/sft.py", "algos/reward.py"]  # the others start from their outputs

    size = re.search(r"pythia_(.+)\.sh", recipe).group(1)
    sft, rm = trained["sft"], trained["reward"]
    assert sft.model_name_or_path == f"EleutherAI/pythia-{size}-deduped" and sft.dataset_name == "trl-lib/tldr"
    assert rm.model_name_or_path == sft.output_dir and rm.dataset_name == "trl-lib/tldr-preference"
    for name in POLICIES:
        assert trained[name].model_name_or_path == sft.output_dir, name
    for name in ("online_dpo", "rloo", "grpo"):
        assert trained[name].reward_model_paths == [rm.output_dir], name
    assert trained["ppo"].reward_model_path == rm.output_dir

    judged = [args for s, args in calls if s == "benchmarks/judge_tldr.py"]
    assert scripts[len(ALGOS):] == ["benchmarks/judge_tldr.py"] * len(judged)  # judging comes last
    assert sorted(a.model_name_or_path for a in judged) == sorted(
        [sft.output_dir] + [trained[name].output_dir for name in POLICIES])
    assert len({a.output_file for a in judged}) == len(judged)
    assert all(a.num_examples == 1000 and a.judge_model == "gpt-4o-mini-2024-07-18" for a in judged)


def test_recipe_check_catches_unknown_flags(tmp_path):
    """The check above fails for a flag the script does not have, and for a bad launcher flag."""
    bad = tmp_path / "bad.sh"
    for k, line in enumerate(("accelerate launch --config_file configs/multi_gpu.yaml algos/sft.py --learning_rat 1e-5",
                 "accelerate launch --config_file configs/multi_gpu.yaml algos/ppo.py --stop_token nowhere",
                 "accelerate launch --num_procs 8 algos/sft.py",
                 "python benchmarks/judge_tldr.py --num_exampels 10")):
        bad.write_text(f"set -euo pipefail\n{line}\n")
        (calls_dir := tmp_path / f"run{k}").mkdir()
        [argv] = recorded_calls(str(bad), calls_dir)
        with pytest.raises(AssertionError, match="refuses"):
            parse_call(argv)


# ---------------------------------------------------------------------------------------------
# benchmarks/judge_tldr.py against a fake judge
# ---------------------------------------------------------------------------------------------
SUMMARIES = re.compile(r"Summary A: (.*)\n\nSummary B: (.*)\n\nWhich summary", re.S)


class FakeJudge:
    """An OpenAI-compatible /chat/completions endpoint on a free local port. `decide(a, b)` gets the
    two summaries of the prompt and returns the answer text; every request is recorded."""

    def __init__(self, decide):
        self.requests = []
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][-1]["content"]
                judge.requests.append({"path": self.path, "auth": self.headers["Authorization"],
                                       "model": body["model"], "prompt": prompt})
                answer = decide(*SUMMARIES.search(prompt).groups())
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def judged_pairs(requests) -> collections.Counter:
    """(A, B) of every judged pair, the endpoint check left out."""
    from benchmarks.judge_tldr import PROBE, judge_prompt

    return collections.Counter(SUMMARIES.search(r["prompt"]).groups() for r in requests
                               if r["prompt"] != judge_prompt(*PROBE))


def both_orders(examples) -> collections.Counter:
    return collections.Counter(pair for e in examples for pair in
                               [(e["summary"].strip(), e["reference"].strip()),
                                (e["reference"].strip(), e["summary"].strip())])


def test_judge_position_biased_judge_gives_one_half(tiny_model, tmp_path, monkeypatch):
    """A judge that always answers A disagrees with itself once the order is swapped: every prompt
    counts 0.5, so the win rate is exactly 50% with a zero-width interval. Run as a user would."""
    from benchmarks import tiny_tldr
    from common.data import encode_prompt
    from common.generation import generate
    from common.models import load_policy, load_tokenizer

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    out = tmp_path / "judge" / "tiny.json"
    with FakeJudge(lambda a, b: "A") as judge:
        proc = run_script("benchmarks/judge_tldr.py", "--model_name_or_path", tiny_model,
                          "--dataset_name", tiny_tldr.TINY_SFT_DATA, "--num_examples", "6", "--max_new_tokens", "8",
                          "--generation_backend", "hf",
                          "--base_url", judge.url, "--judge_model", "fake-judge", "--num_workers", "3",
                          "--output_file", str(out))
    assert "win rate vs references: 50.0% ± 0.0% (6 prompts" in proc.stdout
    result = json.loads(out.read_text())
    assert result["win_rate"] == 0.5 and result["win_rate_ci"] == 0.0 and result["num_examples"] == 6
    assert result["judge_picked_a"] == 1.0
    examples = result["examples"]
    assert [(e["verdict_summary_as_a"], e["verdict_summary_as_b"], e["win"]) for e in examples] == [("A", "A", 0.5)] * 6

    # each pair asked exactly twice, the summary first and then the reference first (+ one endpoint check)
    assert len(judge.requests) == 2 * 6 + 1
    requests = {(r["path"], r["auth"], r["model"]) for r in judge.requests}
    assert requests == {("/v1/chat/completions", "Bearer sk-test", "fake-judge")}
    assert judged_pairs(judge.requests) == both_orders(examples)

    # the first 6 test prompts, their references, and the policy's greedy summaries
    with open(os.path.join(tiny_tldr.TINY_SFT_DATA, "test.jsonl")) as f:
        rows = [json.loads(line) for line in f][:6]
    assert [(e["prompt"], e["reference"]) for e in examples] == [(r["prompt"], r["completion"]) for r in rows]
    tokenizer = load_tokenizer(tiny_model)
    ids = generate(load_policy(tiny_model, tokenizer), tokenizer,
                   [encode_prompt(tokenizer, r["prompt"]) for r in rows], 8,
                   temperature=0.0).completion_ids
    assert [e["summary"] for e in examples] == tokenizer.batch_decode(ids, skip_special_tokens=True)


def test_judge_win_rate_follows_the_judge(tiny_model, tmp_path, monkeypatch, capsys):
    """A judge that prefers the longer summary (ties: A): the win of each prompt is 1 when the
    policy's summary is longer than the reference, 0 when shorter, 0.5 when as long, in both orders."""
    from benchmarks import judge_tldr, tiny_tldr

    monkeypatch.setenv("OPENAI_API_KEY", "EMPTY")
    with FakeJudge(lambda a, b: "B" if len(b) > len(a) else "A") as judge:
        result = judge_tldr.main(judge_tldr.Args(
            model_name_or_path=tiny_model, dataset_name=tiny_tldr.TINY_SFT_DATA, num_examples=10, max_new_tokens=12,
            generation_backend="hf", base_url=judge.url, judge_model="fake-judge", num_workers=4,
            output_file=str(tmp_path / "longer.json")))
    examples = result["examples"]
    expected = [1.0 if len(e["summary"].strip()) > len(e["reference"].strip()) else
                0.0 if len(e["summary"].strip()) < len(e["reference"].strip()) else 0.5 for e in examples]
    assert [e["win"] for e in examples] == expected
    assert result["win_rate"] == pytest.approx(statistics.mean(expected))
    assert result["win_rate_ci"] == pytest.approx(1.96 * statistics.stdev(expected) / len(expected) ** 0.5)
    assert judged_pairs(judge.requests) == both_orders(examples)
    assert json.loads((tmp_path / "longer.json").read_text())["win_rate"] == result["win_rate"]
    assert f"win rate vs references: {result['win_rate']:.1%}" in capsys.readouterr().out


def test_judge_errors_are_one_line(tiny_model, monkeypatch):
    """No key for OpenAI, an endpoint that does not answer, or one that answers neither A nor B: a
    one-line error before any model loads."""
    from benchmarks import judge_tldr
    from common.runtime import UserError

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(UserError, match="set OPENAI_API_KEY"):
        judge_tldr.main(judge_tldr.Args(model_name_or_path=tiny_model))

    monkeypatch.setenv("OPENAI_API_KEY", "EMPTY")
    with FakeJudge(lambda a, b: "Both are fine.") as judge:
        with pytest.raises(UserError, match="neither A nor B .after 2 tries"):
            judge_tldr.main(judge_tldr.Args(model_name_or_path="no/such-model", base_url=judge.url, max_retries=1))
    assert len(judge.requests) == 2

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "benchmarks/judge_tldr.py", "--model_name_or_path", tiny_model,
                           "--base_url", f"http://127.0.0.1:{port}/v1", "--max_retries", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: judge 'gpt-4o-mini-2024-07-18' at http://127.0.0.1:")
    assert proc.stderr.count("\n") == 1
