"""Off the training loop, on threads alone: the background writer (bounded, failing once and for all, draining on
close), the worker's store callback keeping the order of writes and ending the process on a stale attempt, and a
rollout row's in-memory image encoded lazily."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
from PIL import Image

from collage.training.callbacks import BackgroundWriter, RolloutImage
from tests.support.waiting import blocked_in, scaled, wait_for


# ---------------------------------------------------------------- BackgroundWriter
def test_put_blocks_at_capacity_while_the_sink_is_slow():
    release, taken = threading.Event(), threading.Event()
    done: list[int] = []
    writer = BackgroundWriter(maxsize=1)

    def task(n):
        return lambda: (taken.set(), release.wait(30), done.append(n))

    writer.put(task(1))
    assert taken.wait(scaled(30))  # taken by the thread, which blocks in the sink
    writer.put(task(2))  # fills the queue
    third = threading.Thread(target=writer.put, args=(task(3),))
    third.start()
    wait_for(lambda: blocked_in(third, "put", "queue.py"), "the third put to block in the full queue")
    assert third.is_alive() and done == [], "put must block while the queue is full"
    release.set()
    third.join(scaled(30))
    assert not third.is_alive()
    writer.close()
    assert done == [1, 2, 3]


def _boom():
    raise ValueError("sink failed")


def writer_put(writer: BackgroundWriter, task) -> BaseException | None:
    """``writer.put(task)`` on this thread; what it raised, or None."""
    try:
        writer.put(task)
    except BaseException as exc:  # noqa: BLE001 - handed back to the test
        return exc
    return None


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
    thread.join(scaled(timeout))
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
    taken = threading.Event()
    writer.put(lambda: (taken.set(), release.wait(30), _boom()))
    assert taken.wait(scaled(30))  # taken by the thread, which blocks in the sink
    writer.put(lambda: done.append(2))  # fills the queue
    outcome: list[BaseException | None] = []
    putting = threading.Thread(target=lambda: outcome.append(writer_put(writer, lambda: done.append(3))))
    putting.start()
    wait_for(lambda: blocked_in(putting, "put", "queue.py"), "the third put to block in the full queue")
    assert putting.is_alive(), "put must block while the queue is full"
    release.set()
    putting.join(scaled(30))
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


def test_close_drains_everything_queued():
    done: list[int] = []
    writer = BackgroundWriter(maxsize=2)
    for n in range(6):
        writer.put(lambda n=n: (time.sleep(0.01), done.append(n)))  # a slow sink (not a wait of the test)
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
            time.sleep(0.02)  # a slow sink (not a wait of the test)
            calls.append(("metrics", step))

        def set_progress(self, run_id, step, seconds_per_step=None):
            assert seconds_per_step == 1.0  # the step time the trainer measured reaches the store
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
