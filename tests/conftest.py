from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Every test session gets its own COLLAGE_HOME so caches never leak between runs or into the user's home.
os.environ["COLLAGE_HOME"] = tempfile.mkdtemp(prefix="collage-test-home-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collage.training.models.families import FAMILIES, TINY_FAMILIES


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The folder of a tiny model of ``family``, built once per session through ``tiny:<family>``."""
    from collage.training.models.loading import resolve_model_path

    def get(family: str) -> Path:
        return Path(resolve_model_path(f"tiny:{family}"))

    return get


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """``(model, processor, family)`` for a tiny model, float32, eval mode; cached per family."""
    import torch

    from collage.training.models.loading import load_model, load_processor

    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            torch.manual_seed(0)
            processor, fam = load_processor(str(tiny_model_dir(family)))
            model = load_model(str(tiny_model_dir(family)), "float32").eval()
            cache[family] = (model, processor, fam)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def count_red_dir(tmp_path_factory):
    from collage.training.data.synth import write_synth

    out = tmp_path_factory.mktemp("count-red")
    write_synth("count-red", out, rows=12, min_images=0, max_images=3, seed=7)
    return out


@pytest.fixture(scope="session")
def varied_dir(tmp_path_factory):
    """Rows with 0..5 images each, of different sizes and aspect ratios (small ones, and ones large enough that
    tiling processors split them into several crops and anyres ones pick different patch grids)."""
    import json
    import random

    from PIL import Image, ImageDraw

    out = tmp_path_factory.mktemp("varied")
    (out / "images").mkdir()
    rng = random.Random(11)
    rows = []
    for row, count in enumerate([0, 1, 5, 2, 0, 3, 4, 1, 2, 0, 5, 3]):
        content, names = [], []
        for k in range(count):
            size = (rng.randint(24, 160), rng.randint(24, 160))
            image = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
            ImageDraw.Draw(image).ellipse([2, 2, size[0] // 2, size[1] // 2], fill=(255, 0, 0))
            name = f"images/r{row}-{k}.png"
            image.save(out / name)
            names.append(name)
            content += [{"type": "text", "text": f"Image {k + 1}: "}, {"type": "image"}, {"type": "text", "text": "\n"}]
        content.append({"type": "text", "text": "How many images show a red shape? Answer with a number."})
        rows.append({"prompt": [{"role": "user", "content": content}], "answer": str(count), "images": names})
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


__all__ = ["FAMILIES", "TINY_FAMILIES"]


# ------------------------------------------------------------------------------------------ the run store

PG_ADMIN_URL = os.environ.get("COLLAGE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _postgres_available() -> str | None:
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN_URL.replace("+psycopg", ""), connect_timeout=3):
            return None
    except Exception as exc:  # noqa: BLE001
        return f"PostgreSQL at {PG_ADMIN_URL} is not reachable ({type(exc).__name__}: {exc})"


def require_service(reason: str | None) -> None:
    """Skip on a user's machine that lacks a service; under CI=true a missing service is a failure."""
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run this test: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_url():
    """A fresh PostgreSQL database for this test session, dropped at the end."""
    require_service(_postgres_available())
    import uuid

    import psycopg

    name = f"collage_test_{uuid.uuid4().hex[:10]}"
    admin = PG_ADMIN_URL.replace("+psycopg", "")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
        # a commit need not wait for its WAL to reach the disk: a test database is dropped at the end, and on a CI
        # machine whose disk is busy (pip unpacking torch beside the tests) each such wait took up to seconds
        conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    from collage.app.db import engine_for

    engine_for.cache_clear()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def migrated_sqlite_url(tmp_path_factory):
    from collage.app.db import upgrade

    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'collage.db'}"
    upgrade(url)
    return url


@pytest.fixture(scope="session")
def migrated_postgres_url(postgres_url):
    from collage.app.db import upgrade

    upgrade(postgres_url)
    return postgres_url


def _truncate(url: str) -> None:
    from sqlalchemy import text

    from collage.app.db import engine_for

    engine = engine_for(url)
    tables = [
        "uploads",
        "jobs",
        "sample_images",
        "samples",
        "images",
        "metrics",
        "metric_rollups",
        "events",
        "checkpoints",
        "run_tags",
        "runs",
        "web_sessions",
        "login_links",
        "audit_log",
        "api_tokens",
        "workers",
    ]
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("TRUNCATE " + ", ".join(tables) + " RESTART IDENTITY CASCADE"))
        else:
            for table in tables:
                conn.execute(text(f"DELETE FROM {table}"))


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request):
    """Each store test runs on SQLite and on PostgreSQL, on an empty (migrated) database."""
    fixture = "migrated_sqlite_url" if request.param == "sqlite" else "migrated_postgres_url"
    url = request.getfixturevalue(fixture)
    _truncate(url)
    return url


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


@pytest.fixture
def api(database_url, tmp_path):
    """``(client, token, dispatcher, app)`` on a real app and database; the dispatcher is a test double."""
    from fastapi.testclient import TestClient

    from collage.app.db import engine_for
    from collage.app.main import create_app
    from collage.app.settings import Settings
    from collage.app.store.tokens import create_token

    settings = Settings(
        home=tmp_path,
        database_url=database_url,
        broker_url="memory://",
        artifacts=tmp_path / "artifacts",
        reward_modules=("tests.rewards_for_tests",),
    )
    dispatcher = RecordingDispatcher()
    app = create_app(settings, dispatcher)
    token = create_token(engine_for(database_url), "tests", role="admin")
    client = TestClient(app, headers={"Authorization": f"Bearer {token}"})
    return client, token, dispatcher, app


# The fast tier, `pytest -m "not slow"` (a few minutes on 2 cores): every module below is marked slow as a whole:
# they train tiny models, start servers, workers or Chromium, build wheels, or fuzz the API. CI runs everything.
SLOW_MODULES = {
    # servers, workers, browsers, processes (scripts/test.sh runs them beside the rest)
    "test_workers", "test_dashboard", "test_dash_charts", "test_dash_look", "test_dash_ops", "test_dash_rollouts",
    "test_trackers", "test_dash_playground", "test_dash_friction", "test_dash_checkpoints", "test_dash_eval",
    "test_eval_e2e", "test_shutdown", "test_export_worker", "test_playground_worker", "test_cli_runs", "test_faults",
    "test_lifecycle", "test_supervisor", "test_dispatch_race", "test_replicas", "test_multihost",
    # training, generation and model forwards with tiny models; wheels; the API fuzzer
    "test_training", "test_trl_agreement", "test_eval", "test_rollout_engine", "test_families", "test_tiny_models",
    "test_vision_features", "test_chunked_logprobs", "test_batching", "test_layouts", "test_checkpoints",
    "test_export", "test_export_cli", "test_offloop", "test_packaging", "test_api_fuzz", "test_large_data",
    "test_bring_your_own_data", "test_check", "test_export_jobs",
}  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


# the browser tests' fixtures (a `collage serve` per module, Chromium, a logged-in page): every dashboard test module
# may ask for them by name; see tests/dashboard_support.py
from .dashboard_support import browser, page, server  # noqa: E402, F401
