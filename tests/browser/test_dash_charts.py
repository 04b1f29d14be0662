"""Charts of the run and compare pages (issue 13) in a real browser, and the histogram route.

One finished run (3 steps) serves the static checks; one long run, started while the pages are open, serves the
live updates and the cancel confirmation, and is cancelled at the end.
"""

from __future__ import annotations

import pytest

from tests.support.browser import shoot, small_config, wait_done, wait_js

LEGEND = """(sel) => [...document.querySelector(sel).querySelectorAll('.u-legend tr.u-series')]
    .map(tr => [tr.querySelector('.u-label').textContent, tr.querySelector('.u-value').textContent])"""


@pytest.fixture(scope="module")
def done_run(server):
    client = server["client"]
    run_id = client.post("/runs", json=small_config("charts-done")).json()["id"]
    run = wait_done(client, run_id)
    assert run["status"] == "succeeded", run
    metrics = client.get(f"/runs/{run_id}/metrics").json()
    return {"id": run_id, "run": client.get(f"/runs/{run_id}").json(), "metrics": metrics}


def samples_at(client, run_id: str, step: int) -> list[dict]:
    return client.get(f"/runs/{run_id}/samples", params={"step": step, "limit": 500}).json()["items"]


def ema(values: list[float], alpha: float) -> list[float]:
    out, last = [], 0.0
    for n, v in enumerate(values, 1):
        last = last * alpha + (1 - alpha) * v
        out.append(last / (1 - alpha**n))
    return out


# ---- the histogram route


def test_histogram_route_counts_the_rows_of_a_step(server, done_run):
    client, run_id = server["client"], done_run["id"]
    latest = client.get(f"/runs/{run_id}/histogram").json()
    steps = sorted({s["step"] for s in client.get(f"/runs/{run_id}/samples", params={"limit": 500}).json()["items"]})
    assert latest["steps"] == steps and latest["step"] == steps[-1] and latest["field"] == "completion_length"
    for step in steps:
        h = client.get(
            f"/runs/{run_id}/histogram", params={"field": "completion_length", "step": step, "bins": 20}
        ).json()
        lengths = [s["completion_length"] for s in samples_at(client, run_id, step)]
        assert h["step"] == step and h["total"] == len(lengths) == sum(h["counts"]) and h["missing"] == 0
        assert len(h["edges"]) == len(h["counts"]) + 1 and all(e == int(e) for e in h["edges"])  # whole tokens
        for i, count in enumerate(h["counts"]):
            lo, hi = h["edges"][i], h["edges"][i + 1]
            assert count == sum(lo <= v < hi for v in lengths), (i, h, lengths)
        assert (h["min"], h["max"]) == (min(lengths), max(lengths))
        assert h["mean"] == pytest.approx(sum(lengths) / len(lengths))
    one = client.get(f"/runs/{run_id}/histogram", params={"bins": 1, "step": steps[0]}).json()
    assert len(one["counts"]) == 1 and one["counts"][0] == one["total"]
    rewards = client.get(f"/runs/{run_id}/histogram", params={"field": "reward", "bins": 5}).json()
    assert sum(rewards["counts"]) + rewards["missing"] == rewards["total"] == latest["total"]
    assert len(rewards["counts"]) <= 5


def test_histogram_route_refuses_bad_parameters_by_name(server, done_run):
    client, run_id = server["client"], done_run["id"]
    assert client.get("/runs/nosuchrun/histogram").status_code == 404
    for params, path in (
        ({"field": "prompt"}, "query.field"),
        ({"bins": 0}, "query.bins"),
        ({"bins": 201}, "query.bins"),
        ({"bins": "many"}, "query.bins"),
        ({"step": -1}, "query.step"),
        ({"step": "last"}, "query.step"),
        ({"step": 999}, "query.step"),  # a step without rollout rows
    ):
        r = client.get(f"/runs/{run_id}/histogram", params=params)
        assert r.status_code == 422, (params, r.text)
        assert [d["path"] for d in r.json()["detail"]] == [path], r.json()
    assert "no rollout rows at step 999" in client.get(f"/runs/{run_id}/histogram", params={"step": 999}).text
    # a run without rollouts yet: no step, nothing counted
    queued = client.post("/runs", json=small_config("charts-empty")).json()["id"]
    empty = client.get(f"/runs/{queued}/histogram").json()
    assert (empty["step"], empty["steps"], empty["counts"], empty["total"]) == (None, [], [], 0)
    assert client.post(f"/runs/{queued}/cancel").status_code == 200
    wait_done(client, queued)


