"""The training core end to end as processes, on tiny models and synthetic multi-image data (CPU): `collage train` on
the example config with its refusals, and a two-process DDP run through accelerate (gloo on CPU) that keeps its
replicas identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support.training import make_config
from tests.support.waiting import scaled

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, env=None, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "collage.app.cli", *args], capture_output=True, text=True, env=env,
                          timeout=scaled(timeout), cwd=ROOT)  # fmt: skip


def test_collage_train_cli(tmp_path):
    out = tmp_path / "run"
    done = _cli("train", "examples/grpo-count-red.yaml", "--out", str(out), "--set", "train.max_steps=2",
                "--set", "dataset.rows=16")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "succeeded at step 2" in done.stdout
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl"):
        assert (out / name).is_file()
    again = _cli("train", "examples/grpo-count-red.yaml", "--out", str(out))
    assert again.returncode == 2 and "already holds a run" in again.stderr
    bad = _cli("train", "examples/grpo-count-red.yaml", "--set", "train.loss_type=ppo", "--set", "train.epsilon=-1")
    assert bad.returncode == 2
    assert "train.loss_type: must be one of" in bad.stderr and "train.epsilon:" in bad.stderr


def test_two_process_ddp_on_cpu_keeps_replicas_identical(tmp_path):
    """Two processes through accelerate (gloo on CPU), mixed 0..3-image batches, vision tower trainable so
    micro-batches without images exercise DDP's unused-parameter path (TRL #4169).

    ``accelerate launch --cpu --num_processes 2`` starts one process unless MPI is set up (accelerate 1.x);
    ``--multi_gpu`` launches through torchrun, and Collage's Accelerator falls back to CPU + gloo."""
    config = make_config(
        model={"path": "tiny:qwen2-vl", "dtype": "float32", "freeze_vision": False},
        train={"max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "seed": 2},
    )
    cfg_file = tmp_path / "ddp.yaml"
    cfg_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    out = tmp_path / "out"
    # at each process's exit: is its process group still open? (one left open could abort in its C++ teardown)
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(
        "import atexit, os, sys\n"
        "def _record():\n"
        "    if os.environ.get('RANK') is not None and 'torch.distributed' in sys.modules:\n"
        "        import torch.distributed as dist\n"
        f"        open(os.path.join({str(probe)!r}, 'rank-' + os.environ['RANK']), 'w').write(str(dist.is_initialized()))\n"
        "atexit.register(_record)\n"
        "_exit = os._exit\n"
        "def _recorded_exit(code):\n"
        "    _record()\n"
        "    _exit(code)\n"
        "os._exit = _recorded_exit\n"
    )
    # a fresh COLLAGE_HOME: both processes find no tiny model and resolve it at once (before the build took a
    # lock, one in three such starts failed the process that lost the race)
    env = {**os.environ, "PYTHONPATH": f"{probe}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1",
           "COLLAGE_HOME": str(tmp_path / "home")}  # fmt: skip
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "collage.app.cli", "train", str(cfg_file), "--out", str(out), "--quiet"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=scaled(600), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {f.name: f.read_text() for f in probe.glob("rank-*")} == {"rank-0": "False", "rank-1": "False"}
    digests = json.loads((out / "replicas.json").read_text())["parameter_sha256"]
    assert len(digests) == 2 and digests[0] == digests[1]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 2 * 4  # both processes' rollouts reach the table
    assert {len(s["images"]) for s in samples} >= {0}  # text-only rows are in the mix
