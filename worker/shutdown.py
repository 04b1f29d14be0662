"""How a worker stops: a signal only raises a flag; one shutdown path, outside any signal handler, acts on it.

A signal handler runs on the main thread in the middle of whatever it was doing, possibly inside a store
transaction, and a second signal runs a second copy of it on top of the first: a handler that writes to the
store can wait on a lock its own thread holds (SQLite: "database is locked" after the busy timeout, the store
blocked for everyone meanwhile). So :meth:`StopFlag.request` is a plain assignment, and the supervisor, which
polls the flag with the run's status, runs the shutdown once: it asks the training process to checkpoint and
stop (SIGTERM, which the child turns into a flag of its own) and records why in the store, the write bounded.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("collage.worker")

SHUTDOWN_BOUND = 10.0  # seconds the shutdown's own store writes may take; past that the worker goes on without


class StopFlag:
    """Set from a signal handler (async-signal-safe: one attribute assignment, no lock, no I/O), read by the
    supervisor's loop. Setting it twice is setting it once."""

    def __init__(self) -> None:
        self.requested = False
        self.why = ""

    def request(self, why: str = "shutting down") -> None:
        if not self.requested:
            self.why = why
        self.requested = True


def bounded(work: Callable[[], object], seconds: float, what: str) -> bool:
    """Run ``work`` on a helper thread and wait for it at most ``seconds``; whether it finished without error.
    A store that stays locked (a process frozen mid-transaction) cannot hold the shutdown past the bound."""
    done: list[bool] = []

    def run() -> None:
        try:
            work()
            done.append(True)
        except Exception:  # a shutdown step that fails is logged; the shutdown goes on
            log.exception("%s failed", what)

    thread = threading.Thread(target=run, name=f"collage-shutdown-{what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        log.error("%s did not finish within %.0fs: going on without it", what, seconds)
        return False
    return bool(done)


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Ask the kernel for ``sig`` when the process (thread) that started this one dies (Linux
    ``PR_SET_PDEATHSIG``), set here, after exec, rather than in a ``preexec_fn``: a fork from a threaded parent
    may deadlock before exec (an import lock or allocator lock held by another thread), and such a child never
    asks for the signal. If ``parent`` is already gone, exit at once."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
        except OSError:
            return
    if os.getppid() != parent:
        log.warning("the process that started this one (pid %s) is gone: exiting", parent)
        os._exit(0)
