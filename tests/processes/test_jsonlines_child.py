"""The one JSON-lines child-process class (app/core/jsonlines.py) that the dataset helper and a worker's playground
process are built on, with real processes: an answer, an answer that overruns its deadline, a child that dies
before and after it answers, one killed by a signal, a frozen one, and the gentle close."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from collage.app.core.jsonlines import ChildGone, JsonLinesChild

ECHO = """
import json, sys, time
for line in sys.stdin:
    request = json.loads(line)
    if request.get("op") == "exit":
        sys.exit(int(request["code"]))
    if request.get("op") == "sleep":
        time.sleep(float(request["seconds"]))
    print(json.dumps({"event": "received"}), flush=True)
    print(json.dumps({"ok": True, "echo": request}), flush=True)
"""


@pytest.fixture
def child():
    made = JsonLinesChild("the test child")
    yield made
    made.kill()


def _start(child: JsonLinesChild) -> None:
    child.start([sys.executable, "-c", ECHO], dict(os.environ))


def test_answers_come_in_order_events_first(child):
    _start(child)
    child.send({"op": "hello", "n": 1})
    assert child.receive(until=time.monotonic() + 30) == {"event": "received"}
    assert child.receive(until=time.monotonic() + 30) == {"ok": True, "echo": {"op": "hello", "n": 1}}
    child.send({"op": "hello", "n": 2})  # two lines in one read are kept for the next receive
    assert child.receive(until=time.monotonic() + 30)["event"] == "received"
    assert child.receive(until=time.monotonic() + 30)["echo"]["n"] == 2


def test_a_deadline_passes_without_an_answer_and_the_process_is_left_to_the_caller(child):
    _start(child)
    child.send({"op": "sleep", "seconds": 30})
    started = time.monotonic()
    assert child.receive(until=started + 0.5) is None
    assert time.monotonic() - started < 10 and child.running is not None
    pid = child.proc.pid
    child.kill()
    assert child.proc is None and child.running is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_child_that_exits_is_gone_with_its_exit_code(child):
    _start(child)
    child.send({"op": "exit", "code": 3})
    with pytest.raises(ChildGone, match="the test child exited with code 3"):
        child.receive(until=time.monotonic() + 30)
    with pytest.raises(ChildGone, match="exited with code 3"):  # and a request to it can no longer be sent
        for _ in range(100):  # the pipe takes a write or two before it breaks
            child.send({"op": "hello"})


def test_a_killed_child_says_by_which_signal(child):
    _start(child)
    child.send({"op": "sleep", "seconds": 30})
    os.kill(child.proc.pid, signal.SIGKILL)
    with pytest.raises(ChildGone, match=r"killed by signal SIGKILL \(out of memory\?"):
        child.receive(until=time.monotonic() + 30)


def test_a_frozen_child_is_killed_and_a_new_one_answers(child):
    _start(child)
    os.kill(child.proc.pid, signal.SIGSTOP)
    child.send({"op": "hello"})
    assert child.receive(until=time.monotonic() + 0.5) is None
    child.kill()  # SIGKILL ends a stopped process too
    _start(child)
    child.send({"op": "hello"})
    child.receive(until=time.monotonic() + 30)
    assert child.receive(until=time.monotonic() + 30)["ok"]


def test_close_ends_it_at_end_of_input_and_kills_one_that_lingers(child):
    _start(child)
    proc = child.proc
    child.close(grace=10)
    assert proc.returncode == 0 and child.proc is None  # it read end of input and exited
    child.start([sys.executable, "-c", "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                 "time.sleep(60)"], dict(os.environ))  # fmt: skip
    lingering = child.proc
    child.close(grace=0.5)
    assert lingering.returncode == -signal.SIGKILL


def test_a_request_to_no_process_is_gone():
    with pytest.raises(ChildGone, match="the test child is not running"):
        JsonLinesChild("the test child").send({"op": "hello"})
