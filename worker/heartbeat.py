"""A heartbeat from a thread: while a process does something long (starting a training process, a job, a
training step), a thread tells the store, every few seconds, that the work is alive."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Heartbeat:
    """Calls ``beat`` every ``every`` seconds from a daemon thread (first at once with ``first_now``), until
    :meth:`stop` or until ``beat`` returns False. An exception is logged and the next beat tries again: the store
    may be briefly unreachable, and a missed beat is what the reaper's timeout allows for. Also a context manager
    (start, then stop and wait for the thread)."""

    def __init__(self, beat: Callable[[], bool | None], every: float, name: str, first_now: bool = False) -> None:
        self.beat, self.every, self.name, self.first_now = beat, every, name, first_now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        if not self.first_now and self._stop.wait(self.every):
            return
        while True:
            try:
                if self.beat() is False:
                    return
            except Exception:
                log.exception("%s: heartbeat failed", self.name)
            if self._stop.wait(self.every):
                return

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        self._stop.set()
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
