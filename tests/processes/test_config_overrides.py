"""A bad `--set` value that picks a list item, as `collage train` run as a process reports it: exit code 2 and one
line naming the key and the value the `--set` gave."""

from __future__ import annotations

import subprocess
import sys

import yaml

from tests.support import ROOT
from tests.support.browser import small_config
from tests.support.waiting import scaled


def test_the_command_line_prints_the_key_and_the_value(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text(yaml.safe_dump(small_config("o")))
    done = subprocess.run([sys.executable, "-m", "collage.app.cli", "train", str(file), "--out", str(tmp_path / "o"),
                           "--set", "rewards[0].weight=x"], capture_output=True, text=True, cwd=ROOT, timeout=scaled(120))  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "collage: config error: rewards[0].weight: Input should be a valid number, unable to parse string as a "
        "number (--set gave 'x')"
    ], done.stderr
