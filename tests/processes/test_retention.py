"""Checkpoint retention (``train.save_total_limit``) and the best checkpoint (``metric_for_best_model``): the pure
choice of what to delete, checkpoints of earlier worker attempts (links) counted and deleted with their folders,
and the store (real SQLite and PostgreSQL, through the worker's StoreCallback) ending with exactly the kept rows."""

from __future__ import annotations

import subprocess
import sys

from tests.support.waiting import scaled


def test_the_choice_is_torch_free_for_the_api():
    """The API marks a run's best checkpoint with the trainer's own rule, on the torch-free web node."""
    code = "import sys, collage.training.retention; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0, done.stderr
