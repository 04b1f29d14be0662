"""Real checkpoints for the checkpoint, download and export tests: a tiny Qwen2-VL trained by Collage's own trainer
for two steps on the multi-image ``count-red`` task, saving after each step, once with full fine-tuning and once
with a LoRA adapter (one training of each per test process), and ways to put them where a worker would have written
them (``artifacts/runs/<id>/attempt-1/checkpoints/step-N``, recorded in the store)."""

from __future__ import annotations

import json
import shutil
import tempfile
from functools import cache
from pathlib import Path

from . import API

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
TRAIN = {"max_steps": 2, "save_steps": 1, "seed": 1, "learning_rate": 5e-3}


def run_config(kind: str) -> dict:
    """The run config of a checkpointed run (``kind``: ``full`` or ``lora``), as the API takes it."""
    return {
        "name": f"checkpoints-{kind}",
        "model": {"path": "tiny:qwen2-vl", "dtype": "float32", "lora": LORA if kind == "lora" else None},
        "dataset": {"source": "synth:count-red", "rows": 24, "min_images": 1, "max_images": 3},
        "rewards": [{"name": "numeric"}, {"name": "accuracy"}],
        "train": {"per_device_train_batch_size": 8, "num_generations": 4, "max_prompt_length": 256,
                  "max_completion_length": 6, **TRAIN},
        "resources": {"gpus": 0},
    }  # fmt: skip


@cache
def trained(kind: str) -> Path:
    """The output folder of a real 2-step run (``kind``: ``full`` or ``lora``) with checkpoints at steps 1 and 2."""
    from collage.training.config import parse_config
    from collage.training.output import OutputFolder
    from collage.training.trainer import Trainer

    out = Path(tempfile.mkdtemp(prefix=f"collage-ckpt-{kind}-"))
    result = Trainer(parse_config(run_config(kind)), out, [OutputFolder(out)]).train()
    assert result.status == "succeeded", result
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1", "step-2"]
    return out


def place(writer, artifacts: Path, run_id: str, kind: str, metrics: dict[int, float] | None = None) -> dict[int, Path]:
    """Copy the checkpoints of :func:`trained` ``kind`` into the run's attempt folder under ``artifacts`` and record
    them in the store as the worker's store callback does (kind, size, and ``metrics[step]`` when given); returns
    step -> checkpoint folder."""
    src = trained(kind)
    writer.transition(run_id, ["queued"], "running")  # the attempt that writes them is the run's current one
    recorder = writer.for_attempt(run_id, 1)
    folders = {}
    for child in sorted((src / "checkpoints").iterdir()):
        step = int(child.name.removeprefix("step-"))
        dest = artifacts / "runs" / run_id / "attempt-1" / "checkpoints" / child.name
        shutil.copytree(child, dest)
        info = json.loads((dest / "checkpoint.json").read_text())
        recorder.add_checkpoint(
            run_id, step, str(dest), kind=info["kind"], size=info["bytes"], metric=(metrics or {}).get(step)
        )
        folders[step] = dest
    writer.transition(run_id, ["running"], "succeeded")
    return folders


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by its relative path, with its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def model_inputs(processor, seed: int = 0):
    """A two-image prompt as the model sees it (chat template, processor): red and blue squares of two sizes."""
    from PIL import Image

    colours = [(220, 30, 30), (30, 30, 220)] if seed == 0 else [(30, 200, 30), (240, 240, 0)]
    images = [Image.new("RGB", (56, 56), colours[0]), Image.new("RGB", (84, 56), colours[1])]
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Image 1: "}, {"type": "image"}, {"type": "text", "text": "\nImage 2: "},
        {"type": "image"}, {"type": "text", "text": "\nHow many images show a red shape?"}]}]  # fmt: skip
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(text=[text], images=[images], return_tensors="pt")


def checkpoint_model(kind: str, folder: Path):
    """The checkpoint as the trainer itself loads it on resume (model built and wrapped as in training, then the
    checkpoint's weights or adapter loaded), in eval mode."""
    from collage.training.checkpoint import load_model_weights
    from collage.training.config import parse_config
    from collage.training.modeling import prepare_policy
    from collage.training.models.loading import load_model

    config = parse_config(run_config(kind))
    model = prepare_policy(load_model(config.model.path, "float32"), config.model, False)
    load_model_weights(model, folder, uses_lora=kind == "lora")
    return model.eval()


def fresh_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="collage-export-test-"))


def submit_run(client, kind="full", **train) -> str:
    """A run of the checkpoints' config (``train`` over it) submitted through the API; its id."""
    config = run_config(kind)
    config["train"] = {**config["train"], **train}
    response = client.post(API + "/runs", json=config)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def run_with_checkpoints(client, app, kind="lora", queue="default") -> str:
    """A run on ``queue`` whose checkpoints of ``kind`` are where a worker would have written them; its id."""
    config = run_config(kind)
    config["resources"] = {"gpus": 0, "queue": queue}
    run = client.post(API + "/runs", json=config).json()["id"]
    place(app.state.writer, Path(app.state.settings.artifacts), run, kind)
    return run


def work_next_job(app, queue="default") -> str:
    """What a worker of ``queue`` does with the next message: claim the oldest job, run it to its end."""
    from collage.app.store import jobs
    from collage.worker.jobs import run_job

    job = jobs.claim_next_job(app.state.engine, queue, "test-worker")
    assert job is not None
    return run_job(job, app.state.settings, "test-worker")
