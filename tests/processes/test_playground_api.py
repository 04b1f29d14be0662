"""The playground stays torch-free outside its own process: a fresh interpreter that imports its routes, its uploads
store and the worker's job handler loads none of the training stack."""

from __future__ import annotations


def test_neither_the_web_side_nor_the_workers_celery_process_loads_the_training_stack():
    """The routes and the job handler run torch-free: torch lives in the worker's playground process only."""
    import subprocess
    import sys

    code = (
        "import sys, collage.app.routers.playground, collage.app.playground, collage.app.store.uploads, "
        "collage.worker.playground;"
        "heavy = [m for m in ('torch', 'transformers', 'accelerate', 'peft', 'collage.training.generation') "
        "if m in sys.modules];"
        "print(heavy)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
