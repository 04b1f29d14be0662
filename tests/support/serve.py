"""``collage serve`` as a real process, as a person starts it: :class:`Serve` runs it on a free port with a home of
its own, waits until it answers with its workers registered, and stops it (Ctrl-C, as a terminal does) or kills it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from . import API, ROOT
from .services import free_port
from .waiting import scaled, wait_for

# variables of the test process that would point a serve at another store, broker, artifacts or server
FOREIGN = ("COLLAGE_DATABASE_URL", "COLLAGE_BROKER_URL", "COLLAGE_ARTIFACTS", "COLLAGE_SERVER", "COLLAGE_TOKEN")


def serve_env(home: Path, **extra: str) -> dict[str, str]:
    """`collage serve`'s embedded defaults on the COLLAGE_HOME ``home`` (SQLite store and broker inside it), the
    tests' reward module allowed, one torch thread per process, the heartbeat timeout and cancel grace stretched by
    the time scale; ``extra`` on top."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLLAGE_HOME": str(home), "OMP_NUM_THREADS": "1",
           "COLLAGE_REWARD_MODULES": "tests.support.rewards",
           # the production timeouts, stretched like every deadline of the tests
           "COLLAGE_HEARTBEAT_TIMEOUT": str(scaled(60)), "COLLAGE_CANCEL_GRACE": str(scaled(60))}  # fmt: skip
    for key in FOREIGN:
        env.pop(key, None)
    return {**env, **extra}


class Serve:
    """One ``collage serve`` process. ``args`` go to ``collage serve`` after ``--port``."""

    def __init__(self, home: Path, *args: str, env: dict[str, str] | None = None, port: int | None = None):
        self.home = home
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = env or serve_env(home)
        self.args = args
        # beside COLLAGE_HOME, not in it: serve makes its home owner-only, and a test checks that everything in it is
        self.log = home.parent / f"{home.name}.serve.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Serve:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        # its own process group: Ctrl-C and kill reach serve and everything it started, nothing else
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "collage.app.cli", "serve", "--port", str(self.port), *self.args],
            env=self.env, cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def token(self) -> str:
        return (self.home / "token").read_text().strip()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client(self, timeout: float = 30) -> httpx.Client:
        """An API client with the admin token serve wrote."""
        return httpx.Client(base_url=self.base + API, headers=self.headers, timeout=scaled(timeout))

    def exited(self) -> str | None:
        """Why serve is not running, or None while it runs."""
        if self.proc is not None and self.proc.poll() is not None:
            return f"collage serve exited with {self.proc.returncode}"
        return None

    def health(self) -> dict:
        """/health with the token (its workers listed); raises while serve is not answering yet."""
        return httpx.get(self.base + API + "/health", headers=self.headers, timeout=scaled(5)).json()

    def worker_pids(self) -> list[int]:
        return [int(w["pid"]) for w in self.health()["workers"]]

    def wait_up(self, workers: int = 1, timeout: float = 120) -> dict:
        """Until serve answers with at least ``workers`` live workers (0: until it answers at all)."""
        return wait_for(self.health, f"collage serve on {self.base} with {workers} worker(s)",
                        until=lambda h: h.get("ok") is not None and len(h.get("workers", [])) >= workers,
                        timeout=timeout, interval=0.3, ignore=(httpx.HTTPError, ValueError, OSError, KeyError),
                        logs=[self.log], gone=self.exited)  # fmt: skip

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def interrupt(self, timeout: float = 90) -> int:
        """Ctrl-C, as in a terminal; killed if it has not exited within the (scaled) ``timeout``."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=scaled(timeout))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"collage serve did not stop within {scaled(timeout):.0f} s of Ctrl-C") from None
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL to serve alone (its children are left to find out, as after an OOM kill)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def kill_group(self) -> None:
        """SIGKILL to serve and every process of its group (a test's end: nothing to keep)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real `collage serve` (embedded store, broker and one worker) shared by a test module: ``{base, token,
    home, client, env, serve}``. A test that needs a serve of its own (killed, restarted, other settings) starts
    one with :class:`Serve`."""
    serve = Serve(tmp_path_factory.mktemp("serve-home")).start()
    try:
        serve.wait_up(workers=1)
        client = serve.client()
        yield {"base": serve.base, "token": serve.token, "home": serve.home, "client": client, "env": serve.env,
               "serve": serve}  # fmt: skip
        client.close()
    finally:
        serve.interrupt()


def store_writer(server):
    """An engine and a StoreWriter on the module serve's own SQLite store: rows written as a worker would write
    them, without training."""
    from collage.app.store.engine import make_engine
    from collage.app.store.writer import StoreWriter

    engine = make_engine(f"sqlite:///{server['home'] / 'collage.db'}")
    return engine, StoreWriter(engine, server["home"] / "artifacts")