# ---- the charts


def open_run(page, server, run_id: str) -> None:
    page.goto(f"{server['base']}/runs/{run_id}")
    wait_js(page, "document.querySelectorAll('.chart[data-metric] canvas').length >= 10")
    wait_js(page, "!!document.querySelector('.chart[data-metric=\"rewards/overlay\"] canvas')")


def hover_step(page, metric: str, step: int) -> list[list[str]]:
    """Moves the mouse over the chart of `metric` at `step`; the legend's rows [label, value]."""
    sel = f'.chart[data-metric="{metric}"]'
    page.locator(sel).scroll_into_view_if_needed()
    x = page.evaluate(f"document.querySelector('{sel}').chart.plot.valToPos({step}, 'x')")
    box = page.locator(f"{sel} .u-over").bounding_box()
    page.mouse.move(box["x"] + min(max(x, 1), box["width"] - 1), box["y"] + box["height"] / 2)  # inside the plot
    wait_js(page, f"document.querySelector('{sel} .u-legend tr.u-series .u-value').textContent === '{step}'")
    return page.evaluate(LEGEND, sel)


def test_hover_shows_every_series_value_and_the_reward_overlay(page, server, done_run):
    run_id, metrics = done_run["id"], done_run["metrics"]
    open_run(page, server, run_id)
    # single-series chart: step and value under the cursor, equal to the API's value at that step
    for step, value in metrics["reward"]:
        rows = hover_step(page, "reward", step)
        assert rows[0] == ["step", str(step)]
        assert rows[1][0] == "reward" and float(rows[1][1]) == pytest.approx(value, rel=1e-5, abs=1e-9)
    # the overlay: each reward function's mean and its weighted contribution (mean x weight from the config)
    weights = {r["name"]: r["weight"] for r in done_run["run"]["config"]["rewards"]}
    assert weights == {"accuracy": 1.0, "numeric": 0.5}
    step, reward = metrics["reward"][-1]
    rows = hover_step(page, "rewards/overlay", step)
    labels = [label for label, _ in rows[1:]]
    assert labels == ["accuracy mean", "accuracy × 1", "numeric mean", "numeric × 0.5"]
    values = {label: float(v) for label, v in rows[1:]}
    for name, weight in weights.items():
        mean = dict(metrics[f"rewards/{name}/mean"])[step]
        assert values[f"{name} mean"] == pytest.approx(mean, rel=1e-5, abs=1e-9)
        assert values[f"{name} × {weight:g}"] == pytest.approx(mean * weight, rel=1e-5, abs=1e-9)
    # the weighted contributions add up to the reward (every row is scorable here)
    assert values["accuracy × 1"] + values["numeric × 0.5"] == pytest.approx(reward, rel=1e-4, abs=1e-6)
    shoot(page, "run-charts-hover")
    assert not page.errors, page.errors


