"""The web dashboard in a real browser: Debian's Chromium driven by Playwright, against `collage serve`.

Screenshots of every page go to test-artifacts/screenshots/ (not compared pixel by pixel: for a reviewer).
"""

from __future__ import annotations

import re

import httpx

from tests.support import API
from tests.support.browser import SHOTS, SMALL, page_ms, small_config, wait_done, wait_js
from tests.support.rollouts import seed_run


def test_login_page_and_login_link(browser, server):
    context = browser.new_context(viewport={"width": 1200, "height": 700})
    context.set_default_timeout(page_ms())
    page = context.new_page()
    page.goto(server["base"] + "/runs")
    page.wait_for_url(lambda url: "/login" in url and "next=" in url)
    page.screenshot(path=str(SHOTS / "login.png"))
    page.fill('input[name="token"]', "clg_wrong")
    page.click('button[type="submit"]')
    assert "not valid" in page.inner_text(".error")
    # an API token in the URL no longer logs in
    page.goto(f"{server['base']}/login?token={server['token']}")
    page.goto(server["base"] + "/runs")
    page.wait_for_url(lambda url: "/login" in url and "next=" in url)
    # the one-time link `collage serve` printed: a page with one button, spent by the click
    link = re.search(r"login link: (\S+)", server["serve"].log.read_text()).group(1)
    page.goto(link)
    page.screenshot(path=str(SHOTS / "login-link.png"))
    page.click("text=Log in to Collage")
    page.wait_for_url("**/runs")
    assert "collage serve · admin" in page.inner_text("header")
    page.click("text=Log out")
    page.wait_for_url("**/login")
    page.goto(server["base"] + "/runs")
    page.wait_for_url(lambda url: "/login" in url and "next=" in url)
    page.goto(link)  # used once already
    page.click("text=Log in to Collage")
    assert "already used" in page.inner_text(".error")
    context.close()


def test_launch_from_the_form_watch_it_succeed_and_inspect_rollouts(page, server):
    before = len(server["client"].get("/runs").json()["items"])
    page.goto(server["base"] + "/launch")
    page.wait_for_selector(".reward")
    page.fill('[name="name"]', "browser-grpo")
    for name, value in SMALL.items():
        page.fill(f'[name="{name}"]', value)
    page.select_option('[name="model.dtype"]', "float32")
    page.click("#expand-all")  # the advanced groups (the loss options among them) are collapsed until then
    assert page.is_visible('[data-path="train.loss_type"]') and not page.is_visible(
        '[data-path="train.normalize_advantages"]'
    )
    page.check('input[name="algorithm"][value="rloo"]')  # the switch shows only the fields that apply
    assert not page.is_visible('[data-path="train.loss_type"]') and page.is_visible(
        '[data-path="train.normalize_advantages"]'
    )
    page.check('input[name="algorithm"][value="grpo"]')
    page.click("#preview-btn")
    page.wait_for_selector("#preview p.ok", timeout=page_ms(120))
    assert "16 rows, 0 bad" in page.inner_text("#preview") and "image tokens/row" in page.inner_text("#preview")
    page.click("#yaml-btn")
    assert "max_steps: 4" in page.inner_text("#yaml")
    page.screenshot(path=str(SHOTS / "launch.png"), full_page=True)
    page.click("#launch-btn")
    page.wait_for_url("**/runs/*", timeout=page_ms())
    run_id = page.url.rstrip("/").rsplit("/", 1)[1]
    wait_js(page, "document.getElementById('status').textContent === 'succeeded'", timeout=180)
    wait_js(page, "document.querySelectorAll('.chart canvas').length >= 10")
    for metric in (
        "reward",
        "loss",
        "entropy",
        "grad_norm",
        "learning_rate",
        "frac_reward_zero_std",
        "clip_ratio/region_mean",
    ):
        assert page.locator(f'.chart[data-metric="{metric}"] canvas').count() == 1, metric
    page.wait_for_selector("#events >> text=succeeded at step 4")  # the event list refreshes after the status
    # each event once, although the status and progress events that end a run both ask for the new ones
    shown = page.eval_on_selector_all("#events li", "items => items.map(i => i.dataset.eventId)")
    assert len(shown) == len(set(shown)) and page.locator("#events li", has_text="succeeded at step 4").count() == 1
    page.screenshot(path=str(SHOTS / "run.png"), full_page=True)
    assert len(server["client"].get("/runs").json()["items"]) == before + 1

    page.click("text=Rollouts")
    page.wait_for_selector("tr.sample")
    assert page.locator("tr.sample").count() == 4 * 8
    assert page.locator("tr.group").count() == 4 * 2  # one header per prompt group, with mean/std
    wait_js(page, "[...document.querySelectorAll('img.thumb')].some(i => i.complete && i.naturalWidth > 0)")
    page.screenshot(path=str(SHOTS / "rollouts.png"), full_page=True)
    page.select_option('[name="advantage"]', "pos")
    wait_js(
        page,
        "document.querySelectorAll('td.adv-neg, td.adv-zero').length === 0 && document.querySelectorAll('tr.sample').length > 0",
    )
    values = [float(v) for v in page.locator("tr.sample td.adv-pos").all_inner_texts()]
    assert values and all(v > 0 for v in values)
    api_count = len(
        server["client"].get(f"/runs/{run_id}/samples", params={"advantage": "pos", "limit": 500}).json()["items"]
    )
    assert page.locator("tr.sample").count() == api_count
    page.select_option('[name="advantage"]', "")
    page.fill('[name="min_images"]', "1")
    wait_js(
        page,
        "document.querySelectorAll('tr.sample').length > 0 && [...document.querySelectorAll('tr.sample')].every(r => r.querySelectorAll('img.thumb').length >= 1)",
    )
    page.locator("img.thumb").first.click()
    page.wait_for_selector("#modal:not([hidden]) img.full")
    wait_js(page, "document.querySelector('#modal img.full').naturalWidth > 0")
    page.screenshot(path=str(SHOTS / "image.png"))
    page.keyboard.press("Escape")
    assert page.is_hidden("#modal")
    assert not page.errors, page.errors


