"""Off the training loop, in the trainer with a tiny model: a callback whose background writer failed still lets every
other callback hear the failure and the end, rollout rows carry the dataset images' own hashes, and the data check
is cached per dataset fingerprint."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from collage.training.batching.encoding import PromptEncoder
from collage.training.callbacks import BackgroundWriter, Callback
from collage.training.output import OutputFolder
from collage.training.trainer import Trainer
from tests.support.training import make_config


def _boom():
    raise ValueError("sink failed")


def test_a_failing_callback_still_lets_every_other_callback_hear_the_failure_and_the_end(tmp_path):
    """A callback whose background writer failed raises its error into the trainer; the failure path (the error
    event, then on_end) still reaches every other callback, the failed one hears on_end only (and raises there
    again), and train() raises the original error."""
    from tests.support.training import Recorder

    class FailingSink(Callback):
        def __init__(self):
            self.writer = BackgroundWriter(maxsize=2)
            self.written: list[int] = []
            self.heard: list[str] = []

        def on_metrics(self, step, metrics):
            self.writer.put(_boom if step == 1 else lambda: self.written.append(step))

        def on_event(self, level, message):
            self.heard.append(level)
            self.writer.put(lambda: self.written.append(-1))

        def on_progress(self, step, max_steps, seconds_per_step):
            self.writer.flush()

        def on_end(self, status, error=None):
            self.heard.append(f"end {status}")
            self.writer.close()

    sink, recorder = FailingSink(), Recorder()
    with pytest.raises(ValueError, match="sink failed"):
        Trainer(make_config(train={"max_steps": 3}), None, [sink, recorder]).train()
    assert sink.written == [] and sink.heard == ["end failed"]
    assert [level for level, _ in recorder.events] == ["error"] and "sink failed" in recorder.events[0][1]
    assert recorder.ended is not None and recorder.ended[0] == "failed"
    assert [step for step, _ in recorder.metrics] == [1]


# ---------------------------------------------------------------- training run
class Rows(Callback):
    def __init__(self):
        self.rows = []

    def on_samples(self, step, rows):
        self.rows.extend(rows)


def _count_png_saves(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = Image.Image.save

    def save(self, fp, format=None, **params):
        if (format or "").upper() == "PNG":
            calls.append(1)
        return original(self, fp, format, **params)

    monkeypatch.setattr(Image.Image, "save", save)
    return calls


def test_rollout_rows_carry_the_dataset_images_own_hashes(tmp_path, monkeypatch):
    config = make_config(logging={"samples_every": 1})
    rows = Rows()
    out = tmp_path / "out"
    trainer = Trainer(config, out, [rows, OutputFolder(out)])
    trainer.setup()
    encodes = _count_png_saves(monkeypatch)
    trainer.train()
    assert encodes == [], "dataset PNGs must not be re-encoded during training"
    assert rows.rows
    seen = 0
    for row in rows.rows:
        raw = trainer.dataset.rows[row.row]
        files = [raw.base_dir / ref if isinstance(ref, str) else None for ref in raw.image_refs()]
        assert all(files), "the synthetic dataset names its images by path"
        expected = [hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in files]
        assert [im.sha256 for im in row.images] == expected
        seen += len(expected)
    assert seen > 0
    # everything reached the folder by the time train() returned
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == len(rows.rows)
    for record in samples:
        for image in record["images"]:
            data = (out / "images" / f"{image['sha256']}.png").read_bytes()
            assert hashlib.sha256(data).hexdigest() == image["sha256"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == config.train.max_steps


# ---------------------------------------------------------------- data check cache
def _count_encodes(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = PromptEncoder.encode

    def encode(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PromptEncoder, "encode", encode)
    return calls


def test_data_check_is_cached_per_dataset_fingerprint(tmp_path, monkeypatch):
    first = Trainer(make_config())
    first.setup()  # writes the synthetic dataset; we use a private copy of it
    files = first.dataset.files
    assert files
    folder = tmp_path / "data"
    shutil.copytree(files[0].parent, folder)
    config = make_config(dataset={"source": str(folder), "split": "train"})

    encodes = _count_encodes(monkeypatch)
    Trainer(config).setup()
    assert len(encodes) == 24  # a miss: every row checked
    encodes.clear()
    resumed = Trainer(config)
    resumed.setup()
    assert encodes == []  # a hit: nothing re-encoded
    assert resumed.images_per_row == first.images_per_row

    data = folder / files[0].name
    lines = data.read_text().splitlines()
    lines.pop()  # the dataset changes
    data.write_text("\n".join(lines) + "\n")
    Trainer(config).setup()
    assert len(encodes) == 23  # a miss again
