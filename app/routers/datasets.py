"""Dataset check and preview, answered by a long-lived child process (``collage.app.datahelper``).

The web process never imports the training code (and never opens user files in-process): it hands the request to
the dataset helper, a child process that keeps torch/transformers imported and the models' processors loaded
between requests (a fresh ``collage data check`` spent 25-30 s of a 200-row check importing them). The client's
values are checked against the operator's roots first (app.trust: an outside path never reaches the child), travel
as JSON fields (never read as options), and the child runs in an empty folder, so that a relative name (a hub id)
is never a file on the server. One helper per web process answers one request at a time; it exits after
``COLLAGE_DATA_HELPER_IDLE`` seconds idle and is started again on the next request.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool

from collage.training.config import IMAGES_MAX, SEED_MAX

from ..auth import UNAUTHORIZED, require_token
from ..db import session_scope
from ..schemas import DatasetCheckOut, DatasetCheckRequest, DatasetPreviewOut, PreviewRow
from ..settings import Settings
from ..store.sql import dialect_insert
from ..trust import split_violation
from ..validation import check_dataset, check_model
from .common import image_ref

log = logging.getLogger("collage.api")

router = APIRouter(tags=["datasets"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)

TIMEOUT = 600


class HelperDied(RuntimeError):
    pass


class DataHelper:
    """The child process that answers dataset requests, started on first use and restarted when it has exited
    (idle, crashed, or killed after a timeout). Thread-safe: requests are serialised."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.folder: str | None = None
        self.buffer = b""

    def _start(self) -> subprocess.Popen:
        self._stop()
        self.folder = tempfile.mkdtemp(prefix="collage-data-")
        self.buffer = b""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "collage.app.datahelper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=self.folder,
            env=self.env,
            start_new_session=True,  # a Ctrl-C at the server's terminal is the server's to handle
        )
        return self.proc

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout) if proc is not None else ():
            if pipe is not None:
                pipe.close()
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def close(self) -> None:
        with self.lock:
            self._stop()

    def _exchange(self, proc: subprocess.Popen, line: bytes, timeout: float) -> dict[str, Any]:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(line)
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise HelperDied(str(exc)) from exc
        deadline = time.monotonic() + timeout
        fd = proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self._stop()  # whatever it is stuck on, the next request gets a fresh helper
                raise HTTPException(504, f"the dataset took longer than {timeout:.0f}s to read")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise HelperDied(f"the dataset helper exited with code {proc.wait()}")
                self.buffer += chunk
        answer, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(answer)

    def call(self, request: dict[str, Any], timeout: float = TIMEOUT) -> dict[str, Any]:
        """The helper's answer, ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": ...}``. A helper that
        exited (idle, or crashed) is started again and asked once more."""
        line = (json.dumps(request) + "\n").encode()
        with self.lock:
            for attempt in (1, 2):
                proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
                try:
                    return self._exchange(proc, line, timeout)
                except HelperDied as exc:
                    self._stop()
                    if attempt == 2:
                        raise HTTPException(500, f"the dataset helper failed: {exc}") from exc
                    log.info("dataset helper was gone (%s): starting a new one", exc)
        raise AssertionError("unreachable")


_helper: DataHelper | None = None
_helper_lock = threading.Lock()


def _helper_env() -> dict[str, str]:
    env = dict(os.environ)
    if env.get("COLLAGE_HOME"):  # the child runs elsewhere: a relative home must keep meaning the same folder
        env["COLLAGE_HOME"] = str(Path(env["COLLAGE_HOME"]).expanduser().absolute())
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


def _ask(request: dict[str, Any]) -> Any:
    answer = data_helper().call(request)
    if not answer.get("ok"):
        raise HTTPException(400, str(answer.get("error") or "the dataset could not be read"))
    return answer["result"]


