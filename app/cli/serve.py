"""``collage serve``: migrations, a first API token, the web app and N embedded workers, stopped together."""

from __future__ import annotations

import gc
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from collage.app.core.settings import get_settings
from collage.app.store.engine import engine_for, upgrade
from collage.app.store.tokens import (
    TokenRole,
    create_login_link,
    create_token,
    list_tokens,
    revoke_token,
    usable,
    verify_token,
)
from collage.training.data.synth import clean_stale_temp_folders
from collage.training.infra.objectstore import CACHE_UNITS


def token_file(home: Path) -> Path:
    return home / "token"


SERVE_TOKEN = "collage serve"


def serve_token_name(home: Path, workers: int) -> str:
    """The name of the admin token a `collage serve` keeps in its home: ``collage serve`` for a machine that runs
    everything, and one per web node for web-only nodes (``--workers 0``): replicas with homes of their own must
    never replace each other's token (a host and its home name it, so a lost token file replaces only its own)."""
    if workers > 0:
        return SERVE_TOKEN
    place = f"{socket.gethostname()}:{home.expanduser().absolute()}"
    return f"collage web {socket.gethostname()[:40]} {hashlib.sha256(place.encode()).hexdigest()[:8]}"


def ensure_token(engine, home: Path, name: str = SERVE_TOKEN) -> str:
    """This node's admin token ``name``, kept (mode 0600) in COLLAGE_HOME for `collage submit` on this machine;
    made if missing (or revoked: a revoked serve token is replaced, under the same name)."""
    path = token_file(home)
    if path.is_file():
        token = path.read_text().strip()
        found = verify_token(engine, token) if token else None
        if found is not None:
            return token
    if any(t.name == name and usable(t) for t in list_tokens(engine)):
        revoke_token(engine, name, actor="collage serve")  # its file was lost: the secret is unknown
    token = create_token(engine, name, TokenRole.ADMIN, actor="collage serve")
    home.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    os.chmod(path, 0o600)
    return token


def serve(host: str, port: int, workers: int) -> int:
    import uvicorn

    from collage.app.main import create_app
    from collage.worker.dispatcher import CeleryDispatcher
    from collage.worker.reaper import Reaper

    settings = get_settings()
    upgrade(settings.database_url)
    engine = engine_for(settings.database_url)
    name = serve_token_name(settings.home, workers)
    ensure_token(engine, settings.home, name)
    removed = clean_stale_temp_folders()
    if removed:
        print(f"removed {removed} unfinished synthetic dataset folder(s) left by an earlier crash", flush=True)
    link = create_login_link(engine, name, actor="collage serve")
    app = create_app(settings, CeleryDispatcher(settings, engine))
    pool = WorkerPool(workers)
    pool.start()
    reaper = Reaper(engine, settings.heartbeat_timeout)
    reaper.start()
    # a web-only node's cache is everything it fetched to serve; with embedded workers, the runs' folders are theirs
    pruner = settings.cache_pruner(kinds=CACHE_UNITS if workers == 0 else ("images", "thumbs", "checks", "exports"))
    if pruner is not None:
        pruner.start()
    base = f"http://{host}:{port}"
    print(f"Collage is serving on {base}", flush=True)
    print(f"  login link: {base}/login/link/{link}   (one use, 10 minutes; `collage token link NAME` for more)",
          flush=True)  # fmt: skip
    print(f"  admin API token in {token_file(settings.home)} (`collage submit` reads it; its name: {name})", flush=True)
    print(f"  API docs:   {base}/api/v1/docs", flush=True)
    print(f"  store: {engine.url.render_as_string(hide_password=True)}; workers: {workers}", flush=True)
    try:
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", forwarded_allow_ips=settings.forwarded_allow_ips
        )
        freeze_startup_heap()
        uvicorn.Server(config).run()
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping: workers checkpoint their runs and exit", flush=True)
        reaper.stop()
        if pruner is not None:
            pruner.stop()
        pool.stop(settings.cancel_grace + 10)
    return 0


def freeze_startup_heap() -> None:
    """Move everything start-up made (the imported modules, the app and its routes, SQLAlchemy's and pydantic's
    models) out of reach of the cyclic garbage collector, for the life of the process. Otherwise each full
    collection walks all of it, and on SQLite the metrics route's p95 was those pauses: 60 requests in one process
    took 151-260 ms ten times, and none over 100 ms with the start-up heap frozen (docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()


class WorkerPool(threading.Thread):
    """The embedded workers; one that dies is reported and restarted (at most 5 times a minute)."""

    def __init__(self, count: int):
        super().__init__(name="collage-workers", daemon=True)
        self.names = [f"embedded-{i + 1}-{os.getpid()}" for i in range(count)]
        self.children: dict[str, subprocess.Popen] = {}
        self.restarts: list[float] = []
        self.stopping = threading.Event()

    def _spawn(self, name: str) -> None:
        # the worker ends when `collage serve` does, even on kill -9 of serve: seeing COLLAGE_PARENT_PID, it asks
        # the kernel for SIGTERM on serve's death (PR_SET_PDEATHSIG, set by the worker itself after exec: a
        # preexec_fn may deadlock in a fork from this threaded process) and also watches for it. Process plumbing,
        # not configuration: the child inherits serve's environment (its Settings come from there) plus this mark
        env = {**os.environ, "COLLAGE_PARENT_PID": str(os.getpid())}
        self.children[name] = subprocess.Popen(
            [sys.executable, "-m", "collage.app.cli", "worker", "--quiet", "--name", name], env=env
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