def test_integer_step_ticks_and_flat_series_range(page, server, done_run):
    metrics = done_run["metrics"]
    open_run(page, server, done_run["id"])
    ticks = page.evaluate("[...document.querySelectorAll('.chart[data-metric]')].map(c => c.dataset.xticks)")
    assert ticks and all(ticks)
    for labels in ticks:
        assert all(t.lstrip("-").isdigit() for t in labels.split(",")), labels  # never a fractional step
    assert set(page.evaluate("document.querySelector('.chart[data-metric=\"reward\"]').dataset.xticks").split(",")) <= {
        "0", "1", "2", "3", "4"
    }  # fmt: skip
    # every chart's y range as drawn: a flat series gets a band around its value, never 0..100
    ranges = page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('.chart[data-metric]')].map(c => [c.dataset.metric, c.dataset.yrange]))"
    )
    flat = {k: pts[0][1] for k, pts in metrics.items() if k in ranges and len({v for _, v in pts}) == 1}
    assert flat, "a tiny run has constant metrics (clip ratios, learning rate, ...)"
    for key, c in flat.items():
        lo, hi = map(float, ranges[key].split(","))
        if c == 0:
            assert (lo, hi) == (-1, 1), key
        else:
            d = max(abs(c) * 0.1, 1e-3)
            assert (lo, hi) == (pytest.approx(c - d), pytest.approx(c + d)), (key, c, lo, hi)
    for key, r in ranges.items():
        assert r != "0,100", key
    # the range function itself
    assert page.evaluate("CollageCharts.yRange(0, 0)") == [-1, 1]
    assert page.evaluate("CollageCharts.yRange(5, 5)") == [4.5, 5.5]
    lo, hi = page.evaluate("CollageCharts.yRange(1e-5, 1e-5)")
    assert (lo, hi) == (pytest.approx(1e-5 - 1e-3), pytest.approx(1e-5 + 1e-3))
    lo, hi = page.evaluate("CollageCharts.yRange(0.3, 0.30000000000000004)")  # apart by rounding only: flat
    assert (lo, hi) == (pytest.approx(0.27), pytest.approx(0.33))
    lo, hi = page.evaluate("CollageCharts.yRange(-3, -3)")
    assert (lo, hi) == (pytest.approx(-3.3), pytest.approx(-2.7))
    assert not page.errors, page.errors


def test_smoothing_and_the_log_toggle(page, server, done_run):
    metrics = done_run["metrics"]
    open_run(page, server, done_run["id"])
    # a metric that changes from step to step (step_time always does)
    key = next(k for k in ("reward", "loss", "grad_norm", "step_time") if len({v for _, v in metrics[k]}) > 1)
    sel = f'.chart[data-metric="{key}"]'
    raw = [v for _, v in metrics[key]]
    before = page.evaluate(f"document.querySelector('{sel}').chart.plot.data.slice(1)")
    assert before == [pytest.approx(raw)]
    slide = "(e, v) => { e.value = v; e.dispatchEvent(new Event('input', { bubbles: true })); }"  # as a drag ends
    page.locator("#smoothing").evaluate(slide, "0.9")
    assert page.inner_text("#smoothing-value") == "0.90"
    wait_js(page, f"document.querySelector('{sel}').chart.plot.data.length === 3")
    drawn_raw, smoothed = page.evaluate(f"document.querySelector('{sel}').chart.plot.data.slice(1)")
    assert drawn_raw == pytest.approx(raw) and smoothed == pytest.approx(ema(raw, 0.9))
    assert smoothed != pytest.approx(raw)
    widths = page.evaluate(f"document.querySelector('{sel}').chart.plot.series.slice(1).map(s => s.width)")
    assert widths[1] > widths[0]  # the smoothed line bold, the raw one faint and thin
    rows = hover_step(page, key, metrics[key][-1][0])
    assert [label for label, _ in rows[1:]] == [f"{key} (raw)", key]
    assert float(rows[2][1]) == pytest.approx(ema(raw, 0.9)[-1], rel=1e-5)
    shoot(page, "run-charts-smoothed")
    page.locator("#smoothing").evaluate(slide, "0")
    wait_js(page, f"document.querySelector('{sel}').chart.plot.data.length === 2")

    # log scale: allowed where every value is > 0, refused (greyed out, with the reason) elsewhere
    positive = next(
        k for k in ("step_time", "completions/mean_length", "grad_norm") if min(v for _, v in metrics[k]) > 0
    )
    nonpositive = next(k for k, pts in metrics.items() if not k.startswith("timing/") and min(v for _, v in pts) <= 0)
    psel, nsel = f'.chart[data-metric="{positive}"]', f'.chart[data-metric="{nonpositive}"]'
    assert page.evaluate(f"document.querySelector('{psel}').chart.plot.scales.y.distr") == 1
    page.check(f"{psel} .log-toggle input")
    wait_js(page, f"document.querySelector('{psel}').chart.plot.scales.y.distr === 3")
    assert page.get_attribute(psel, "data-log") == "1"
    lo, hi = map(float, page.get_attribute(psel, "data-yrange").split(","))
    assert lo > 0 and lo <= min(v for _, v in metrics[positive]) and hi >= max(v for _, v in metrics[positive])
    assert page.is_disabled(f"{nsel} .log-toggle input")
    assert "needs every value > 0" in page.get_attribute(f"{nsel} .log-toggle", "title")
    page.click(f"{nsel} .log-toggle", force=True)  # a click on the greyed-out toggle says why
    assert "needs every value > 0" in page.inner_text(f"{nsel} .chart-note")
    assert page.evaluate(f"document.querySelector('{nsel}').chart.plot.scales.y.distr") == 1
    shoot(page, "run-charts-log")
    page.uncheck(f"{psel} .log-toggle input")
    wait_js(page, f"document.querySelector('{psel}').chart.plot.scales.y.distr === 1")
    assert not page.errors, page.errors