def _refuse(settings: Settings, source: str, split: str, model: str | None = None, images: tuple[int, int] = (0, 3)):
    """400 naming the parameter when a value is refused (a path outside the operator's roots, an unknown synthetic
    task, a missing local path); the child never sees it. The same checks as a run config's."""
    problems = [
        ("source", check_dataset(source, *images, settings)),
        ("split", split_violation(split)),
        ("model", check_model(model, settings) if model is not None else None),
    ]
    for name, message in problems:
        if message is not None:
            raise HTTPException(400, f"{name}: {message}")


@router.post("/datasets/check", response_model=DatasetCheckOut, responses={400: {"description": "unreadable source"}})
async def check(request: Request, body: DatasetCheckRequest) -> DatasetCheckOut:
    """The `collage data check` report: every bad row, images and image tokens per row."""
    images = (body.min_images, body.max_images)
    _refuse(request.app.state.settings, body.source, body.split, body.model or None, images)
    if body.max_prompt_length and not body.model:
        raise HTTPException(400, "max_prompt_length: needs a model to count the prompt's tokens")
    job = {
        "op": "check",
        "source": body.source,
        "split": body.split,
        "model": body.model or None,
        "max_prompt_length": body.max_prompt_length or None,
        "synth": {"rows": body.rows, "min_images": body.min_images, "max_images": body.max_images, "seed": body.seed},
    }
    report = await run_in_threadpool(_ask, job)
    return DatasetCheckOut.model_validate(report)


@router.get(
    "/datasets/preview", response_model=DatasetPreviewOut, responses={400: {"description": "unreadable source"}}
)
async def preview(
    request: Request,
    source: Annotated[str, Query(min_length=1, max_length=1000)],
    split: Annotated[str, Query(max_length=100)] = "train",
    rows: Annotated[int, Query(ge=1, le=50, description="how many rows to show")] = 5,
    dataset_rows: Annotated[
        int, Query(ge=1, le=100_000, description="synth:<task> only: rows of the generated dataset")
    ] = 256,
    min_images: Annotated[int, Query(ge=0, le=IMAGES_MAX, description="synth:<task> only")] = 0,
    max_images: Annotated[int, Query(ge=0, le=IMAGES_MAX, description="synth:<task> only")] = 3,
    seed: Annotated[int, Query(ge=0, le=SEED_MAX, description="synth:<task> only")] = 0,
) -> DatasetPreviewOut:
    """The first rows with their images (served by `GET /images/{sha256}`); for `synth:<task>`, the rows of the
    dataset a run with the same `dataset.rows`, `min_images`, `max_images` and `seed` trains on."""
    settings = request.app.state.settings
    _refuse(settings, source, split, images=(min_images, max_images))
    artifacts = Path(settings.artifacts).absolute()
    job = {
        "op": "preview",
        "source": source,
        "split": split,
        "rows": rows,
        "artifacts": str(artifacts),
        "synth": {"rows": dataset_rows, "min_images": min_images, "max_images": max_images, "seed": seed},
    }
    report = await run_in_threadpool(_ask, job)
    images = {im["sha256"]: im for row in report["rows"] for im in row["images"]}
    if images:
        await run_in_threadpool(_register_images, request.app.state.engine, list(images.values()))
    return DatasetPreviewOut(
        source=source,
        total_rows=report.get("total_rows"),
        rows=[
            PreviewRow(
                row=r["row"],
                prompt=r["prompt"],
                columns=r["columns"],
                error=r.get("error"),
                images=[image_ref(im["sha256"], im["width"], im["height"]) for im in r["images"]],
            )
            for r in report["rows"]
        ],
    )


def _register_images(engine, images: list[dict]) -> None:
    from ..models import Image, utcnow

    rows = [
        {"sha256": im["sha256"], "width": im["width"], "height": im["height"], "format": "png",
         "size_bytes": im["size_bytes"], "path": im["path"], "created_at": utcnow()}
        for im in images
    ]  # fmt: skip
    with session_scope(engine) as session:
        session.execute(
            dialect_insert(session, Image.__table__).on_conflict_do_nothing(index_elements=["sha256"]), rows
        )
