"""Copies stay copies: `python algos/x.py` in a copy of the project imports the copy's common/, not the one
`pip install -e` (or PYTHONPATH) points at, so a researcher's edits to the copy take effect."""

import os
import shutil
import subprocess
import sys

from tests.conftest import ROOT

SCRIPTS = ["sft", "reward", "dpo", "kto", "online_dpo", "rloo", "grpo", "ppo", "gkd"]
OWN_TREE_FIRST = "sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))"


def test_scripts_in_a_copy_run_the_copys_common(tmp_path):
    for folder in ("algos", "common"):
        shutil.copytree(os.path.join(ROOT, folder), tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "common" / "runtime.py", "a") as f:  # the copy's edit: the first function main() calls
        f.write("\n\ndef check_flags(flags):\n    print('the copy speaking', sorted(set(sys.modules) & "
                "{'peft', 'transformers.trainer_utils'}))\n    raise SystemExit(3)\n")
    # two scripts run (an offline and an online one; each run is mostly imports, ~5 s of CPU), and every script puts
    # its tree first the same way; --learning_rate 0: the original's check_flags stops the run as fast (exit 2)
    runs = {s: subprocess.Popen([sys.executable, f"algos/{s}.py", "--learning_rate", "0"], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for s in ("sft", "grpo")}
    for script, run in runs.items():
        out = run.communicate(timeout=300)[0]
        assert run.returncode == 3 and "the copy speaking" in out, f"{script} exited {run.returncode}:\n{out[-2000:]}"
        # and the scripts' imports leave out transformers' Trainer machinery, and peft with it (~5 s of CPU at every
        # launch: common.runtime.lr_scheduler stands in for transformers' get_scheduler)
        assert "the copy speaking []" in out, out[-2000:]
    for script in SCRIPTS:
        source = open(tmp_path / "algos" / f"{script}.py").read()
        assert -1 < source.find(OWN_TREE_FIRST) < source.index("\nfrom common."), script