def test_completion_length_histogram_per_step(page, server, done_run):
    client, run_id = server["client"], done_run["id"]
    open_run(page, server, run_id)
    hist = ".histogram[data-field='completion_length']"
    page.wait_for_selector(f"{hist} rect.hist-bar")
    steps = client.get(f"/runs/{run_id}/histogram").json()["steps"]
    assert page.get_attribute(hist, "data-step") == str(steps[-1])  # the latest step first
    options = page.locator(f"{hist} select.hist-step option").all_inner_texts()
    assert options == [f"latest ({steps[-1]})", *map(str, steps)]
    for step in (steps[0], steps[-1]):
        page.select_option(f"{hist} select.hist-step", str(step))
        wait_js(page, f"document.querySelector(\"{hist}\").dataset.step === '{step}'")
        counts = [
            int(c) for c in page.locator(f"{hist} rect.hist-bar").evaluate_all("rs => rs.map(r => r.dataset.count)")
        ]
        assert sum(counts) == len(samples_at(client, run_id, step)) == int(page.get_attribute(hist, "data-total"))
        assert f"step {step} · {sum(counts)} rows" in page.inner_text(f"{hist} .hist-summary")
    shoot(page, "run-histogram")
    assert not page.errors, page.errors


def test_tags_and_notes_edited_after_launch(page, server, done_run):
    client, run_id = server["client"], done_run["id"]
    open_run(page, server, run_id)
    page.click("#edit-meta")
    page.fill("#tags-input", "baseline, lr-sweep ,  <b>x</b>")
    notes = "first line\nsecond line <script>window.__pwned = 1</script>"
    page.fill("#notes-input", notes)
    shoot(page, "run-edit-meta")
    page.click("#save-meta")
    page.wait_for_selector("#meta-form", state="hidden")
    assert sorted(page.locator("#tags .tag").all_inner_texts()) == sorted(["baseline", "lr-sweep", "<b>x</b>"])
    assert page.inner_text("#notes") == notes and page.evaluate("window.__pwned") is None
    saved = client.get(f"/runs/{run_id}").json()
    assert sorted(saved["tags"]) == sorted(["baseline", "lr-sweep", "<b>x</b>"]) and saved["notes"] == notes
    page.reload()
    page.wait_for_selector("#tags .tag")
    assert sorted(page.locator("#tags .tag").all_inner_texts()) == sorted(["baseline", "lr-sweep", "<b>x</b>"])
    # a bad tag: the error names it next to the field, and nothing changes
    page.click("#edit-meta")
    page.fill("#tags-input", "ok, " + "t" * 1000)
    page.click("#save-meta")
    page.wait_for_selector("[data-error-for='tags']:not(:empty)")
    assert "tag 2" in page.inner_text("[data-error-for='tags']")
    assert sorted(client.get(f"/runs/{run_id}").json()["tags"]) == sorted(["baseline", "lr-sweep", "<b>x</b>"])
    page.click("#cancel-meta")
    assert page.is_visible("#meta-view")
    assert not [e for e in page.errors if "422" not in e], page.errors  # the refused save logs its 422


# ---- live: a run started while the pages are open


def points(page, metric: str, series: int = 1) -> int:
    return page.evaluate(
        f"(() => {{ const c = document.querySelector('.chart[data-metric=\"{metric}\"]');"
        f" return c ? c.chart.plot.data[{series}].filter(v => v !== null).length : 0; }})()"
    )


