"""Waiting in tests: every wait is a condition with a deadline, never a fixed sleep.

One setting stretches every deadline for a slow or loaded machine: ``COLLAGE_TEST_TIME_SCALE`` (a positive number,
default 1). Each deadline in the suite is written for an ordinary 2-core machine with the suite's other jobs beside
it and is multiplied by the scale; so are the heartbeat, reaper and grace timeouts that tests give Collage's
processes (:func:`scaled`), so that a slow machine never looks like a frozen process. A deadline is a bound on a
condition that is expected to become true, not an estimate of how long it takes: a test is never made faster by a
shorter one, only flakier.

:func:`wait_for` polls a probe until its value satisfies a condition and, when the deadline passes, fails saying
what it waited for, how long, and the last value (or error) it saw.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _time_scale() -> float:
    raw = os.environ.get("COLLAGE_TEST_TIME_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        raise RuntimeError(f"COLLAGE_TEST_TIME_SCALE must be a positive number, not {raw!r}") from None
    if not scale > 0:
        raise RuntimeError(f"COLLAGE_TEST_TIME_SCALE must be a positive number, not {raw!r}")
    return scale


TIME_SCALE = _time_scale()


def scaled(seconds: float) -> float:
    """``seconds`` stretched by ``COLLAGE_TEST_TIME_SCALE``: for every deadline and every timeout a test hands to
    Collage (heartbeat, reaper, cancel grace, request timeouts)."""
    return seconds * TIME_SCALE


class WaitTimeout(AssertionError):
    """A condition a test waited for did not become true before its deadline."""


def _describe(value: object, limit: int = 1500) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _tails(logs: Iterable[Path], chars: int = 3000) -> str:
    out = []
    for path in logs:
        try:
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        except OSError as exc:
            out.append(f"--- {path.name}: unreadable ({exc})")
    return "\n".join(out)


def wait_for(
    probe: Callable[[], T],
    what: str,
    *,
    until: Callable[[T], Any] = bool,
    timeout: float = 60.0,
    interval: float = 0.1,
    ignore: tuple[type[BaseException], ...] = (),
    logs: Iterable[Path] = (),
    gone: Callable[[], str | None] | None = None,
) -> T:
    """Call ``probe`` until ``until(value)`` is true and return that value; fail after ``scaled(timeout)`` s.

    ``ignore``: exceptions of the probe that mean "not yet" (a server still starting); the last one is reported.
    ``logs``: files whose tails the failure message carries (a server's or a worker's log).
    ``gone``: says why the condition can no longer come true (the process that would make it true has exited),
    or None; checked before each try, it fails the wait at once instead of at the deadline.
    """
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    seen: object = "<nothing: the probe never returned>"
    logs = list(logs)
    while True:
        lost = gone() if gone is not None else None
        if lost:
            tails = _tails(logs)
            raise WaitTimeout(f"gave up waiting for {what}: {lost}; last seen: {_describe(seen)}"
                              + ("\n" + tails if tails else ""))  # fmt: skip
        try:
            value = probe()
        except ignore as exc:
            seen = f"{type(exc).__name__}: {exc}"
        else:
            if until(value):
                return value
            seen = value
        if time.monotonic() >= deadline:
            message = f"timed out after {limit:.0f} s waiting for {what}; last seen: {_describe(seen)}"
            tails = _tails(logs)
            raise WaitTimeout(message + ("\n" + tails if tails else ""))
        time.sleep(interval)


def blocked_in(thread, function: str, module: str) -> bool:
    """Whether ``thread`` is inside ``function`` of the module file ``module`` (its stack, as it is now): how a
    test sees that a call blocks (``Queue.put`` on a full queue) instead of guessing from a time that it did."""
    import sys

    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        code = frame.f_code
        if code.co_name == function and code.co_filename.endswith(module):
            return True
        frame = frame.f_back
    return False
