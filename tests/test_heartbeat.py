"""worker/heartbeat.py: the one heartbeat thread the supervisor, the training process and the jobs share."""

from __future__ import annotations

import threading
import time

import pytest

from collage.worker.heartbeat import Heartbeat


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_it_beats_every_interval_until_stopped():
    beats: list[int] = []
    with Heartbeat(lambda: beats.append(1), 0.01, "t"):
        _wait(lambda: len(beats) >= 3)
    count = len(beats)
    time.sleep(0.1)
    assert len(beats) == count  # stopped (and waited for): no beat after the block


@pytest.mark.parametrize("first_now", [True, False])
def test_the_first_beat_comes_at_once_only_when_asked(first_now):
    beats: list[int] = []
    with Heartbeat(lambda: beats.append(1), 3600, "t", first_now=first_now):
        if first_now:
            _wait(lambda: beats == [1])
        else:
            time.sleep(0.2)
    assert beats == ([1] if first_now else [])


def test_a_failing_beat_is_logged_and_the_next_one_tries_again(caplog):
    calls = []

    def beat():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("the store is away")

    with Heartbeat(beat, 0.02, "flaky", first_now=True):
        _wait(lambda: len(calls) >= 4)
    assert sum("flaky: heartbeat failed" in r.getMessage() for r in caplog.records) == 2


def test_a_beat_that_returns_false_ends_the_thread():
    calls = []
    heartbeat = Heartbeat(lambda: calls.append(1) or len(calls) < 2, 0.01, "stale", first_now=True).start()
    _wait(lambda: not heartbeat._thread.is_alive())
    assert len(calls) == 2
    heartbeat.stop()  # after its end: nothing to wait for


def test_stop_without_waiting_returns_while_a_beat_is_in_progress():
    inside, release = threading.Event(), threading.Event()

    def slow_beat():
        inside.set()
        release.wait(5)

    heartbeat = Heartbeat(slow_beat, 0.01, "slow", first_now=True).start()
    assert inside.wait(5)
    started = time.monotonic()
    heartbeat.stop(wait=False)
    assert time.monotonic() - started < 1
    release.set()
    heartbeat._thread.join(5)
    assert not heartbeat._thread.is_alive()
