"""Off the training loop: the background writer, dataset image hashes in rollout rows, the data check cache."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from collage.training.batching.inputs import PromptEncoder
from collage.training.callbacks import BackgroundWriter, Callback, RolloutImage
from collage.training.output import OutputFolder
from collage.training.trainer import Trainer

from .test_training import make_config


# ---------------------------------------------------------------- BackgroundWriter
def test_put_blocks_at_capacity_while_the_sink_is_slow():
    release = threading.Event()
    done: list[int] = []
    writer = BackgroundWriter(maxsize=1)

    def task(n):
        return lambda: (release.wait(5), done.append(n))

    writer.put(task(1))  # taken by the thread, which blocks in the sink
    time.sleep(0.05)
    writer.put(task(2))  # fills the queue
    third = threading.Thread(target=writer.put, args=(task(3),))
    third.start()
    third.join(0.3)
    assert third.is_alive(), "put must block while the queue is full"
    release.set()
    third.join(5)
    assert not third.is_alive()
    writer.close()
    assert done == [1, 2, 3]


def test_errors_from_the_thread_are_raised_on_the_next_call():
    writer = BackgroundWriter(maxsize=4)

    def boom():
        raise ValueError("sink failed")

    writer.put(boom)
    with pytest.raises(ValueError, match="sink failed"):
        writer.flush()
    writer.put(boom)
    time.sleep(0.1)
    with pytest.raises(ValueError, match="sink failed"):
        writer.put(lambda: None)
    writer.put(boom)
    with pytest.raises(ValueError, match="sink failed"):
        writer.close()


def test_close_drains_everything_queued():
    done: list[int] = []
    writer = BackgroundWriter(maxsize=2)
    for n in range(6):
        writer.put(lambda n=n: (time.sleep(0.01), done.append(n)))
    writer.close()
    assert done == list(range(6))
    writer.close()  # idempotent
    with pytest.raises(RuntimeError):
        writer.put(lambda: None)


def test_a_stale_attempt_in_the_store_writer_thread_ends_the_process(monkeypatch):
    from collage.app.store.writer import StaleAttempt
    from collage.worker import store_callback

    exits: list[int] = []
    monkeypatch.setattr(store_callback.os, "_exit", lambda code: exits.append(code))

    class Stale:
        def append_metrics(self, *args):
            raise StaleAttempt("superseded")

    callback = store_callback.StoreCallback(Stale(), "run")  # type: ignore[arg-type]
    callback.on_metrics(1, {"loss": 1.0})
    with pytest.raises(StaleAttempt):
        callback.on_end("succeeded")
    assert exits == [store_callback.EXIT_STALE]


def test_store_callback_keeps_the_order_of_writes():
    calls: list[tuple] = []

    class Sink:
        def append_metrics(self, run_id, step, metrics):
            time.sleep(0.02)
            calls.append(("metrics", step))

        def set_progress(self, run_id, step):
            calls.append(("progress", step))

    from collage.worker.store_callback import StoreCallback

    callback = StoreCallback(Sink(), "run", queue_size=1)  # type: ignore[arg-type]
    for step in (1, 2, 3):
        callback.on_metrics(step, {"loss": 0.0})
        callback.on_progress(step, 3, 1.0)
    callback.on_end("succeeded")
    assert calls == [(kind, s) for s in (1, 2, 3) for kind in ("metrics", "progress")]


def test_an_in_memory_image_is_encoded_lazily():
    image = Image.new("RGB", (4, 3), (255, 0, 0))
    lazy = RolloutImage(None, None, 4, 3, image=image)
    assert not lazy.encoded
    assert lazy.sha256 == hashlib.sha256(lazy.png).hexdigest()
    assert lazy.encoded


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
