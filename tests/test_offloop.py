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

from collage.training.batching.encoding import PromptEncoder
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


def _boom():
    raise ValueError("sink failed")


def _in_thread(call, timeout: float = 30.0) -> BaseException | None:
    """Run ``call`` on a thread with a generous liveness bound; returns what it raised (a hang fails the test)."""
    raised: list[BaseException | None] = [None]

    def run():
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            raised[0] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{call} hung"
    return raised[0]


def test_after_a_failure_nothing_more_is_written_and_every_call_raises():
    """One rule: once a task raised, the tasks queued behind it and every task queued later never run, and every
    later put, flush and close raises that same error (flush twice, close twice included)."""
    release = threading.Event()
    done: list[str] = []
    writer = BackgroundWriter(maxsize=8)
    writer.put(lambda: (release.wait(30), _boom()))
    writer.put(lambda: done.append("queued before the failure"))
    writer.put(lambda: done.append("queued before the failure, too"))
    release.set()
    errors = []
    for call in (writer.flush, writer.flush, lambda: writer.put(lambda: done.append("put after")), writer.close,
                 writer.close, lambda: writer.put(lambda: done.append("put after close"))):  # fmt: skip
        error = _in_thread(call)
        assert isinstance(error, ValueError) and str(error) == "sink failed", (call, error)
        errors.append(error)
    assert len({id(e) for e in errors}) == 1, "the original error itself, every time"
    assert done == []


def test_a_put_waiting_for_room_when_a_task_fails_raises_and_its_task_never_runs():
    release = threading.Event()
    done: list[int] = []
    writer = BackgroundWriter(maxsize=1)
    writer.put(lambda: (release.wait(30), _boom()))  # taken by the thread, which blocks in the sink
    time.sleep(0.05)
    writer.put(lambda: done.append(2))  # fills the queue
    outcome: list[BaseException | None] = []
    third = threading.Thread(target=lambda: outcome.append(_in_thread(lambda: writer.put(lambda: done.append(3)))))
    third.start()
    third.join(0.3)
    assert third.is_alive(), "put must block while the queue is full"
    release.set()
    third.join(30)
    assert isinstance(outcome[0], ValueError)
    with pytest.raises(ValueError, match="sink failed"):
        writer.close()
    assert done == []


def test_an_on_error_hook_that_raises_neither_hangs_nor_hides_the_error():
    """The hook runs after the error is recorded; if it raises, that is logged, the thread lives on, and every later
    call raises the task's error (it used to kill the thread before the error was recorded: flush then passed, and
    the next one blocked for ever)."""
    seen: list[BaseException] = []

    def hook(exc):
        seen.append(exc)
        raise RuntimeError("the hook failed too")

    done: list[int] = []
    writer = BackgroundWriter(maxsize=2, on_error=hook)
    writer.put(_boom)
    for call in (writer.flush, lambda: writer.put(lambda: done.append(1)), writer.flush, writer.close):
        error = _in_thread(call)
        assert isinstance(error, ValueError) and str(error) == "sink failed", (call, error)
    assert len(seen) == 1 and seen[0] is error
    assert done == []


def test_an_error_is_raised_with_the_failed_tasks_traceback():
    writer = BackgroundWriter(maxsize=2)
    writer.put(_boom)
    for _ in range(3):  # raised again and again, its traceback does not grow
        with pytest.raises(ValueError) as info:
            writer.flush()
        names = [entry.name for entry in info.traceback]
        assert names.count("_boom") == 1 and names.count("flush") == 1, names
    with pytest.raises(ValueError):
        writer.close()


def test_a_failing_callback_still_lets_every_other_callback_hear_the_failure_and_the_end(tmp_path):
    """A callback whose background writer failed raises its error into the trainer; the failure path (the error
    event, then on_end) still reaches every other callback, the failed one hears on_end only (and raises there
    again), and train() raises the original error."""
    from .test_training import Recorder

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
