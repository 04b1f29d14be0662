"""The choice of which checkpoint is best (``collage.training.retention``) is torch-free for the API: a fresh
interpreter imports it without torch."""

from __future__ import annotations

import subprocess
import sys

from tests.support.waiting import scaled


def test_the_choice_is_torch_free_for_the_api():
    """The API marks a run's best checkpoint with the trainer's own rule, on the torch-free web node."""
    code = "import sys, collage.training.retention; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0, done.stderr
