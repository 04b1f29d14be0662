"""Shared parts of the browser tests: a real `collage serve` (embedded broker, one worker) per test module, Debian's
Chromium driven by Playwright, a logged-in page, polling helpers, and screenshots in light and dark.

Import the fixtures into a test module (``from .dashboard_support import browser, page, server``); each module
that does gets its own server. Screenshots go to test-artifacts/screenshots/ (for a reviewer, not compared).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import require_service
from .test_workers import free_port

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "test-artifacts" / "screenshots"
CHROMIUM = os.environ.get("COLLAGE_CHROMIUM", "/usr/bin/chromium")
API = "/api/v1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("dashboard-home")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLLAGE_HOME": str(home), "OMP_NUM_THREADS": "1"}
    for key in ("COLLAGE_DATABASE_URL", "COLLAGE_BROKER_URL", "COLLAGE_ARTIFACTS"):
        env.pop(key, None)
    log = home / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "collage.app.cli", "serve", "--port", str(port)], env=env, cwd=ROOT,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            token = (home / "token").read_text().strip()
            health = httpx.get(base + API + "/health", timeout=2, headers={"Authorization": f"Bearer {token}"})
            if health.json()["workers"]:
                break
        except (httpx.HTTPError, ValueError, KeyError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(log.read_text()[-3000:])
        time.sleep(0.5)
    token = (home / "token").read_text().strip()
    client = httpx.Client(base_url=base + API, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    yield {"base": base, "token": token, "home": home, "client": client, "env": env}
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


# what a page may take to show something: Playwright's 30 s default was exceeded on a loaded 2-core CI machine
PAGE_TIMEOUT_MS = 90_000


@pytest.fixture(scope="module")
def browser():
    require_service(None if Path(CHROMIUM).exists() else f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"],
        )  # fmt: skip
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(PAGE_TIMEOUT_MS)
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    page.on("console", lambda msg: page.errors.append(msg.text) if msg.type == "error" else None)
    page.on("dialog", lambda dialog: (page.errors.append("dialog: " + dialog.message), dialog.dismiss()))
    page.goto(server["base"] + "/login")
    page.fill('input[name="token"]', server["token"])
    page.click('button[type="submit"]')
    page.wait_for_url("**/runs")
    yield page
    context.close()


def login(browser, server, width: int = 1400, height: int = 900, token: str | None = None):
    """A new browser context of this size, logged in with ``token`` (the admin's by default): ``(context, page)``;
    the page collects its errors in ``page.errors``."""
    context = browser.new_context(viewport={"width": width, "height": height})
    context.set_default_timeout(PAGE_TIMEOUT_MS)
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    page.on("console", lambda msg: page.errors.append(msg.text) if msg.type == "error" else None)
    page.goto(server["base"] + "/login")
    page.fill('input[name="token"]', token or server["token"])
    page.click('button[type="submit"]')
    page.wait_for_url("**/runs")
    return context, page


SMALL = {
    "train.max_steps": "4",
    "train.per_device_train_batch_size": "8",
    "train.max_completion_length": "6",
    "train.max_prompt_length": "256",
    "train.learning_rate": "0.001",
    "dataset.rows": "16",
    "resources.gpus": "0",
}


def wait_rows(page, count: int, timeout: float = PAGE_TIMEOUT_MS) -> None:
    """Wait until the rollout table shows the answer to its current filters: the row count (one request) is
    ``count`` and the rows (another request, which may answer later) are on the page, not "Loading rows…"."""
    wait_js(
        page,
        f"document.getElementById('total').dataset.count === '{count}' && "
        "document.getElementById('count').textContent !== 'Loading rows…'",
        timeout,
    )


def wait_js(page, expression: str, timeout: float = PAGE_TIMEOUT_MS) -> None:
    """Poll a JavaScript expression until it is true. (Playwright's wait_for_function compiles the expression
    inside the page, which the dashboard's Content-Security-Policy forbids: no eval. Evaluating from outside,
    through the DevTools protocol, is not the page's own script.)"""
    deadline = time.monotonic() + timeout / 1000
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {expression}")
        time.sleep(0.1)


def small_config(name: str, **train) -> dict:
    return {
        "name": name,
        "model": {"path": "tiny:qwen2-vl", "dtype": "float32"},
        "dataset": {"source": "synth:count-red", "rows": 16},
        "rewards": [{"name": "accuracy"}, {"name": "numeric", "weight": 0.5}],
        "train": {"max_steps": 3, "per_device_train_batch_size": 8, "max_completion_length": 6,
                  "max_prompt_length": 256, **train},
        "resources": {"gpus": 0},
    }  # fmt: skip


def wait_done(client: httpx.Client, run_id: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.get(f"/runs/{run_id}").json()
        if run["status"] in ("succeeded", "failed", "cancelled"):
            return run
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} did not end")


def shoot(page, name: str, full_page: bool = True) -> None:
    """Screenshots of the page as it is, in the light and in the dark colour scheme (``<name>-light.png``,
    ``<name>-dark.png``); the page is left in the light scheme."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    for scheme in ("dark", "light"):
        page.emulate_media(color_scheme=scheme)
        page.wait_for_timeout(100)
        page.screenshot(path=str(SHOTS / f"{name}-{scheme}.png"), full_page=full_page)
