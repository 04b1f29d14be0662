"""FSDP2 (``resources.strategy: fsdp``) as processes: two gloo ranks on the CPU through ``accelerate launch``, as a
worker launches them. The sharded run must be the DDP run (same losses, gradient norms, completions and, after three
optimizer steps, parameters), its sharded checkpoints must resume with as many processes or fewer, and ``collage
export`` must turn them into a folder transformers loads and generates with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.training import make_config
from tests.support.waiting import scaled

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5


def _train(tmp_path: Path, tag: str, processes: int, extra: tuple[str, ...] = (), **sections) -> Path:
    """``collage train`` of a config built from ``sections`` on ``processes`` gloo ranks; the output folder."""
    config = make_config(**sections)
    cfg = tmp_path / f"{tag}.yaml"
    cfg.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    out = tmp_path / tag.split("@")[0]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLLAGE_HOME": str(tmp_path / "home")}
    train = ["-m", "collage.app.cli", "train", str(cfg), "--out", str(out), "--quiet", *extra]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
    cmd = [*launch, *train] if processes > 1 else [sys.executable, *train]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=scaled(600), cwd=ROOT)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _sections(strategy: str, model: dict | None = None, train: dict | None = None, **resources) -> dict:
    return {
        "model": {"path": "tiny:qwen2-vl", "dtype": "float32", **(model or {})},
        "train": {"max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "seed": 2, **(train or {})},
        "resources": {"gpus": 0, "processes": 2, "strategy": strategy, **resources},
    }


def _weights(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's trained tensors as a DDP checkpoint stores them (a sharded one consolidated first)."""
    from safetensors.torch import load_file

    from collage.training.sharded_checkpoint import with_weights

    model = with_weights(checkpoint / "model", tmp)
    files = sorted(model.glob("*.safetensors"))
    assert files, f"{model}: no weights"
    return {k: v for f in files for k, v in load_file(f).items()}


CASES = {
    "qwen2-vl": {},
    "idefics3 (image splitting)": {"model": {"path": "tiny:idefics3"}},
    "qwen2-vl LoRA with a KL term": {"model": {"lora": {"r": 4, "alpha": 8}}, "train": {"beta": 0.04}},
}


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_trains_as_ddp_does(tmp_path, case):
    """Same seed, data and settings: per-step loss and gradient norm within 1e-5, the same completions, and the
    parameters within 1e-5 after three optimizer steps (the sharded checkpoint consolidated)."""
    runs = {s: _train(tmp_path, s, 2, **_sections(s, **CASES[case])) for s in ("ddp", "fsdp")}
    ddp, fsdp = (_lines(runs[s] / "metrics.jsonl") for s in ("ddp", "fsdp"))
    assert [m["step"] for m in fsdp] == [1, 2, 3]
    for a, b in zip(ddp, fsdp, strict=True):
        assert abs(a["loss"] - b["loss"]) <= TOL, (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= TOL * max(1.0, a["grad_norm"]), (a["grad_norm"], b["grad_norm"])
    completions = {s: [r["completion"] for r in _lines(runs[s] / "samples.jsonl")] for s in runs}
    assert completions["ddp"] == completions["fsdp"]
    checkpoint = runs["fsdp"] / "checkpoints" / "step-3"
    manifest = json.loads((checkpoint / "shards.json").read_text())
    assert manifest["world"] == 2 and {Path(f["path"]).name for f in manifest["files"]} >= {
        "__0_0.distcp",
        "__1_0.distcp",
    }
    assert not list((checkpoint / "model").glob("*.safetensors")), "a sharded checkpoint's model/ holds no weights"
    a, b = _weights(runs["ddp"] / "checkpoints" / "step-3", tmp_path / "a"), _weights(checkpoint, tmp_path / "b")
    assert a.keys() == b.keys()
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) <= TOL


