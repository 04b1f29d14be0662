"""``collage serve``: migrations, a first API token, the web app and N embedded workers, stopped together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .db import engine_for, upgrade
from .settings import get_settings
from .store.tokens import create_token, verify_token


def token_file(home: Path) -> Path:
    return home / "token"


def ensure_token(engine, home: Path) -> str:
    """The token this installation's `serve` prints: kept (mode 0600) in COLLAGE_HOME, made if missing."""
    path = token_file(home)
    if path.is_file():
        token = path.read_text().strip()
        if token and verify_token(engine, token) is not None:
            return token
    token = create_token(engine, "collage serve")
    home.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    os.chmod(path, 0o600)
    return token


def serve(host: str, port: int, workers: int) -> int:
    import uvicorn

    from collage.worker.dispatcher import CeleryDispatcher
    from collage.worker.reaper import Reaper

    from .main import create_app

    settings = get_settings()
    upgrade(settings.database_url)
    engine = engine_for(settings.database_url)
    token = ensure_token(engine, settings.home)
    app = create_app(settings, CeleryDispatcher(settings, engine))
    pool = WorkerPool(workers)
    pool.start()
    reaper = Reaper(engine, settings.heartbeat_timeout)
    reaper.start()
    base = f"http://{host}:{port}"
    print(f"Collage is serving on {base}", flush=True)
    print(f"  login link: {base}/login?token={token}", flush=True)
    print(f"  API token:  {token}   (also in {token_file(settings.home)})", flush=True)
    print(f"  API docs:   {base}/api/v1/docs", flush=True)
    print(f"  store: {engine.url.render_as_string(hide_password=True)}; workers: {workers}", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run()
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping: workers checkpoint their runs and exit", flush=True)
        reaper.stop()
        pool.stop(settings.cancel_grace + 10)
    return 0


class WorkerPool(threading.Thread):
    """The embedded workers; one that dies is reported and restarted (at most 5 times a minute)."""

    def __init__(self, count: int):
        super().__init__(name="collage-workers", daemon=True)
        self.names = [f"embedded-{i + 1}-{os.getpid()}" for i in range(count)]
        self.children: dict[str, subprocess.Popen] = {}
        self.restarts: list[float] = []
        self.stopping = threading.Event()

    def _spawn(self, name: str) -> None:
        self.children[name] = subprocess.Popen(
            [sys.executable, "-m", "collage.app.cli", "worker", "--quiet", "--name", name]
        )

    def start(self) -> None:
        for name in self.names:
            self._spawn(name)
        super().start()

    def run(self) -> None:
        while not self.stopping.wait(2):
            for name, child in list(self.children.items()):
                code = child.poll()
                if code is None or self.stopping.is_set():
                    continue
                now = time.monotonic()
                self.restarts = [t for t in self.restarts if now - t < 60]
                if len(self.restarts) >= 5:
                    print(f"error: embedded worker {name} keeps exiting (code {code}); not restarting it", flush=True)
                    del self.children[name]
                    continue
                print(f"warning: embedded worker {name} exited with code {code}; restarting it", flush=True)
                self.restarts.append(now)
                self._spawn(name)

    def stop(self, grace: float) -> None:
        self.stopping.set()
        _stop(list(self.children.values()), grace)


def _stop(children: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM: each worker asks its run to checkpoint and stop, then exits; SIGKILL whoever outlives ``grace``."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
