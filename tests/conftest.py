"""What every tier shares: a private COLLAGE_HOME per test session, the tier check (tests/support/tiers.py), tiny
models and synthetic datasets built once per session, and the store's databases (SQLite and PostgreSQL).

Fixtures of one tier alone live in that tier's conftest.py (the workers' cluster in tests/processes, the browser
in tests/browser)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Every test session gets its own COLLAGE_HOME so caches never leak between runs or into the user's home.
os.environ["COLLAGE_HOME"] = tempfile.mkdtemp(prefix="collage-test-home-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from .support.api import RecordingDispatcher

# fixtures the tests of several tiers share, defined beside their helpers in tests/support
from .support.datasets import bad_dataset  # noqa: F401
from .support.hostile_data import outside_images  # noqa: F401
from .support.migrations import empty_url, migrations_database  # noqa: F401
from .support.serve import server  # noqa: F401 - a `collage serve` per module, for processes and browser
from .support.services import PG_ADMIN_URL, postgres_unavailable, require_service, truncate
from .support.tiers import (  # noqa: F401 - the tier check's hooks
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_call,
    pytest_runtest_protocol,
    pytest_runtest_setup,
)
from .support.trackers import tracker_env  # noqa: F401
from .support.trust import outside_folder  # noqa: F401


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


# ------------------------------------------------------------------------------------------ the run store


@pytest.fixture(scope="session")
def postgres_url():
    """A fresh PostgreSQL database for this test session, dropped at the end."""
    require_service(postgres_unavailable())
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
    from collage.app.store.engine import engine_for

    engine_for.cache_clear()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def migrated_sqlite_url(tmp_path_factory):
    from collage.app.store.engine import upgrade

    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'collage.db'}"
    upgrade(url)
    return url


@pytest.fixture(scope="session")
def migrated_postgres_url(postgres_url):
    from collage.app.store.engine import upgrade

    upgrade(postgres_url)
    return postgres_url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request):
    """Each store test runs on SQLite and on PostgreSQL, on an empty (migrated) database."""
    fixture = "migrated_sqlite_url" if request.param == "sqlite" else "migrated_postgres_url"
    url = request.getfixturevalue(fixture)
    truncate(url)
    return url


@pytest.fixture
def api(database_url, tmp_path):
    """``(client, token, dispatcher, app)`` on a real app and database; the dispatcher is a test double."""
    from fastapi.testclient import TestClient

    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.store.engine import engine_for
    from collage.app.store.tokens import create_token

    settings = Settings(
        home=tmp_path,
        database_url=database_url,
        broker_url="memory://",
        artifacts=tmp_path / "artifacts",
        reward_modules=("tests.support.rewards",),
    )
    dispatcher = RecordingDispatcher()
    app = create_app(settings, dispatcher)
    token = create_token(engine_for(database_url), "tests", role="admin")
    client = TestClient(app, headers={"Authorization": f"Bearer {token}"})
    return client, token, dispatcher, app
