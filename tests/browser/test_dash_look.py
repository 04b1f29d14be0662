"""The dashboard's look in a real browser against a real `collage serve`: dark scheme and its toggle (charts redrawn
in the theme's colours), 390 px screens, visible keyboard focus, the API docs offline, the documented curl
quick-start run as written, `collage submit` printing the run's dashboard page, and screenshots of every page.

One run for the whole module: the JSON config of docs/api.md's quick start, submitted by its curl commands.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.support import API, ROOT
from tests.support.browser import login, page_ms, shoot, wait_js
from tests.support.docs import quick_start
from tests.support.waiting import scaled


@pytest.fixture(scope="module")
def quick_run(server, tmp_path_factory):
    """The quick start run exactly as documented: run.json, then the bash block (its server URL set to the test
    server's). Returns the run id, the script's stdout and its folder."""
    config, script = quick_start()
    assert "http://127.0.0.1:8000" in script
    script = script.replace("http://127.0.0.1:8000", server["base"])
    folder = tmp_path_factory.mktemp("quick-start")
    (folder / "run.json").write_text(json.dumps(config))
    env = {**server["env"], "ADMIN_TOKEN": server["token"], "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # `collage` and `python3` of this interpreter
    env.pop("COLLAGE_TOKEN", None)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=scaled(300))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_id = json.loads((folder / "created.json").read_text())["id"]
    return {"id": run_id, "stdout": done.stdout, "folder": folder}


def luminance(page, selector: str = "body", prop: str = "backgroundColor") -> float:
    """Relative luminance (0 black .. 1 white) of an element's computed colour."""
    rgb = page.evaluate(f"getComputedStyle(document.querySelector({selector!r})).{prop}")
    r, g, b = (int(v) / 255 for v in re.findall(r"[\d.]+", rgb)[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_the_curl_quick_start_runs_as_written(server, quick_run):
    client, run_id = server["client"], quick_run["id"]
    out = quick_run["stdout"]
    assert f"dashboard: {server['base']}/runs/{run_id}" in out
    token, _ = json.JSONDecoder().raw_decode(out, out.index('{"name":"ci-bot"'))
    assert token["role"] == "member" and token["token"].startswith("clg_")  # the API answer holds the token once
    names = {t["name"] for t in client.get("/tokens").json()}
    assert {"alice", "ci-bot"} <= names
    # the stream followed the run to its end; the state, samples, metrics and export commands answered
    assert "event: progress" in out and '"status": "succeeded"' in out, out[-2000:]
    run = client.get(f"/runs/{run_id}").json()
    assert run["status"] == "succeeded" and run["created_by"] == "alice"
    assert '"items"' in out and '"reward"' in out
    rows = [json.loads(line) for line in (quick_run["folder"] / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 8 and {row["step"] for row in rows} == {1, 2, 3}


def test_submit_prints_the_dashboard_url_on_stderr(server, tmp_path):
    import yaml

    config, _ = quick_start()
    config["resources"]["queue"] = "no-worker-here"  # stays queued: cancelled below without training
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**server["env"], "COLLAGE_TOKEN": server["token"]}
    done = subprocess.run([sys.executable, "-m", "collage.app.cli", "submit", str(path), "--server", server["base"] + "/"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=scaled(60))  # fmt: skip
    assert done.returncode == 0, done.stderr
    stdout = done.stdout.strip().splitlines()
    assert len(stdout) == 1 and stdout[0].startswith("submitted run "), done.stdout  # stdout as scripts know it
    run_id = stdout[0].split()[2]
    assert f"dashboard: {server['base']}/runs/{run_id}" in done.stderr.splitlines()
    assert "/runs/" not in stdout[0].replace(f"{API}/runs/", "")  # the page's URL is not on stdout
    assert server["client"].post(f"/runs/{run_id}/cancel").status_code == 200


def test_dark_scheme_follows_the_system_and_the_toggle_overrides_it_and_persists(page, server):
    assert page.evaluate(
        "!!document.querySelector('head > script[src=\"/static/theme.js\"]:not([defer]):not([async])')"
    ), "theme.js must run in <head> before the first paint"
    page.emulate_media(color_scheme="dark")
    page.reload()
    page.wait_for_selector("#runs-body")
    assert luminance(page) < 0.1 and luminance(page, "body", "color") > 0.6
    assert page.evaluate("document.documentElement.dataset.scheme") == "dark"
    assert page.input_value("#theme") == "auto"
    # the toggle overrides the system, and survives a reload (localStorage)
    page.select_option("#theme", "light")
    assert luminance(page) > 0.9 and page.evaluate("document.documentElement.dataset.scheme") == "light"
    page.reload()
    page.wait_for_selector("#runs-body")
    assert luminance(page) > 0.9 and page.input_value("#theme") == "light"
    assert page.evaluate("localStorage.getItem('collage-theme')") == "light"
    # the choice holds on every page, the login page included
    page.goto(server["base"] + "/launch")
    assert luminance(page) > 0.9
    page.select_option("#theme", "dark")
    page.emulate_media(color_scheme="light")
    page.goto(server["base"] + "/runs")
    assert luminance(page) < 0.1 and page.input_value("#theme") == "dark"
    # back to auto: the system's setting again, and a change of it applies at once
    page.select_option("#theme", "auto")
    assert luminance(page) > 0.9 and page.evaluate("localStorage.getItem('collage-theme')") is None
    page.emulate_media(color_scheme="dark")
    wait_js(page, "document.documentElement.dataset.scheme === 'dark'")
    assert luminance(page) < 0.1
    assert not page.errors, page.errors


def test_charts_take_their_colours_from_the_theme_and_redraw_on_a_change(page, server):
    page.emulate_media(color_scheme="light")
    page.reload()
    page.wait_for_selector("#runs-body")
    js = """() => {
      const box = document.createElement('div'); box.style.width = '900px'; document.querySelector('main').append(box);
      const h = Collage.chart(box, 'probe', [{label: 'a', points: [[1, 0.5], [2, 0.7]]}, {label: 'b', points: [[1, 0.1]]}]);
      window.__probe = h.plot; let draws = 0; h.plot.hooks.draw = [...(h.plot.hooks.draw || []), () => draws++];
      window.__draws = () => draws;
    }"""
    page.evaluate(js)
    colours = "[__probe.axes[1].stroke(__probe), __probe.axes[1].grid.stroke(__probe), __probe.series[1].stroke(__probe, 1), __probe.series[2].stroke(__probe, 2)]"
    light = page.evaluate(colours)
    assert light == page.evaluate(
        "['--chart-axis', '--chart-grid', '--series-1', '--series-2'].map(v => Collage.cssVar(v))"
    )
    page.select_option("#theme", "dark")
    wait_js(page, "window.__draws() > 0")  # the theme change redrew the chart
    dark = page.evaluate(colours)
    assert dark == page.evaluate(
        "['--chart-axis', '--chart-grid', '--series-1', '--series-2'].map(v => Collage.cssVar(v))"
    )
    assert all(a != b for a, b in zip(light, dark, strict=True)), (light, dark)
    assert not page.errors, page.errors


def test_390_px_wide_pages_never_scroll_sideways(browser, server, quick_run):
    context, page = login(browser, server, 390, 844)
    run_id = quick_run["id"]
    pages = {"runs": "/runs", "launch": "/launch", "run": f"/runs/{run_id}", "rollouts": f"/runs/{run_id}/rollouts"}
    ready = {"runs": f'tr[data-run="{run_id}"]', "launch": ".reward", "run": ".chart canvas", "rollouts": "tr.sample"}
    for name, path in pages.items():
        page.goto(server["base"] + path)
        page.wait_for_selector(ready[name], timeout=page_ms())
        page.wait_for_load_state("networkidle")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"{path} is {width} px wide at 390"
        # the header wraps: every link of it is on screen
        for box in page.locator("header.top a, header.top button, header.top select").all():
            rect = box.bounding_box()
            assert rect["x"] >= 0 and rect["x"] + rect["width"] <= 390, (path, box.inner_text())
        shoot(page, f"look-390-{name}")
    page.goto(server["base"] + "/runs")
    page.wait_for_selector(f'tr[data-run="{run_id}"]')
    # the runs table scrolls inside its own box
    scroll = page.evaluate(
        "(() => { const s = document.getElementById('runs-scroll'); "
        "return [s.scrollWidth, s.clientWidth, getComputedStyle(s).overflowX]; })()"
    )
    assert scroll[0] > scroll[1] and scroll[1] <= 390 and scroll[2] == "auto", scroll
    page.evaluate("document.getElementById('runs-scroll').scrollLeft = 10000")
    assert page.evaluate("document.getElementById('runs-scroll').scrollLeft") > 0
    assert page.evaluate("window.scrollX") == 0
    # the launch form stacks: each field's input sits below its label, not beside it
    page.goto(server["base"] + "/launch")
    page.wait_for_selector(".reward")
    label = page.locator('[data-path="train.max_steps"] label').bounding_box()
    field = page.locator('[name="train.max_steps"]').bounding_box()
    assert field["y"] >= label["y"] + label["height"] - 1 and field["x"] + field["width"] <= 390
    assert not page.errors, page.errors
    context.close()


def test_keyboard_focus_is_visible_on_every_stop(page, server):
    page.goto(server["base"] + "/runs")
    page.wait_for_selector("#runs-body tr")
    seen = []
    for _ in range(14):
        page.keyboard.press("Tab")
        info = page.evaluate(
            "(() => { const e = document.activeElement, s = getComputedStyle(e); "
            "return [e.tagName, e.id || e.getAttribute('href') || e.name || e.textContent.trim().slice(0, 20), "
            "s.outlineStyle, parseFloat(s.outlineWidth)]; })()"
        )
        seen.append(info[:2])
        assert info[2] != "none" and info[3] >= 1, f"no visible focus on {info}"
    tags = {tag for tag, _ in seen}
    assert {"A", "SELECT", "INPUT", "BUTTON"} <= tags, seen  # links, the theme toggle, filters, buttons
    assert seen[0] == ["A", "#main"], seen  # the first stop skips to the content
    # the header lists the pages, Workers included
    assert page.locator('header nav a[href="/workers"]').inner_text() == "Workers"
    assert not page.errors, page.errors


def test_api_docs_load_with_every_outside_request_blocked(browser, server):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(page_ms())
    page = context.new_page()
    errors, outside = [], []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)

    def only_local(route):
        host = urlparse(route.request.url).hostname
        if host in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    context.route("**/*", only_local)
    response = page.goto(server["base"] + f"{API}/docs")
    csp = response.headers["content-security-policy"]
    assert "script-src 'self';" in csp and "unsafe-eval" not in csp and "cdn" not in csp
    page.wait_for_selector(".opblock", timeout=page_ms())
    paths = page.locator(".opblock-summary-path").all_inner_texts()
    assert f"{API}/runs" in paths and f"{API}/runs/{{run_id}}/samples" in paths, paths
    assert page.locator(".opblock").count() >= 20
    assert "Collage" in page.inner_text(".info .title")
    assert not outside, outside  # nothing even tried to leave the server
    assert not errors, errors  # CSP violations show up here
    shoot(page, "look-api-docs", full_page=False)
    # Swagger UI's own dark stylesheet follows the theme
    page.emulate_media(color_scheme="dark")
    wait_js(page, "document.documentElement.classList.contains('dark-mode')")
    assert luminance(page, ".swagger-ui .info .title", "color") > 0.6
    assert luminance(page, ".api-docs-back a", "color") > 0.3  # the way back stays readable in the dark
    page.click("text=Back to Collage")  # the page has a way back to the app (its login page, for this context)
    page.wait_for_url(lambda url: url.startswith(server["base"]) and f"{API}/docs" not in url)
    assert page.locator("header.top").count() == 1  # one of the app's own pages
    context.close()


def test_screenshots_of_every_page_in_light_and_dark(browser, server, quick_run):
    client, run_id = server["client"], quick_run["id"]
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(page_ms())
    page = context.new_page()
    page.goto(server["base"] + "/login")
    shoot(page, "look-login")
    context.close()
    # a second run for the compare page, on a queue no worker serves: it never trains (cancelled at the end)
    overrides = {"name": "quickstart-b", "resources.queue": "no-worker-here"}
    other = client.post(f"/runs/{run_id}/clone", json={"overrides": overrides})
    assert other.status_code == 201, other.text
    context, page = login(browser, server, 1400, 900)
    pages = {
        "runs": ("/runs", f'tr[data-run="{run_id}"]'),
        "launch": ("/launch", ".reward"),
        "run": (f"/runs/{run_id}", ".chart canvas"),
        "rollouts": (f"/runs/{run_id}/rollouts", "tr.sample"),
        "compare": (f"/compare?ids={run_id},{other.json()['id']}", ".chart canvas"),
    }
    for name, (path, ready) in pages.items():
        page.goto(server["base"] + path)
        page.wait_for_selector(ready, timeout=page_ms())
        page.wait_for_load_state("networkidle")
        shoot(page, f"look-{name}")
    assert not page.errors, page.errors
    page.goto(server["base"] + "/runs/nope")  # the error page (a 404: Chromium logs that one)
    assert page.inner_text("h1") == "Not here"
    shoot(page, "look-not-found")
    if page.request.get(server["base"] + "/workers").status == 200:  # the operations page (its own tests check it)
        page.goto(server["base"] + "/workers")
        page.wait_for_load_state("networkidle")
        shoot(page, "look-workers")
    client.post(f"/runs/{other.json()['id']}/cancel")
    context.close()
