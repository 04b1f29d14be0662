"""The dataset helper, seen from the web process: the long-lived child process that answers dataset requests
(``collage.app.datasets.process``) and the gate that bounds how many of them one web process takes on.

The web process never imports the training code (and never opens user files in-process): it hands each request to
the helper, a child that keeps torch/transformers imported and the models' processors loaded between requests (a
fresh ``collage data check`` spent 25-30 s of a 200-row check importing them). The child runs in an empty folder,
so that a relative name (a hub id) is never a file on the server. One helper per web process answers one request
at a time; it exits after ``COLLAGE_DATA_HELPER_IDLE`` seconds idle and is started again on the next request.

Bounds (app.settings): each token has at most ``dataset_per_user`` requests in flight and the process at most
``dataset_queue`` (running or waiting for the helper); more are answered 429 with ``Retry-After``. Waiting happens
in the gate's own threads, never in the threadpool every other route shares (45 waiting previews once held all of
its threads, and ``/runs`` and ``/health`` hung behind them). A request that runs past its time (waiting included)
is answered 504 and its helper is killed, with what it was writing under ``COLLAGE_HOME/cache``.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException

from collage.app.core.jsonlines import ChildGone, JsonLinesChild
from collage.app.core.settings import Settings, home_from
from collage.app.store.tables import ApiToken
from collage.training.data.check import remove_temp_files_of
from collage.training.data.synth import remove_temp_folders_of

log = logging.getLogger("collage.api")

TIMEOUT = 600
RETRY_AFTER_SECONDS = 5


class DataHelper:
    """The child process that answers dataset requests, started on first use and restarted when it has exited
    (idle, crashed, or killed after a timeout). Thread-safe: requests are serialised."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.lock = threading.Lock()
        self.child = JsonLinesChild("the dataset helper")
        self.folder: str | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.child.proc

    def _start(self) -> None:
        self._stop()
        self.folder = tempfile.mkdtemp(prefix="collage-data-")
        self.child.start([sys.executable, "-m", "collage.app.datasets.process"], self.env, cwd=self.folder)

    def _stop(self) -> None:
        proc = self.child.proc
        self.child.kill()
        if proc is not None:
            self._remove_leftovers(proc.pid)
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def _remove_leftovers(self, pid: int) -> None:
        """What a killed (or crashed) helper was writing under COLLAGE_HOME/cache: a synthetic dataset's temporary
        folder and a half-written check report, named with its pid. Finished datasets and reports stay."""
        home = home_from(self.env)  # the child's home: Settings.from_env in the child reads the same environment
        try:
            remove_temp_folders_of(pid, home / "cache" / "datasets")
            remove_temp_files_of(pid, home / "cache" / "checks")
        except OSError as exc:  # the next clean_stale_temp_folders (serve, worker start) gets the rest
            log.warning("could not remove what dataset helper %d left in %s: %s", pid, home / "cache", exc)

    def close(self) -> None:
        with self.lock:
            self._stop()

    def _exchange(self, request: dict[str, Any], timeout: float, deadline: float) -> dict[str, Any]:
        self.child.send(request)
        answer = self.child.receive(until=deadline)
        if answer is None:
            self._stop()  # whatever it is stuck on, the next request gets a fresh helper
            raise HTTPException(504, f"the dataset took longer than {timeout:.0f}s to read")
        return answer

    def call(self, request: dict[str, Any], timeout: float = TIMEOUT) -> dict[str, Any]:
        """The helper's answer, ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": ...}``, within
        ``timeout`` seconds, waiting for other requests included (503 when they keep the helper that long, 504
        when this one runs past it). A helper that exited (idle, or crashed) is started again and asked once more."""
        deadline = time.monotonic() + timeout
        if timeout <= 0 or not self.lock.acquire(timeout=timeout):
            raise HTTPException(
                503,
                f"the dataset helper was busy with other requests for {timeout:.0f}s: retry in {RETRY_AFTER_SECONDS} s",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        try:
            for attempt in (1, 2):
                if self.child.running is None:
                    self._start()
                try:
                    return self._exchange(request, timeout, deadline)
                except ChildGone as exc:
                    self._stop()
                    if attempt == 2:
                        raise HTTPException(500, f"the dataset helper failed: {exc}") from exc
                    log.info("dataset helper was gone (%s): starting a new one", exc)
        finally:
            self.lock.release()
        raise AssertionError("unreachable")


_helper: DataHelper | None = None
_helper_lock = threading.Lock()


def _helper_env() -> dict[str, str]:
    # process plumbing, not configuration read here: the child inherits this process's environment and reads its
    # settings from it itself (Settings.from_env); only a relative COLLAGE_HOME is made absolute, because the child
    # runs in another folder and the name must keep meaning the same one
    env = dict(os.environ)
    if env.get("COLLAGE_HOME"):
        env["COLLAGE_HOME"] = str(home_from(env).absolute())
    return env


def data_helper() -> DataHelper:
    """This process's dataset helper; a new one when the environment changed (another ``COLLAGE_HOME``)."""
    global _helper
    env = _helper_env()
    with _helper_lock:
        if _helper is None or _helper.env != env:
            if _helper is not None:
                _helper.close()
            _helper = DataHelper(env)
        return _helper


def warm_up() -> None:
    """Start the helper and import the training stack in it, in the background (the launch page calls this, so
    that the first *Preview and check* does not pay for the imports)."""

    def work() -> None:
        try:
            data_helper().call({"op": "warm"}, timeout=300)
        except Exception:
            log.exception("could not warm the dataset helper up")

    threading.Thread(target=work, name="collage-data-warm", daemon=True).start()


@atexit.register
def _close_helper() -> None:
    if _helper is not None:
        _helper.close()


def _ask(request: dict[str, Any], timeout: float) -> Any:
    answer = data_helper().call(request, timeout=timeout)
    if not answer.get("ok"):
        raise HTTPException(400, str(answer.get("error") or "the dataset could not be read"))
    return answer["result"]


class DatasetGate:
    """Admission of one web process's dataset requests: at most ``per_user`` in flight per token and ``queue`` in
    all (running or waiting for the helper); beyond, 429 at once. Admitted requests wait in threads of their own,
    so the threadpool every other route needs stays free."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight: dict[str, int] = {}
        self.total = 0

    def _admit(self, who: str, per_user: int, queue: int) -> None:
        with self.lock:
            mine = self.in_flight.get(who, 0)
            if mine >= per_user:
                message = f"this token already has {mine} dataset request(s) in flight (at most {per_user})"
            elif self.total >= queue:
                message = f"the server is busy with {self.total} dataset requests (at most {queue} at once)"
            else:
                self.in_flight[who] = mine + 1
                self.total += 1
                return
        raise HTTPException(
            429, f"{message}: retry in {RETRY_AFTER_SECONDS} s", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
        )

    def _release(self, who: str) -> None:
        with self.lock:
            self.total -= 1
            left = self.in_flight[who] - 1
            if left:
                self.in_flight[who] = left
            else:
                del self.in_flight[who]

    async def run(self, who: str, per_user: int, queue: int, work: Callable[[], Any]) -> Any:
        """``work()`` in a thread of its own once admitted (admission bounds how many; daemon threads, so a server
        that stops never waits for them). The slot is given back when the work ends, not when the client goes
        away: an abandoned request still holds the helper until it is answered or killed."""
        self._admit(who, per_user, queue)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if answer.done():  # the request was cancelled (its client went away)
                return
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(result)

        def target() -> None:
            result, error = None, None
            try:
                result = work()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting request, which raises it
                error = exc
            finally:
                self._release(who)
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the request's event loop has closed meanwhile
                pass

        try:
            threading.Thread(target=target, name="collage-dataset", daemon=True).start()
        except BaseException:
            self._release(who)
            raise
        return await answer


async def run_gated(gate: DatasetGate, settings: Settings, token: ApiToken, job: dict[str, Any], timeout: float) -> Any:
    """The helper's answer to ``job`` once ``gate`` admits it (the token's and the process's bounds of ``settings``);
    ``timeout`` counts from the admission, waiting for the helper included."""
    deadline = time.monotonic() + timeout
    return await gate.run(
        str(token.id), settings.dataset_per_user, settings.dataset_queue, lambda: _ask(job, deadline - time.monotonic())
    )