def test_a_sharded_checkpoint_resumes_on_two_or_one_process_and_exports(tmp_path):
    """Stopped at step 2 and resumed with the same two processes, the run continues the very loss curve of an
    uninterrupted one; resumed on one process with the per-process batch doubled it continues from the same
    weights with the same prompts (its sampling draws differ: one process draws what two did). The last checkpoint exports to a transformers folder
    that loads and generates."""
    train = {"max_steps": 4, "save_steps": 1, "lr_scheduler_type": "constant"}
    whole = _lines(_train(tmp_path, "whole", 2, **_sections("fsdp", train=train)) / "metrics.jsonl")
    for processes in (2, 1):
        first = {**train, "max_steps": 2}
        out = _train(tmp_path, f"part{processes}", 2, **_sections("fsdp", train=first))
        assert json.loads((out / "checkpoints" / "step-2" / "shards.json").read_text())["world"] == 2
        batch = {"per_device_train_batch_size": 4 * 2 // processes}  # the same prompts per step on fewer processes
        _train(tmp_path, f"part{processes}@resume", processes, ("--resume",),
               **_sections("fsdp", train={**train, **batch}))  # fmt: skip
        resumed = _lines(out / "metrics.jsonl")
        assert [m["step"] for m in resumed] == [1, 2, 3, 4]
        events = [e["message"] for e in _lines(out / "events.jsonl")] if (out / "events.jsonl").exists() else []
        assert (processes == 1) == any("resumed on 1 process(es) from a checkpoint of 2" in e for e in events), events
        if processes == 2:
            assert [m["loss"] for m in resumed] == [m["loss"] for m in whole]
        assert _rows(out, (3, 4)) == _rows(tmp_path / "whole", (3, 4)), "the data order continues where it was"
    # a 1-process run writes whole-model checkpoints; the sharded one of the two-process resume exports
    export = tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "collage.app.cli", "export", str(tmp_path / "part2"), "--step", "4", "--out", str(export)],
        capture_output=True, text=True, timeout=scaled(300), cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLLAGE_HOME": str(tmp_path / "home")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    exported = {k: v for f in sorted(export.glob("*.safetensors")) for k, v in load_file(f).items()}
    trained = _weights(tmp_path / "part2" / "checkpoints" / "step-4", tmp_path / "c")
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    model = AutoModelForImageTextToText.from_pretrained(export)
    processor = AutoProcessor.from_pretrained(export)
    ids = processor.tokenizer("Count the images", return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids["input_ids"].shape[1]


def _rows(out: Path, steps: tuple[int, ...]) -> dict[int, list[int]]:
    """The dataset rows each of ``steps`` drew, all processes together."""
    samples = _lines(out / "samples.jsonl")
    return {step: sorted({s["dataset_row"] for s in samples if s["step"] == step}) for step in steps}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_collage_train_under_a_plain_torchrun_rendezvous_trains_and_resumes(tmp_path):
    """The entry point a site's own scheduler (Slurm, Kubernetes, Ray) runs on each host: ``collage train`` under
    torchrun's c10d rendezvous, not accelerate's launcher; a restart with ``--resume`` continues it."""
    train = {"max_steps": 3, "lr_scheduler_type": "constant"}
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLLAGE_HOME": str(tmp_path / "home")}
    for steps, extra in ((2, ()), (3, ("--resume",))):
        config = make_config(**_sections("fsdp", train={**train, "max_steps": steps}))
        cfg = tmp_path / f"run-{steps}.yaml"
        cfg.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{_free_port()}", "--rdzv_id", "collage-test",
               "-m", "collage.app.cli", "train", str(cfg), "--out", str(out), "--quiet", *extra]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=scaled(600), cwd=ROOT)
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
        manifest = json.loads((out / "checkpoints" / f"step-{steps}" / "shards.json").read_text())
        assert manifest["world"] == 2
    assert [m["step"] for m in _lines(out / "metrics.jsonl")] == [1, 2, 3]
