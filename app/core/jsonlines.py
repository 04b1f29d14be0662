"""A long-lived child process spoken to in JSON lines: a request on its stdin, answers (and events) on its stdout.

The web tier's dataset process (``app/datasets/client.py``) and a worker's playground process
(``worker/playground/service.py``) are both one of these: started on first use, in a session of their own (a Ctrl-C
at the parent's terminal is the parent's), read with a deadline (``select`` on the pipe, never a blocking read), and
killed with their whole process group when they overrun it. What differs (the request's retry, a cancel file, events
that report progress) stays with the caller; how a process is started, read, described when it ended and killed is
here, once.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from typing import Any

from .errors import PlatformError

READ_CHUNK = 1 << 16


class ChildGone(PlatformError):
    """The child process ended (or closed its output) before it answered; the message says how it ended."""


class JsonLinesChild:
    """One child process at a time; ``describe`` names it in messages ("the dataset helper"). Not thread-safe: the
    caller serialises its requests (each owner holds a lock around a request)."""

    def __init__(self, describe: str) -> None:
        self.describe = describe
        self.proc: subprocess.Popen | None = None
        self.buffer = b""

    @property
    def running(self) -> subprocess.Popen | None:
        """The process, while it runs."""
        proc = self.proc
        return proc if proc is not None and proc.poll() is None else None

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None = None) -> subprocess.Popen:
        """Start the process (the caller stopped any earlier one)."""
        self.buffer = b""
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=cwd, env=env,
                                     start_new_session=True)  # fmt: skip
        return self.proc

    def send(self, message: dict[str, Any]) -> None:
        """One request line; :class:`ChildGone` when the process cannot take it (it ended)."""
        proc = self._proc()
        assert proc.stdin is not None
        try:
            proc.stdin.write((json.dumps(message) + "\n").encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise ChildGone(self.ended()) from exc

    def receive(self, until: float) -> dict[str, Any] | None:
        """The next line the process wrote, parsed, or None once ``until`` (``time.monotonic()``) passes first;
        :class:`ChildGone` when its output ends."""
        proc = self._proc()
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = until - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, READ_CHUNK)
                if not chunk:
                    raise ChildGone(self.ended())
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def ended(self, wait: float = 10.0) -> str:
        """How the process ended, waiting up to ``wait`` seconds for it (then killing it): "the dataset helper exited
        with code 3", "... killed by signal SIGKILL (out of memory? ...)"."""
        proc = self._proc()
        try:
            code = proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.kill()
            code = proc.returncode
        if code is not None and code < 0:
            how = f"killed by signal {signal.Signals(-code).name}"
            if -code == signal.SIGKILL:
                how += " (out of memory? the kernel kills the largest process when memory runs out)"
        else:
            how = f"exited with code {code}"
        return f"{self.describe} {how}"

    def close(self, grace: float) -> None:
        """End the process the gentle way: its input closed (it exits at end of input), killed if it lingers past
        ``grace`` seconds; the pipes are closed and the process is forgotten."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=grace)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self._forget()

    def kill(self) -> None:
        """SIGKILL to the process's whole group (what it started too), waited for; the process is forgotten."""
        proc = self.proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a process in uninterruptible sleep: it goes when the kernel lets it
            pass
        self._forget()

    def _forget(self) -> None:
        proc, self.proc = self.proc, None
        for pipe in (proc.stdin, proc.stdout) if proc is not None else ():
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass

    def _proc(self) -> subprocess.Popen:
        if self.proc is None:
            raise ChildGone(f"{self.describe} is not running")
        return self.proc
