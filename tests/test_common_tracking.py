"""The Tracker: metric lines always, a progress bar on a terminal only, sample tables as readable text."""

import json
import sys
from types import SimpleNamespace

from common.tracking import Tracker, TrackingArgs


def tracker(tmp_path, start_step=0):
    return Tracker(SimpleNamespace(is_main_process=True), TrackingArgs(run_name="r", logging_steps=1),
                   output_dir=str(tmp_path), config={}, total_steps=2, start_step=start_step)


def test_off_a_terminal_no_progress_bar_but_every_metric_line(tmp_path, capsys):
    t = tracker(tmp_path)  # pytest captures stderr: not a terminal, as a log file
    assert t.bar.disable
    for step in (1, 2):
        t.step()
        t.log({"loss": 0.5 / step}, step)
    t.close()
    out, err = capsys.readouterr()
    assert err == ""
    assert "step 1: loss=0.5\n" in out and "step 2: loss=0.25\n" in out


def test_on_a_terminal_a_progress_bar(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    t = tracker(tmp_path)
    assert not t.bar.disable
    t.step()
    t.close()
    assert "1/2" in capsys.readouterr().err


def test_sample_tables_show_conversations_as_role_and_content(tmp_path, capsys):
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Summarize: my cat\nate it"}]
    tracker(tmp_path).log_samples([{"prompt": prompt, "completion": " cat ate", "reward": 0.5},
                                   {"prompt": "TITLE: a post", "completion": " b", "reward": -1.0}], step=3)
    out = capsys.readouterr().out
    assert "[0]     prompt: system: Be brief. | user: Summarize: my cat ate it\n" in out and "'role'" not in out
    assert "[1]     prompt: TITLE: a post\n" in out and "[1]     reward: -1.000\n" in out


def test_a_rerun_of_the_same_name_starts_its_log_again_a_resumed_one_drops_the_steps_it_redoes(tmp_path):
    # a run killed before its first checkpoint and started again (the benchmarks' --resume) must not leave its
    # first steps in the log next to the new ones; a run resumed at step 1 keeps step 1 and redoes step 2
    def steps():
        with open(tmp_path / "logs" / "r.jsonl") as f:
            return [(r["step"], r["loss"]) for r in map(json.loads, f)]

    first = tracker(tmp_path)
    first.log({"loss": 1.0}, 1)
    first.log({"loss": 2.0}, 2)
    resumed = tracker(tmp_path, start_step=1)
    assert steps() == [(1, 1.0)]
    resumed.log({"loss": 3.0}, 2)
    assert steps() == [(1, 1.0), (2, 3.0)]
    again = tracker(tmp_path)
    again.log({"loss": 4.0}, 1)
    assert steps() == [(1, 4.0)]
