"""``training/export.py`` stays light: a fresh interpreter that imports it loads no torch, transformers or peft."""

from __future__ import annotations

from tests.support.waiting import scaled


def test_importing_the_export_module_loads_no_torch():
    import subprocess
    import sys

    code = (
        "import sys, collage.training.export; print([m for m in ('torch', 'transformers', 'peft') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
