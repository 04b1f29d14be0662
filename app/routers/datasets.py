"""Dataset check and preview, run in a child process.

The web process never imports the training code (and never opens user files in-process): it runs
``collage data check --json`` / ``collage data preview --json`` and relays their reports. The client's values
are checked against the operator's roots first (app.trust: an outside path never reaches the child), go after
``--`` or as ``--option=value`` (never read as options), and the child runs in an empty folder, so that a
relative name (a hub id) is never a file on the server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool

from ..auth import UNAUTHORIZED, require_token
from ..db import session_scope
from ..schemas import DatasetCheckOut, DatasetCheckRequest, DatasetPreviewOut, PreviewRow
from ..settings import Settings
from ..store.sql import dialect_insert
from ..trust import split_violation
from ..validation import check_dataset, check_model
from .common import image_ref

router = APIRouter(tags=["datasets"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)

TIMEOUT = 600


def _run_cli(args: list[str], timeout: int = TIMEOUT) -> tuple[int, str, str]:
    env = dict(os.environ)
    if env.get("COLLAGE_HOME"):  # the child runs elsewhere: a relative home must keep meaning the same folder
        env["COLLAGE_HOME"] = str(Path(env["COLLAGE_HOME"]).expanduser().absolute())
    with tempfile.TemporaryDirectory(prefix="collage-data-") as empty:
        try:
            done = subprocess.run(
                [sys.executable, "-m", "collage.app.cli", *args],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                cwd=empty,
                env=env,
            )
        except subprocess.TimeoutExpired as exc:
            raise HTTPException(504, f"the dataset took longer than {timeout}s to read") from exc
    return done.returncode, done.stdout, done.stderr


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


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1].removeprefix("collage: error: ") if lines else "the dataset could not be read"


@router.post("/datasets/check", response_model=DatasetCheckOut, responses={400: {"description": "unreadable source"}})
async def check(request: Request, body: DatasetCheckRequest) -> DatasetCheckOut:
    """The `collage data check` report: every bad row, images and image tokens per row."""
    images = (body.min_images, body.max_images)
    _refuse(request.app.state.settings, body.source, body.split, body.model or None, images)
    args = ["data", "check", f"--split={body.split}", "--json"]
    if body.model:
        args.append(f"--model={body.model}")
    if body.max_prompt_length:
        args += ["--max-prompt-length", str(body.max_prompt_length)]
    if body.source.startswith("synth:"):
        args += ["--rows", str(body.rows), "--min-images", str(body.min_images), "--max-images", str(body.max_images)]
        args += ["--seed", str(body.seed)]
    args += ["--", body.source]
    code, out, err = await run_in_threadpool(_run_cli, args)
    if code not in (0, 1):
        raise HTTPException(400, _last_error(err))
    return DatasetCheckOut.model_validate(json.loads(out))


@router.get(
    "/datasets/preview", response_model=DatasetPreviewOut, responses={400: {"description": "unreadable source"}}
)
async def preview(
    request: Request,
    source: Annotated[str, Query(min_length=1, max_length=1000)],
    split: Annotated[str, Query(max_length=100)] = "train",
    rows: Annotated[int, Query(ge=1, le=50)] = 5,
) -> DatasetPreviewOut:
    """The first rows with their images (served by `GET /images/{sha256}`)."""
    settings = request.app.state.settings
    _refuse(settings, source, split)
    artifacts = Path(settings.artifacts).absolute()
    args = ["data", "preview", f"--split={split}", f"--rows={rows}", f"--artifacts={artifacts}", "--", source]
    code, out, err = await run_in_threadpool(_run_cli, args)
    if code != 0:
        raise HTTPException(400, _last_error(err))
    report = json.loads(out)
    images = {im["sha256"]: im for row in report["rows"] for im in row["images"]}
    if images:
        await run_in_threadpool(_register_images, request.app.state.engine, list(images.values()))
    return DatasetPreviewOut(
        source=source,
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
