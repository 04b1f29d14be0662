"""Shared parts of the browser tests: Debian's Chromium driven by Playwright, a logged-in page, waits on the page's
own state, and screenshots in light and dark.

The ``server`` they open pages on is a real ``collage serve`` per test module (tests/support/serve.py); the
``browser`` and ``page`` fixtures are tests/browser/conftest.py's. Screenshots go to test-artifacts/screenshots/
(for a reviewer, not compared).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from . import API, ROOT
from .services import require_service
from .waiting import scaled, wait_for

__all__ = ["API", "CHROMIUM", "PAGE_TIMEOUT", "SHOTS", "SMALL", "login", "page_ms", "shoot", "small_config",
           "wait_done", "wait_js", "wait_rows", "wait_run", "wait_status", "wait_step"]  # fmt: skip

SHOTS = ROOT / "test-artifacts" / "screenshots"
CHROMIUM = os.environ.get("COLLAGE_CHROMIUM", "/usr/bin/chromium")
# seconds a page may take to show something (Playwright's own 30 s was exceeded on a loaded 2-core machine)
PAGE_TIMEOUT = 90.0
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]  # fmt: skip


def page_ms(seconds: float = PAGE_TIMEOUT) -> float:
    """A Playwright timeout (milliseconds) for a wait of ``seconds``, stretched by the time scale."""
    return scaled(seconds) * 1000


def launch_chromium(playwright):
    require_service(None if Path(CHROMIUM).exists() else f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=page_ms())


def new_page(browser, width: int = 1400, height: int = 900):
    """A fresh context of this size and its page; the page collects its script errors in ``page.errors``."""
    context = browser.new_context(viewport={"width": width, "height": height})
    context.set_default_timeout(page_ms())
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    page.on("console", lambda msg: page.errors.append(msg.text) if msg.type == "error" else None)
    return context, page


def login(browser, server, width: int = 1400, height: int = 900, token: str | None = None):
    """A new browser context of this size, logged in with ``token`` (the admin's by default): ``(context, page)``;
    the page collects its errors in ``page.errors``."""
    context, page = new_page(browser, width, height)
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


def wait_js(page, expression: str, timeout: float = PAGE_TIMEOUT, what: str | None = None):
    """Poll a JavaScript expression until it is truthy; its value. (Playwright's wait_for_function compiles the
    expression inside the page, which the dashboard's Content-Security-Policy forbids: no eval. Evaluating from
    outside, through the DevTools protocol, is not the page's own script.)"""
    return wait_for(lambda: page.evaluate(expression), what or f"the page to show {expression}", timeout=timeout)


def wait_rows(page, count: int, timeout: float = PAGE_TIMEOUT) -> None:
    """Wait until the rollout table shows the answer to its current filters: the row count (one request) is
    ``count`` and the rows (another request, which may answer later) are on the page, not "Loading rows…"."""
    wait_js(
        page,
        f"document.getElementById('total').dataset.count === '{count}' && "
        "document.getElementById('count').textContent !== 'Loading rows…'",
        timeout,
        what=f"the rollout table to show {count} rows",
    )


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


ENDED = ("succeeded", "failed", "cancelled")


def wait_run(client: httpx.Client, run_id: str, until, what: str, timeout: float = 180) -> dict:
    """The run as the API shows it, once ``until(run)`` is true."""
    return wait_for(lambda: client.get(f"/runs/{run_id}").json(), f"run {run_id} {what}", until=until,
                    timeout=timeout, interval=0.3, ignore=(httpx.HTTPError,))  # fmt: skip


def wait_status(client: httpx.Client, run_id: str, statuses: tuple[str, ...], timeout: float = 240) -> dict:
    """The run once its status is one of ``statuses``."""
    return wait_run(client, run_id, lambda r: r["status"] in statuses, f"to be {' or '.join(statuses)}", timeout)


def wait_done(client: httpx.Client, run_id: str, timeout: float = 240) -> dict:
    """The run once it has ended (succeeded, failed or cancelled)."""
    return wait_run(client, run_id, lambda r: r["status"] in ENDED, "to end", timeout)


def wait_step(client: httpx.Client, run_id: str, step: int, timeout: float = 240) -> dict:
    """The run once it has logged ``step`` (it is training, past its model load)."""
    return wait_run(client, run_id, lambda r: r["progress"]["step"] >= step, f"to reach step {step}", timeout)


def shoot(page, name: str, full_page: bool = True) -> None:
    """Screenshots of the page as it is, in the light and in the dark colour scheme (``<name>-light.png``,
    ``<name>-dark.png``); the page is left in the light scheme."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    for scheme in ("dark", "light"):
        page.emulate_media(color_scheme=scheme)
        # the scheme has reached the page's styles and two frames have been painted since (charts redraw on it)
        wait_js(page, f"matchMedia('(prefers-color-scheme: {scheme})').matches", what=f"the {scheme} scheme")
        page.evaluate("() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))")
        page.screenshot(path=str(SHOTS / f"{name}-{scheme}.png"), full_page=full_page)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = launch_chromium(p)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, server):
    context, page = new_page(browser)
    page.on("dialog", lambda dialog: (page.errors.append("dialog: " + dialog.message), dialog.dismiss()))
    page.goto(server["base"] + "/login")
    page.fill('input[name="token"]', server["token"])
    page.click('button[type="submit"]')
    page.wait_for_url("**/runs")
    yield page
    context.close()