def test_a_bad_value_shows_the_field_error_and_creates_no_run(page, server):
    before = len(server["client"].get("/runs").json()["items"])
    page.goto(server["base"] + "/launch")
    page.wait_for_selector(".reward")
    page.fill('[name="train.max_steps"]', "-3")
    page.fill('[name="train.learning_rate"]', "fast")
    page.fill('[name="dataset.source"]', "synth:nonsense")
    page.click("#launch-btn")
    page.wait_for_selector('[data-error-for="train.max_steps"]:not(:empty)')
    assert "greater than 0" in page.inner_text('[data-error-for="train.max_steps"]')
    assert page.inner_text('[data-error-for="train.learning_rate"]')
    assert page.locator('.field.invalid[data-path="train.max_steps"]').count() == 1
    # one answer lists every problem: the types and whether the dataset exists
    assert "unknown synthetic task" in page.inner_text('[data-error-for="dataset.source"]')
    page.screenshot(path=str(SHOTS / "launch-errors.png"), full_page=True)
    assert len(server["client"].get("/runs").json()["items"]) == before
    assert "/launch" in page.url


def test_model_output_is_escaped_everywhere(page, server):
    from collage.app.store.engine import make_engine
    from collage.app.store.writer import ImageIn, SampleIn, StoreWriter
    from collage.training.config import parse_config

    engine = make_engine(f"sqlite:///{server['home'] / 'collage.db'}")
    writer = StoreWriter(engine, server["home"] / "artifacts")
    config = parse_config({**small_config("<b>evil</b> run"), "tags": ["<i>t</i>"]}).model_dump(mode="json")
    run = writer.create_run(config)
    writer.transition(run.id, ["queued", "running"], "succeeded")
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (30, 30), (250, 0, 0)).save(buf, format="PNG")
    evil = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"><b>bold</b>'
    rows = [
        SampleIn(group=0, index=i, prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": evil}]}],
                 completion=evil, images=[ImageIn(buf.getvalue())], rewards={"accuracy": 1.0, "numeric": 0.0},
                 reward=1.0, advantage=0.5 - i, completion_length=9, truncated=False, group_mean=0.5, group_std=0.1)
        for i in range(2)
    ]  # fmt: skip
    writer.append_samples(run.id, 1, rows)
    writer.add_event(run.id, "warning", evil)
    engine.dispose()
    for path in (f"/runs/{run.id}/rollouts", f"/runs/{run.id}", "/runs"):
        page.goto(server["base"] + path)
        page.wait_for_load_state("networkidle")
        assert page.evaluate("window.__pwned") is None, path
    page.goto(f"{server['base']}/runs/{run.id}/rollouts")
    page.wait_for_selector("tr.sample")
    completion = page.locator("tr.sample pre.completion").first
    assert completion.inner_text() == evil  # shown as text
    assert (
        page.locator("tr.sample pre.completion b, tr.sample .prompt b:not(:first-child), tr.sample script").count() == 0
    )
    assert "<script>window.__pwned = 1</script>" in page.inner_text("tr.sample .prompt")
    page.screenshot(path=str(SHOTS / "escaping.png"), full_page=True)
    page.goto(f"{server['base']}/runs/{run.id}")
    page.wait_for_selector(".event.level-warning")
    assert page.inner_text(".event.level-warning pre") == evil
    assert page.inner_text("h1").startswith("<b>evil</b> run")
    assert page.evaluate("window.__pwned") is None and not [e for e in page.errors if "pwned" in e]


