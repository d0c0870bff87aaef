"""The Tracker: metric lines always, a progress bar on a terminal only, sample tables as readable text."""

import sys
from types import SimpleNamespace

from common.tracking import Tracker


def tracker(tmp_path):
    return Tracker(SimpleNamespace(is_main_process=True), output_dir=str(tmp_path), run_name="r", config={},
                   logging_steps=1, total_steps=2)


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
