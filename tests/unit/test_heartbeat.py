"""worker/heartbeat.py: the one heartbeat thread the supervisor, the training process and the jobs share."""

from __future__ import annotations

import threading

import pytest

from collage.worker.heartbeat import Heartbeat
from tests.support.waiting import blocked_in, scaled, wait_for


def _wait(predicate, what: str) -> None:
    wait_for(predicate, what, timeout=10, interval=0.01)


def test_it_beats_every_interval_until_stopped():
    beats: list[int] = []
    with Heartbeat(lambda: beats.append(1), 0.01, "t") as heartbeat:
        _wait(lambda: len(beats) >= 3, "three beats")
    count = len(beats)
    # stopped and waited for: its thread has ended, so no beat can come after the block
    assert not heartbeat._thread.is_alive() and len(beats) == count


@pytest.mark.parametrize("first_now", [True, False])
def test_the_first_beat_comes_at_once_only_when_asked(first_now):
    beats: list[int] = []
    with Heartbeat(lambda: beats.append(1), 3600, "t", first_now=first_now) as heartbeat:
        if first_now:
            _wait(lambda: beats == [1], "the first beat")
        else:  # the thread is waiting out its first interval (an hour): nothing beats before the block ends
            _wait(lambda: blocked_in(heartbeat._thread, "wait", "threading.py"), "the thread to wait its interval")
    assert beats == ([1] if first_now else [])


def test_a_failing_beat_is_logged_and_the_next_one_tries_again(caplog):
    calls = []

    def beat():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("the store is away")

    with Heartbeat(beat, 0.02, "flaky", first_now=True):
        _wait(lambda: len(calls) >= 4, "four tries")
    assert sum("flaky: heartbeat failed" in r.getMessage() for r in caplog.records) == 2


def test_a_beat_that_returns_false_ends_the_thread():
    calls = []
    heartbeat = Heartbeat(lambda: calls.append(1) or len(calls) < 2, 0.01, "stale", first_now=True).start()
    _wait(lambda: not heartbeat._thread.is_alive(), "the thread to end")
    assert len(calls) == 2
    heartbeat.stop()  # after its end: nothing to wait for


def test_stop_without_waiting_returns_while_a_beat_is_in_progress():
    inside, release = threading.Event(), threading.Event()

    def slow_beat():
        inside.set()
        release.wait(30)

    heartbeat = Heartbeat(slow_beat, 0.01, "slow", first_now=True).start()
    assert inside.wait(scaled(30))
    heartbeat.stop(wait=False)
    # it returned while the beat is still held inside slow_beat: it did not wait for the thread
    assert heartbeat._thread.is_alive() and not release.is_set()
    release.set()
    heartbeat._thread.join(scaled(30))
    assert not heartbeat._thread.is_alive()
