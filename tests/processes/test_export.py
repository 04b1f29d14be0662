"""``training/export.py``: real checkpoints of Collage's trainer (full fine-tune and LoRA) exported as plain transformers
folders, loaded back with ``AutoModelForImageTextToText`` / ``AutoProcessor`` as a user would, and run on a two-image
prompt: the export's logits are the checkpoint's (merged LoRA within 1e-4 of the adapter), the model sees the images,
and it generates. Bad exports (an ``--out`` in use, a merge of a full model, a link inside the checkpoint, a failure
half way) leave nothing behind."""

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
