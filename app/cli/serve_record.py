"""Where `collage serve` is listening, for the command line on the same machine.

Each running serve keeps one small JSON file, ``COLLAGE_HOME/serve/<pid>.json``: its URL, its process (pid and
the kernel's start time, so a recycled pid is not mistaken for it), how many embedded workers it started and
whether it is *ready* (the web app answers and, when it started workers, one of them takes runs from the
``default`` queue). Files are written atomically (a temporary file renamed over the old one) and removed when serve
stops; the file of a serve that was killed (``kill -9``, a crash) is stale: its process is gone, readers skip it and
delete it. One file per serve: two serves on one COLLAGE_HOME never overwrite each other, and the command line
takes the most recently started ready one.

The commands that talk to a server (``submit``, ``runs``, ``token link``) take ``--server``, else
``$COLLAGE_SERVER``, else the serve found here, else ``http://127.0.0.1:8000``.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from collage.app.core.settings import ClientSettings

FALLBACK_URL = "http://127.0.0.1:8000"
FOLDER = "serve"


@dataclass(frozen=True)
class ServeRecord:
    url: str
    pid: int
    started: str | None  # the process's start time in clock ticks since boot (Linux), to tell a recycled pid
    since: float  # time.time() when serve started
    workers: int
    ready: bool


def client_url(host: str, port: int) -> str:
    """The URL a client on this machine uses for a server bound to ``host``: a wildcard address is reached through
    the loopback address."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def process_start(pid: int) -> str | None:
    """The kernel's start time of process ``pid`` (``/proc/<pid>/stat`` field 22), or None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may itself hold spaces or parentheses
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def alive(record: ServeRecord) -> bool:
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive, but a recycled pid unless the start time says ours
        pass
    now = process_start(record.pid)
    return record.started is None or now is None or now == record.started


def folder(home: Path) -> Path:
    return home / FOLDER


def write(home: Path, record: ServeRecord) -> Path:
    """Write (or replace) serve ``record.pid``'s file atomically, readable only by its owner."""
    target = folder(home)
    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=target, prefix=".tmp-", suffix=".json")  # mode 0600
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(asdict(record), fh)
        os.replace(tmp, target / f"{record.pid}.json")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target / f"{record.pid}.json"


def remove(home: Path, pid: int) -> None:
    (folder(home) / f"{pid}.json").unlink(missing_ok=True)


def _read(path: Path) -> ServeRecord | None:
    try:
        data = json.loads(path.read_text())
        return ServeRecord(
            url=str(data["url"]),
            pid=int(data["pid"]),
            started=None if data.get("started") is None else str(data["started"]),
            since=float(data.get("since", 0.0)),
            workers=int(data.get("workers", 0)),
            ready=bool(data.get("ready", False)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def live_records(home: Path) -> list[ServeRecord]:
    """The records of the serves running now, the most recently started first; stale files are deleted."""
    found = []
    for path in sorted(folder(home).glob("[0-9]*.json")):
        record = _read(path)
        if record is None:
            continue  # not ours to judge (written atomically, so never half a record of ours)
        if alive(record):
            found.append(record)
        else:
            path.unlink(missing_ok=True)  # a killed serve's: its process is gone
    return sorted(found, key=lambda r: r.since, reverse=True)


def find(home: Path) -> ServeRecord | None:
    """The serve the command line should talk to: the newest ready one, else the newest still starting."""
    records = live_records(home)
    return next((r for r in records if r.ready), records[0] if records else None)


def record_for(home: Path, url: str) -> ServeRecord | None:
    """The live serve of this COLLAGE_HOME listening at ``url``, if any."""
    url = url.rstrip("/")
    return next((r for r in live_records(home) if r.url == url), None)


def resolve_server(explicit: str | None, home: Path) -> str:
    """``--server``, else ``$COLLAGE_SERVER``, else the running serve's URL, else http://127.0.0.1:8000."""
    chosen = explicit or ClientSettings.from_env().server
    if not chosen:
        record = find(home)
        chosen = record.url if record is not None else FALLBACK_URL
    return chosen.rstrip("/")


def wait_ready(home: Path, url: str, timeout: float, on_wait) -> ServeRecord | None:
    """When ``url`` is a serve of this COLLAGE_HOME that is still starting, wait (up to ``timeout`` s) until it is
    ready: its embedded workers take runs. ``on_wait(record)`` is called once if there is anything to wait for.
    Returns the last record seen (None: not a serve of this home, or it stopped)."""
    record = record_for(home, url)
    if record is None or record.ready:
        return record
    on_wait(record)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.25)
        record = record_for(home, url)
        if record is None or record.ready:
            return record
    return record


def this_process(url: str, workers: int, ready: bool, since: float) -> ServeRecord:
    pid = os.getpid()
    return ServeRecord(url=url, pid=pid, started=process_start(pid), since=since, workers=workers, ready=ready)


class Recorder(threading.Thread):
    """This serve's record: written at once (starting), again once ready (the web app answers ``/health`` and,
    with embedded workers, a worker takes runs from ``default``), removed by :meth:`stop`."""

    def __init__(self, home: Path, url: str, workers: int, token_file: Path, poll: float = 0.5):
        super().__init__(name="collage-serve-record", daemon=True)
        self.home, self.url, self.workers, self.token_file, self.poll = home, url, workers, token_file, poll
        self.since = time.time()
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # a write never lands after stop() removed the file

    def _write(self, ready: bool) -> None:
        with self.lock:
            if not self.stopping.is_set():
                write(self.home, this_process(self.url, self.workers, ready, self.since))

    def start(self) -> None:
        self._write(False)  # at once, so a client started together with serve finds it and waits
        super().start()

    def ready(self) -> bool:
        try:
            token = self.token_file.read_text().strip()
            health = httpx.get(self.url + "/api/v1/health", headers={"Authorization": f"Bearer {token}"}, timeout=5)
            if health.status_code != 200:
                return False
            workers = health.json().get("workers") or []
        except (OSError, ValueError, httpx.HTTPError):  # not up yet
            return False
        return self.workers == 0 or any("default" in (w.get("queues") or []) for w in workers)

    def run(self) -> None:
        while not self.stopping.wait(self.poll):
            if self.ready():
                self._write(True)
                return

    def stop(self) -> None:
        with self.lock:
            self.stopping.set()
            remove(self.home, os.getpid())
