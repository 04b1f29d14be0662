"""`collage train`'s progress line: the training reward, and the latest held-out reward beside it."""

from __future__ import annotations

from collage.app.cli.progress import ProgressBar


def test_the_progress_line_shows_the_training_and_the_eval_reward(capsys, monkeypatch):
    bar = ProgressBar(enabled=True)
    bar.enabled, bar.plain = False, True  # not a terminal: one line per step
    bar.on_metrics(0, {"eval/reward": 0.25, "timing/eval": 1.0})  # eval_on_start: no training reward yet
    bar.on_progress(0, 10, None)
    bar.on_metrics(1, {"reward": 0.5})
    bar.on_progress(1, 10, 2.0)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["step 0/10 reward - (eval 0.250) (0s left)", "step 1/10 reward 0.500 (eval 0.250) (18s left)"]
