"""`collage models build-tiny`, `collage data synth` and `collage data check` as a user runs them, each a process of
its own: a tiny model and a synthetic dataset built, the dataset checked against the model, and a second build
into the same folder refused."""

from __future__ import annotations

import subprocess
import sys

from tests.support.waiting import scaled


def test_console_script_builds_synthesises_and_checks(tmp_path):
    """The installed `collage` entry point, end to end, as a user runs it."""
    exe = [sys.executable, "-m", "collage.app.cli"]
    run = lambda *a: subprocess.run([*exe, *a], capture_output=True, text=True, timeout=scaled(300))  # noqa: E731
    built = run("models", "build-tiny", "qwen2-vl", "--out", str(tmp_path / "m"))
    assert built.returncode == 0, built.stderr
    made = run(
        "data",
        "synth",
        "odd-one-out",
        "--rows",
        "6",
        "--min-images",
        "3",
        "--max-images",
        "4",
        "--out",
        str(tmp_path / "d"),
    )
    assert made.returncode == 0, made.stderr
    checked = run("data", "check", str(tmp_path / "d"), "--model", str(tmp_path / "m"), "--max-prompt-length", "128")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.startswith("6 rows, 0 bad, images/row min 3")
    again = run("models", "build-tiny", "qwen2-vl", "--out", str(tmp_path / "m"))
    assert again.returncode == 2 and "not empty" in again.stderr
