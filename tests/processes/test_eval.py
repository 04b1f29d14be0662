"""Held-out evaluation over several processes (docs/training.md, Evaluation): a two-process `collage train` run
(accelerate, gloo on CPU) splits the evaluation and logs the metrics and rows that one process logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from collage.training.output import OutputFolder
from collage.training.trainer import Trainer
from tests.support import ROOT
from tests.support.training import make_config
from tests.support.waiting import scaled


def _lines(file: Path) -> list[dict]:
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def _eval_keys(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("eval/")}


def test_two_processes_split_the_evaluation_and_log_what_one_process_logs(tmp_path):
    """eval_on_start over 5 held-out prompts, one per batch and process (the last batch leaves one process
    without a prompt): the two-process run (accelerate, gloo on CPU) logs the one-process metrics and every row."""
    train = {"max_steps": 1, "eval_on_start": True, "eval_max_rows": 5, "per_device_eval_batch_size": 1, "seed": 2}
    config = make_config(dataset={"eval_split": "test"}, train=train)
    cfg_file = tmp_path / "eval.yaml"
    cfg_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    out = tmp_path / "two"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "collage.app.cli", "train", str(cfg_file), "--out", str(out), "--quiet"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=scaled(600), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-6000:]
    two = _lines(out / "metrics.jsonl")[0]
    rows = [s for s in _lines(out / "samples.jsonl") if s["split"] == "eval"]
    assert sorted(s["group"] for s in rows) == [0, 1, 2, 3, 4]

    one_out = tmp_path / "one"
    Trainer(config, one_out, [OutputFolder(one_out)]).train()
    one = _lines(one_out / "metrics.jsonl")[0]
    assert two["step"] == one["step"] == 0
    assert _eval_keys(two) == _eval_keys(one)
    one_rows = sorted((s for s in _lines(one_out / "samples.jsonl") if s["split"] == "eval"), key=lambda s: s["group"])
    assert [s["completion"] for s in sorted(rows, key=lambda s: s["group"])] == [s["completion"] for s in one_rows]
