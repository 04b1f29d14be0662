"""Helpers of the tests that drive the app in-process (FastAPI's TestClient on a real store): a run config, image
bytes, row counts, a test double of the dispatcher, an app on a given database, a run with rows in it, member
tokens, and a browser-style login."""

from __future__ import annotations

import io
import re
from pathlib import Path

from fastapi.testclient import TestClient
from PIL import Image
from sqlalchemy import func, select
from sqlmodel import Session

from collage.app.store.tokens import create_token
from collage.app.store.writer import ImageIn, SampleIn

from . import API

__all__ = ["API", "RecordingDispatcher", "config", "count_rows", "filled_run", "make_app", "member_and_token", "png",
           "session_client"]  # fmt: skip


def config(**changes):
    """A small valid run config; a dict value is merged into its section, anything else replaces the key."""
    base = {
        "name": "api-test",
        "algorithm": "grpo",
        "tags": ["demo"],
        "model": {"path": "tiny:qwen2-vl"},
        "dataset": {"source": "synth:count-red", "rows": 16},
        "rewards": [{"name": "accuracy"}, {"name": "numeric", "weight": 0.5}],
        "train": {"max_steps": 5},
        "resources": {"gpus": 0},
    }
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def png(colour, size=(24, 24)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def count_rows(app, model) -> int:
    with Session(app.state.engine) as session:
        return session.execute(select(func.count()).select_from(model)).scalar_one()


class RecordingDispatcher:
    """A test double of the dispatcher, for API unit tests only: records what the API hands over."""

    def __init__(self):
        self.submitted: list[tuple[str, str]] = []
        self.jobs: list[tuple[str, str]] = []
        self.cancelled: list[str] = []
        self.fail_with: Exception | None = None

    def submit(self, run_id, queue):
        if self.fail_with is not None:
            raise self.fail_with
        self.submitted.append((run_id, queue))

    def submit_job(self, job_id, queue):
        if self.fail_with is not None:
            raise self.fail_with
        self.jobs.append((job_id, queue))

    def cancel(self, run_id):
        self.cancelled.append(run_id)

    def health(self):
        # one live worker on the default queue, as a minimal deployment has
        return {"broker": {"ok": True, "url": "test-double"}, "workers": [{"name": "w", "queues": ["default"]}]}


def session_client(app, token: str | None = None, code: str | None = None, base="http://testserver") -> TestClient:
    """A TestClient logged in as a browser is: through the login form (``token``) or a one-time link (``code``)."""
    browser = TestClient(app, base_url=base)
    page = browser.get("/login/link/" + code if code else "/login")
    match = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
    assert match, page.text[:500]
    csrf = match.group(1)
    if code:
        done = browser.post("/login/link/" + code, data={"csrf_token": csrf}, follow_redirects=False)
    else:
        done = browser.post(
            "/login", data={"token": token, "csrf_token": csrf, "next": "/runs"}, follow_redirects=False
        )
    assert done.status_code == 303, done.text
    return browser


def make_app(database_url: str, tmp_path: Path, **settings):
    """The app on ``database_url`` with the dispatcher test double; ``settings`` over the defaults."""
    from collage.app.core.settings import Settings
    from collage.app.main import create_app

    values = {
        "home": tmp_path,
        "database_url": database_url,
        "broker_url": "memory://",
        "artifacts": tmp_path / "artifacts",
        **settings,
    }
    return create_app(Settings(**values), RecordingDispatcher())


def filled_run(client: TestClient, app) -> str:
    """A running run with a metric, a rollout row with an image and an event: something for every read route."""
    run = client.post(API + "/runs", json=config()).json()["id"]
    writer = app.state.writer
    assert writer.transition(run, ["queued"], "running")
    writer.append_metrics(run, 1, {"reward": 0.5})
    writer.append_samples(run, 1, [SampleIn(0, 0, "p", "c", [ImageIn(png((9, 9, 9)))], {}, 1.0, 0.0, 1, False)])
    writer.add_event(run, "info", "started")
    return run


def member_and_token(app, name="mallory") -> tuple[TestClient, str]:
    """A client with a new member token, and the token."""
    secret = create_token(app.state.engine, name)
    return TestClient(app, headers={"Authorization": f"Bearer {secret}"}), secret
