"""``collage export`` as a user runs it (a process of its own): on a run id of the store (its checkpoint's path from
the store) and on the output folder of ``collage train``; every refusal is one line and exit code 2 (unknown run, no
checkpoint, unknown step, no best checkpoint, a missing extra)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.checkpoints import files_of, place, run_config, trained
from tests.support.imports import BLOCK, run_python
from tests.support.waiting import scaled


@pytest.fixture
def store(tmp_path):
    """A migrated SQLite store with a LoRA run whose checkpoints a worker wrote, and an empty run."""
    from collage.app.store.engine import engine_for, upgrade
    from collage.app.store.writer import StoreWriter
    from collage.training.config import parse_config

    url = f"sqlite:///{tmp_path / 'collage.db'}"
    upgrade(url)
    artifacts = tmp_path / "artifacts"
    writer = StoreWriter(engine_for(url), artifacts)
    config = run_config("lora")
    config["train"]["metric_for_best_model"] = "reward"
    run = writer.create_run(parse_config(config).model_dump(mode="json")).id
    place(writer, artifacts, run, "lora", metrics={1: 0.5, 2: 0.25})
    empty = writer.create_run(parse_config(run_config("full")).model_dump(mode="json")).id
    env = {**os.environ, "COLLAGE_DATABASE_URL": url, "COLLAGE_ARTIFACTS": str(artifacts), "PYTHONPATH": str(ROOT)}
    return {"run": run, "empty": empty, "env": env, "artifacts": artifacts}


def _export(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "collage.app.cli", "export", *args], env=env, capture_output=True,
                          text=True, timeout=scaled(600), cwd=ROOT)  # fmt: skip


def test_export_of_a_run_in_the_store_best_checkpoint_merged(store, tmp_path):
    out = tmp_path / "merged"
    done = _export(store["env"], store["run"], "--step", "best", "--merge-lora", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(f"exported step 1 of run {store['run']} (LoRA adapter merged")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "chat_template.jinja"} <= names
    assert "adapter_config.json" not in names
    assert "export: 100% exported" in done.stderr


def test_export_of_a_train_output_folder_is_its_checkpoint_byte_for_byte(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = trained("full")
    out = tmp_path / "full"
    done = _export(env, str(run), "--step", "1", "--out", str(out), "--quiet")
    assert done.returncode == 0, done.stderr
    assert files_of(out) == files_of(run / "checkpoints" / "step-1" / "model")
    assert "export:" not in done.stderr  # --quiet
    adapter = tmp_path / "adapter"
    done = _export(env, str(trained("lora")), "--out", str(adapter))  # last, as the adapter it is
    assert done.returncode == 0, done.stderr
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    assert "base_model_name_or_path" in done.stderr  # the base path caveat is said


@pytest.mark.parametrize(
    "args,message",
    [
        (["nosuchrun"], "no run 'nosuchrun' in the store"),
        (["{empty}"], "run {empty} has no checkpoint yet"),
        (["{run}", "--step", "7"], "run {run} has no checkpoint at step 7: its checkpoints are at steps 1, 2"),
        (["{run}", "--step", "first"], "--step: must be a step number"),
        (["{folder}", "--step", "best"], "has no train.metric_for_best_model, so no checkpoint is the best"),
        (["/no/such/folder"], "/no/such/folder: not a `collage train` output folder"),
    ],
)
def test_refusals_are_one_line_and_exit_2(store, tmp_path, args, message):
    names = {"run": store["run"], "empty": store["empty"], "folder": str(trained("full"))}
    args = [a.format(**names) for a in args]
    done = _export(store["env"], *args, "--out", str(tmp_path / "out"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert lines == [f"collage: error: {message.format(**names)}"] or (
        len(lines) == 1 and message.format(**names) in lines[0]
    ), done.stderr
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_this_machine_does_not_have_is_said(store, tmp_path):
    shutil.rmtree(store["artifacts"] / "runs")
    done = _export(store["env"], store["run"], "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "which is not on this machine" in done.stderr


def test_export_without_the_worker_extra_names_it_in_one_line(tmp_path):
    argv = ["export", str(trained("full")), "--out", str(tmp_path / "out")]
    done = run_python(BLOCK.format(blocked=["torch"], argv=argv), cwd=ROOT, env={"COLLAGE_HOME": str(tmp_path)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "collage export needs the 'worker' extra" in lines[0] and "pip install 'collage-rl[worker]'" in lines[0]


def test_export_on_a_machine_that_only_reaches_the_bucket(tmp_path, monkeypatch):
    """With object storage the store records the checkpoint relative to the artifacts: `collage export` on another
    machine (an empty cache of its own) downloads it from the bucket, checked against its manifest, and exports."""
    import json

    from collage.app.store.engine import engine_for, upgrade
    from collage.app.store.writer import StoreWriter
    from collage.training.config import parse_config
    from collage.training.infra.objectstore import ObjectMirror
    from tests.support.s3 import s3_environment, shared_endpoint

    s3 = s3_environment(shared_endpoint())
    url = f"sqlite:///{tmp_path / 'collage.db'}"
    upgrade(url)
    writer = StoreWriter(engine_for(url), tmp_path / "unused")
    run = writer.create_run(parse_config(run_config("full")).model_dump(mode="json")).id
    writer.transition(run, ["queued"], "running")
    source = trained("full") / "checkpoints" / "step-2"
    rel = f"runs/{run}/attempt-1/checkpoints/step-2"
    for name, value in s3.items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    bucket = ObjectMirror(s3["COLLAGE_ARTIFACTS"], s3["COLLAGE_S3_ENDPOINT_URL"], retry_for=20)
    bucket.ensure_bucket()
    bucket.put_folder(rel, source)
    info = json.loads((source / "checkpoint.json").read_text())
    writer.for_attempt(run, 1).add_checkpoint(run, 2, rel, kind=info["kind"], size=info["bytes"])
    env = {**os.environ, **s3, "COLLAGE_DATABASE_URL": url, "COLLAGE_HOME": str(tmp_path / "elsewhere"),
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    out = tmp_path / "out"
    done = _export(env, run, "--out", str(out), "--quiet")
    assert done.returncode == 0, done.stderr
    assert files_of(out) == files_of(source / "model")
