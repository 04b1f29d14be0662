"""Dataset check and preview, answered by a long-lived child process (``collage.app.datahelper``).

The web process never imports the training code (and never opens user files in-process): it hands the request to
the dataset helper, a child process that keeps torch/transformers imported and the models' processors loaded
between requests (a fresh ``collage data check`` spent 25-30 s of a 200-row check importing them). The client's
values are checked against the operator's roots first (app.trust: an outside path never reaches the child), travel
as JSON fields (never read as options), and the child runs in an empty folder, so that a relative name (a hub id)
is never a file on the server. The operator's data roots travel with every request: the child confines the image
paths named inside rows to them. One helper per web process answers one request at a time; it exits after
``COLLAGE_DATA_HELPER_IDLE`` seconds idle and is started again on the next request.

Bounds (app.settings): each token has at most ``dataset_per_user`` requests in flight and the process at most
``dataset_queue`` (running or waiting for the helper); more are answered 429 with ``Retry-After``. Waiting happens
in the gate's own threads, never in the threadpool every other route shares (45 waiting previews once held all of
its threads, and ``/runs`` and ``/health`` hung behind them). A request that runs past its time (waiting included)
is answered 504 and its helper is killed, with what it was writing under ``COLLAGE_HOME/cache``.
"""

from __future__ import annotations

import asyncio
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
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from collage.training.config import IMAGES_MAX, SEED_MAX, DatasetSettings
from collage.training.data.check import remove_temp_files_of
from collage.training.data.mapping import parse_columns
from collage.training.data.synth import remove_temp_folders_of

from ..auth import UNAUTHORIZED, Responses, require_token
from ..db import session_scope
from ..models import ApiToken
from ..schemas import DatasetCheckOut, DatasetCheckRequest, DatasetPreviewOut, PreviewRow
from ..settings import Settings
from ..store.sql import dialect_insert
from ..trust import split_violation
from ..validation import check_dataset, check_model
from .common import image_ref

log = logging.getLogger("collage.api")