@pytest.fixture
def live_run(server):
    """A run long enough to outlast the test (cancelled by it, or at the end whatever happened)."""
    client = server["client"]
    run_id = client.post("/runs", json=small_config("charts-live", max_steps=5000)).json()["id"]
    yield run_id
    if client.get(f"/runs/{run_id}").json()["status"] in ("queued", "running"):
        client.post(f"/runs/{run_id}/cancel")
        wait_done(client, run_id)


def test_live_updates_and_cancel_confirmation(page, server, done_run, live_run):
    client, live = server["client"], live_run
    # compare: the finished run and the new one, opened before the new one trains; its series grows from its stream
    page.goto(f"{server['base']}/compare?ids={done_run['id']},{live}")
    page.wait_for_selector('.chart[data-metric="reward"] canvas')
    page.evaluate("window.__loaded = 1")
    start = points(page, "reward", 2)
    wait_js(
        page,
        f"(document.querySelector('.chart[data-metric=\"reward\"]')?.chart.plot.data[2] || []).filter(v => v !== null).length >= {start + 2}",
        timeout=240,  # its training process starts (imports, model load) before the first step
        what="two live reward points on the compare page",
    )
    assert points(page, "reward", 1) == len(done_run["metrics"]["reward"])  # the finished run stays as it was
    wait_js(page, f"document.querySelector('.legend li[data-run=\"{live}\"] .run-status').textContent === 'running'")
    assert page.evaluate("window.__loaded") == 1  # no reload
    shoot(page, "compare-live")

    # the run page: charts, the overlay and the histogram follow the run without a reload
    page.goto(f"{server['base']}/runs/{live}")
    page.wait_for_selector('.chart[data-metric="reward"] canvas')
    page.evaluate("window.__loaded = 1")
    before = points(page, "reward")
    wait_js(
        page,
        f"(document.querySelector('.chart[data-metric=\"reward\"]')?.chart.plot.data[1] || []).filter(v => v !== null).length >= {before + 2}",
        timeout=60,
    )
    assert points(page, "rewards/overlay") >= before + 2
    first_hist = int(page.get_attribute(".histogram", "data-step") or 0)
    wait_js(page, f"Number(document.querySelector('.histogram').dataset.step) > {first_hist}")
    assert page.evaluate("window.__loaded") == 1

    # cancel asks first: Keep running leaves it running
    page.click("#cancel")
    page.wait_for_selector("dialog#confirm[open]")
    assert page.inner_text("#confirm-yes") == "Cancel run" and page.inner_text("#confirm-no") == "Keep running"
    shoot(page, "run-cancel-confirm", full_page=False)
    page.click("#confirm-no")
    page.wait_for_selector("dialog#confirm", state="hidden")
    steps_now = points(page, "reward")
    wait_js(
        page,
        f"document.querySelector('.chart[data-metric=\"reward\"]').chart.plot.data[1].filter(v => v !== null).length > {steps_now}",
        what="a step after Keep running",
    )
    assert client.get(f"/runs/{live}").json()["status"] == "running"  # it kept training
    # ... and confirming cancels it
    page.click("#cancel")
    page.wait_for_selector("dialog#confirm[open]")
    page.click("#confirm-yes")
    wait_js(page, "['cancelling', 'cancelled'].includes(document.getElementById('status').textContent)")
    assert client.get(f"/runs/{live}").json()["status"] in ("cancelling", "cancelled")
    assert wait_done(client, live)["status"] == "cancelled"
    wait_js(page, "document.getElementById('status').textContent === 'cancelled'")
    assert page.evaluate("window.__loaded") == 1
    assert not page.errors, page.errors


def test_a_nan_in_the_stream_does_not_break_the_page(page, server, done_run):
    """Python's json writes NaN and Infinity; the pages' parser turns them into gaps instead of throwing."""
    page.goto(f"{server['base']}/runs/{done_run['id']}")
    page.wait_for_selector('.chart[data-metric="reward"] canvas')
    parsed = page.evaluate("""CollageCharts.parseEvent('{"step": 3, "kl": NaN, "loss": -Infinity, "a/b": 1.5}')""")
    assert parsed == {"step": 3, "kl": None, "loss": None, "a/b": 1.5}
    assert not page.errors, page.errors