def test_compare_two_runs(page, server):
    """Two finished runs whose configs differ (written into the store as a worker writes them: what the compare
    page shows is theirs, not a training's)."""
    a = seed_run(server, "cmp-a", "a says", images=2, rewards=("accuracy", "numeric"))
    b = seed_run(server, "cmp-b", "b says", images=2, rewards=("accuracy", "numeric"),
                 config_changes={"train": {**small_config("b")["train"], "learning_rate": 0.01, "temperature": 0.7}})  # fmt: skip
    page.goto(server["base"] + "/runs")
    page.wait_for_selector(f'tr[data-run="{a}"]')
    page.screenshot(path=str(SHOTS / "runs.png"), full_page=True)
    page.check(f'tr[data-run="{a}"] input[type=checkbox]')
    page.check(f'tr[data-run="{b}"] input[type=checkbox]')
    page.click("#compare")
    page.wait_for_url(lambda url: "/compare" in url)
    page.wait_for_selector('.chart[data-metric="reward"] canvas')
    legend = page.locator('.chart[data-metric="reward"] .u-legend .u-series').all_inner_texts()
    assert any("cmp-a" in t for t in legend) and any("cmp-b" in t for t in legend)
    differing = page.locator("#config-diff tr.differs td:first-child").all_inner_texts()
    assert {"name", "train.learning_rate", "train.temperature"} <= set(differing)
    assert "train.max_steps" not in differing
    page.wait_for_selector("#side-by-side .column pre.completion")
    assert page.locator("#side-by-side .column").count() == 2
    page.screenshot(path=str(SHOTS / "compare.png"), full_page=True)
    assert not page.errors, page.errors


def test_api_calls_from_a_session_need_the_csrf_token(server):
    """A logged-in browser session can call the API; state-changing calls also need the CSRF header."""
    base = server["base"]
    with httpx.Client(base_url=base, follow_redirects=False) as session:
        login_page = session.get("/login")
        import re

        csrf = re.search(r'name="csrf_token" value="([^"]+)"', login_page.text).group(1)
        assert (
            session.post("/login", data={"token": server["token"], "csrf_token": csrf, "next": "/runs"}).status_code
            == 303
        )
        assert session.get(API + "/runs").status_code == 200
        page_csrf = re.search(r'name="csrf-token" content="([^"]+)"', session.get("/runs").text).group(1)
        blocked = session.post(API + "/runs", json=small_config("csrf"))
        assert blocked.status_code == 403 and "CSRF" in blocked.json()["detail"]
        allowed = session.post(API + "/runs", json=small_config("csrf"), headers={"X-CSRF-Token": page_csrf})
        assert allowed.status_code == 201
        # it need not train: cancelled before the worker spends a training on it
        server["client"].post(f"/runs/{allowed.json()['id']}/cancel")
        wait_done(server["client"], allowed.json()["id"])
        assert session.post("/logout", data={"csrf_token": "wrong"}).status_code == 403