router = APIRouter(tags=["datasets"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)

TIMEOUT = 600
RETRY_AFTER_SECONDS = 5
BUSY: Responses = {
    429: {"description": "too many dataset requests in flight (this token's, or the server's); see Retry-After"},
    503: {"description": "the dataset helper stayed busy with other requests for this request's whole time"},
    504: {"description": "the dataset took longer than the server allows (COLLAGE_PREVIEW_TIMEOUT / _CHECK_TIMEOUT)"},
}


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
        if proc is not None:
            self._remove_leftovers(proc.pid)
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def _remove_leftovers(self, pid: int) -> None:
        """What a killed (or crashed) helper was writing under COLLAGE_HOME/cache: a synthetic dataset's temporary
        folder and a half-written check report, named with its pid. Finished datasets and reports stay."""
        home = Path(self.env.get("COLLAGE_HOME") or Path.home() / ".collage").expanduser()
        try:
            remove_temp_folders_of(pid, home / "cache" / "datasets")
            remove_temp_files_of(pid, home / "cache" / "checks")
        except OSError as exc:  # the next clean_stale_temp_folders (serve, worker start) gets the rest
            log.warning("could not remove what dataset helper %d left in %s: %s", pid, home / "cache", exc)

    def close(self) -> None:
        with self.lock:
            self._stop()

    def _exchange(self, proc: subprocess.Popen, line: bytes, timeout: float, deadline: float) -> dict[str, Any]:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(line)
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise HelperDied(str(exc)) from exc
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
        """The helper's answer, ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": ...}``, within
        ``timeout`` seconds, waiting for other requests included (503 when they keep the helper that long, 504
        when this one runs past it). A helper that exited (idle, or crashed) is started again and asked once more."""
        line = (json.dumps(request) + "\n").encode()
        deadline = time.monotonic() + timeout
        if timeout <= 0 or not self.lock.acquire(timeout=timeout):
            raise HTTPException(
                503,
                f"the dataset helper was busy with other requests for {timeout:.0f}s: retry in {RETRY_AFTER_SECONDS} s",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        try:
            for attempt in (1, 2):
                proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
                try:
                    return self._exchange(proc, line, timeout, deadline)
                except HelperDied as exc:
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


_GATE_LOCK = threading.Lock()


def dataset_gate(app) -> DatasetGate:
    with _GATE_LOCK:
        gate = getattr(app.state, "dataset_gate", None)
        if gate is None:
            gate = app.state.dataset_gate = DatasetGate()
        return gate


async def _run_gated(request: Request, token: ApiToken, job: dict[str, Any], timeout: float) -> Any:
    settings: Settings = request.app.state.settings
    deadline = time.monotonic() + timeout  # the request's time counts from its admission, waiting included
    gate = dataset_gate(request.app)
    return await gate.run(
        str(token.id), settings.dataset_per_user, settings.dataset_queue, lambda: _ask(job, deadline - time.monotonic())
    )


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


def _mapping_fields(
    source: str, columns: dict[str, Any] | None, template: str | None, system: str | None, config_name: str | None
) -> dict[str, Any]:
    """The helper request's ``mapping`` and ``config_name``, validated as ``dataset.*`` of a run config is (422
    naming the parameter: a template with attribute access, a template and columns.prompt together)."""
    fields = {"columns": columns, "prompt_template": template, "system_prompt": system, "config_name": config_name}
    try:
        DatasetSettings(source=source, **fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "dataset"
        raise HTTPException(422, f"{where}: {first['msg']}") from None
    mapping = {k: v for k, v in fields.items() if k != "config_name" and v is not None}
    return {"mapping": mapping, "config_name": config_name}


@router.post(
    "/datasets/check",
    response_model=DatasetCheckOut,
    responses={400: {"description": "unreadable source"}, **BUSY},
)
async def check(
    request: Request, body: DatasetCheckRequest, token: Annotated[ApiToken, Depends(require_token)]
) -> DatasetCheckOut:
    """The `collage data check` report: every bad row, images and image tokens per row."""
    settings: Settings = request.app.state.settings
    images = (body.min_images, body.max_images)
    _refuse(settings, body.source, body.split, body.model or None, images)
    if body.max_prompt_length and not body.model:
        raise HTTPException(400, "max_prompt_length: needs a model to count the prompt's tokens")
    mapping = _mapping_fields(body.source, body.columns.model_dump(exclude_none=True) if body.columns else None,
                              body.prompt_template, body.system_prompt, body.config_name)  # fmt: skip
    job = {
        "op": "check",
        "source": body.source,
        "split": body.split,
        **mapping,
        "model": body.model or None,
        "max_prompt_length": body.max_prompt_length or None,
        "synth": {"rows": body.rows, "min_images": body.min_images, "max_images": body.max_images, "seed": body.seed},
        "data_roots": [str(root) for root in settings.allowed_data_roots()],
        "check": body.check,
    }
    report = await _run_gated(request, token, job, settings.check_timeout)
    return DatasetCheckOut.model_validate(report)


@router.get(
    "/datasets/preview",
    response_model=DatasetPreviewOut,
    responses={400: {"description": "unreadable source"}, **BUSY},
)
async def preview(
    request: Request,
    token: Annotated[ApiToken, Depends(require_token)],
    source: Annotated[str, Query(min_length=1, max_length=1000)],
    split: Annotated[str, Query(max_length=100)] = "train",
    rows: Annotated[int, Query(ge=1, le=200, description="how many rows to show")] = 5,
    dataset_rows: Annotated[
        int, Query(ge=1, le=100_000, description="synth:<task> only: rows of the generated dataset")
    ] = 256,
    min_images: Annotated[int, Query(ge=0, le=IMAGES_MAX, description="synth:<task> only")] = 0,
    max_images: Annotated[int, Query(ge=0, le=IMAGES_MAX, description="synth:<task> only")] = 3,
    seed: Annotated[int, Query(ge=0, le=SEED_MAX, description="synth:<task> only")] = 0,
    columns: Annotated[
        str | None, Query(max_length=2000, description="dataset.columns as prompt=question,images=image_1+image_2")
    ] = None,
    prompt_template: Annotated[str | None, Query(max_length=20_000, description="dataset.prompt_template")] = None,
    system_prompt: Annotated[str | None, Query(max_length=20_000, description="dataset.system_prompt")] = None,
    config_name: Annotated[str | None, Query(max_length=200, description="dataset.config_name")] = None,
) -> DatasetPreviewOut:
    """The first rows with their images (served by `GET /images/{sha256}`); for `synth:<task>`, the rows of the
    dataset a run with the same `dataset.rows`, `min_images`, `max_images` and `seed` trains on (generated for the
    preview alone: only the rows shown). Only the rows shown are read, at most `COLLAGE_PREVIEW_MAX_IMAGES` images
    and `COLLAGE_PREVIEW_MAX_BYTES` bytes of image data (`note` says where the preview stopped)."""
    settings: Settings = request.app.state.settings
    _refuse(settings, source, split, images=(min_images, max_images))
    try:
        parsed = parse_columns(columns) if columns else None
    except ValueError as exc:
        raise HTTPException(422, f"columns: {exc}") from None
    mapping = _mapping_fields(source, parsed, prompt_template, system_prompt, config_name)
    artifacts = Path(settings.artifacts).absolute()
    job = {
        "op": "preview",
        "source": source,
        "split": split,
        **mapping,
        "rows": rows,
        "artifacts": str(artifacts),
        "synth": {"rows": dataset_rows, "min_images": min_images, "max_images": max_images, "seed": seed},
        "data_roots": [str(root) for root in settings.allowed_data_roots()],
        "max_images": settings.preview_max_images,
        "max_bytes": settings.preview_max_bytes,
    }
    report = await _run_gated(request, token, job, settings.preview_timeout)
    images = {im["sha256"]: im for row in report["rows"] for im in row["images"]}
    if images:
        await run_in_threadpool(_register_images, request.app.state.engine, list(images.values()))
    return DatasetPreviewOut(
        source=source,
        total_rows=report.get("total_rows"),
        note=report.get("note"),
        column_names=report.get("column_names") or [],
        guess=report.get("guess") or {},
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
    from ..models import Image, table_of, utcnow

    rows = [
        {"sha256": im["sha256"], "width": im["width"], "height": im["height"], "format": "png",
         "size_bytes": im["size_bytes"], "path": im["path"], "created_at": utcnow()}
        for im in images
    ]  # fmt: skip
    with session_scope(engine) as session:
        session.execute(
            dialect_insert(session, table_of(Image)).on_conflict_do_nothing(index_elements=["sha256"]), rows
        )
