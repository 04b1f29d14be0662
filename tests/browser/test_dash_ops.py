"""Operations (issue 13) in a real browser and through the API: the workers list and page, queue position and
estimate, editing a run's tags and notes (a browser session's edit needs the CSRF header), and the launch preview
(the dataset helper, synth rows with image markers, a dataset's own columns mapped and its prompts rendered).

One `collage serve` (embedded broker, one CPU worker on queue "default") for the module: a finished run written to
its store (the basis of queue estimates), then a long run that keeps the worker busy while the tests look at it,
cancelled before the launch tests.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support import API
from tests.support.browser import shoot, small_config, wait_done, wait_js
from tests.support.waiting import scaled, wait_for


def _finished_run(server, name: str, seconds: float) -> str:
    """A run that succeeded on queue "default" a moment ago after ``seconds`` of training, written to the server's
    store directly (the basis of queue estimates, without spending a training run on it)."""
    from datetime import timedelta

    from sqlalchemy import update

    from collage.app.store.engine import engine_for
    from collage.app.store.tables import Run, utcnow
    from collage.app.store.writer import StoreWriter
    from collage.training.config import parse_config

    engine = engine_for(f"sqlite:///{server['home'] / 'collage.db'}")
    try:
        config = parse_config(small_config(name)).model_dump(mode="json")
        run = StoreWriter(engine, str(server["home"] / "artifacts")).create_run(config)
        now = utcnow()
        with engine.begin() as connection:
            connection.execute(
                update(Run)
                .where(Run.id == run.id)
                .values(status="succeeded", started_at=now - timedelta(seconds=seconds + 5),
                        finished_at=now - timedelta(seconds=5), step=3, max_steps=3)
            )  # fmt: skip
    finally:
        engine.dispose()
    return run.id


@pytest.fixture(scope="module")
def busy(server):
    """A finished run on queue "default", and a long one the server's worker is busy with (cancelled by ``idle``,
    or at the end)."""
    client = server["client"]
    first = _finished_run(server, "ops-short", seconds=40)
    long = client.post("/runs", json=small_config("ops-long", max_steps=400)).json()["id"]

    def training():
        workers = client.get("/workers").json()["items"]
        run = client.get(f"/runs/{long}").json()
        return run["status"] == "running" and any((w["current_run"] or {}).get("id") == long for w in workers)

    wait_for(training, "the long run to be running on the worker", timeout=240, interval=0.3)
    yield {"short": first, "long": long}
    client.post(f"/runs/{long}/cancel")


@pytest.fixture(scope="module")
def idle(server, busy):
    """The long run cancelled and ended (it built the tiny model): the worker and the CPU are free again."""
    client = server["client"]
    client.post(f"/runs/{busy['long']}/cancel")
    assert wait_done(client, busy["long"])["status"] == "cancelled"


def test_workers_api_lists_the_live_worker_with_its_run(server, busy):
    items = server["client"].get("/workers").json()["items"]
    assert len(items) == 1
    worker = items[0]
    assert worker["queues"] == ["default"] and worker["hostname"] and worker["pid"] > 0
    assert worker["gpu_slots"] == [] and worker["gpus"] is None  # the test server's worker trains on the CPU
    assert worker["current_run"]["id"] == busy["long"] and worker["current_run"]["name"] == "ops-long"
    assert worker["current_run"]["url"].endswith(f"/runs/{busy['long']}")
    assert 0 <= worker["heartbeat_age_s"] < 20
    assert httpx.get(server["base"] + API + "/workers").status_code == 401


def test_queue_position_and_estimate(server, busy):
    client = server["client"]
    nowhere = [client.post("/runs", json={**small_config(f"ops-nowhere-{i}"), "resources": {"gpus": 0,
               "queue": "nowhere"}}).json()["id"] for i in range(2)]  # fmt: skip
    behind = [client.post("/runs", json=small_config(f"ops-behind-{i}")).json()["id"] for i in range(2)]
    try:
        runs = {i: client.get(f"/runs/{i}").json() for i in nowhere + behind}
        # no worker takes queue "nowhere": a place in the queue, but no basis for an estimate
        assert [runs[i]["queue_position"] for i in nowhere] == [1, 2]
        assert [runs[i]["queue_estimate_s"] for i in nowhere] == [None, None]
        # queue "default": its worker is busy with the long run; the short run's duration is the basis
        assert [runs[i]["queue_position"] for i in behind] == [1, 2]
        first, second = (runs[i]["queue_estimate_s"] for i in behind)
        assert first is not None and second is not None and second > first >= 0
        running = client.get(f"/runs/{busy['long']}").json()
        assert running["queue_position"] is None and running["queue_estimate_s"] is None
        client.post(f"/runs/{behind[0]}/cancel")
        assert client.get(f"/runs/{behind[1]}").json()["queue_position"] == 1  # moved up
    finally:
        for run_id in nowhere + behind:
            client.post(f"/runs/{run_id}/cancel")


def test_patch_tags_and_notes(server, busy):
    admin = server["client"]
    base = server["base"] + API

    def member(name: str) -> httpx.Client:
        made = admin.post("/tokens", json={"name": name, "role": "member"})
        assert made.status_code == 201, made.text
        return httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {made.json()['token']}"}, timeout=scaled(30)
        )

    alice, bob = member("ops-alice"), member("ops-bob")
    config = {**small_config("ops-alice-run"), "tags": ["first"], "resources": {"gpus": 0, "queue": "nowhere"}}
    run_id = alice.post("/runs", json=config).json()["id"]
    try:
        edited = alice.patch(f"/runs/{run_id}", json={"tags": ["a", "b", "a"], "notes": "lr too high?"})
        assert edited.status_code == 200, edited.text
        body = edited.json()
        assert body["tags"] == ["a", "b"] and body["notes"] == "lr too high?" and body["config"]["tags"] == ["a", "b"]
        assert [r["id"] for r in admin.get("/runs", params={"tag": "b"}).json()["items"]] == [run_id]
        assert admin.get("/runs", params={"tag": "first"}).json()["items"] == []
        only_notes = alice.patch(f"/runs/{run_id}", json={"notes": "second thought"}).json()
        assert only_notes["tags"] == ["a", "b"] and only_notes["notes"] == "second thought"
        assert admin.patch(f"/runs/{run_id}", json={"tags": []}).json()["tags"] == []  # an admin may
        assert admin.get(f"/runs/{run_id}").json()["notes"] == "second thought"

        refused = bob.patch(f"/runs/{run_id}", json={"notes": "mine now"})
        assert refused.status_code == 403 and "creator or an admin" in refused.json()["detail"]

        def problem(body) -> list:
            response = alice.patch(f"/runs/{run_id}", json=body)
            assert response.status_code == 422, response.text
            return [d["path"] for d in response.json()["detail"]]

        assert problem({"tags": ["ok", ""]}) == ["tags[1]"]
        assert problem({"tags": ["ok", "x" * 101]}) == ["tags[1]"]
        assert problem({"tags": ["nul\u0000"]}) == ["tags[0]"]
        assert problem({"tags": [str(i) for i in range(51)]}) == ["tags"]
        assert problem({"notes": "x" * 10_001}) == ["notes"]
        assert problem({"notes": "a\u0000b"}) == ["notes"]
        assert problem({"color": "red"}) == ["color"]
        assert alice.patch("/runs/nosuchrun", json={"notes": "x"}).status_code == 404
        assert alice.get(f"/runs/{run_id}").json()["notes"] == "second thought"  # bad input changed nothing

        assert alice.patch(f"/runs/{run_id}", json={"notes": ""}).json()["notes"] is None
        audit = [a for a in admin.get("/audit").json() if a["action"] == "run.edit" and a["target"] == run_id]
        admin_name = admin.get(f"/runs/{busy['long']}").json()["created_by"]
        assert [a["actor"] for a in audit] == ["ops-alice", admin_name, "ops-alice", "ops-alice"]  # newest first
        assert audit[0]["detail"].endswith(": notes") and audit[-1]["detail"].endswith(": tags, notes")
    finally:
        admin.post(f"/runs/{run_id}/cancel")
        alice.close()
        bob.close()


def test_workers_page_shows_the_worker_its_heartbeat_and_run(page, server, busy):
    page.goto(server["base"] + "/workers")
    wait_js(page, "document.querySelectorAll('#workers-body tr[data-worker]').length === 1")
    row = page.locator("#workers-body tr[data-worker]")
    assert "default" in row.locator("td").nth(2).inner_text()
    assert "none (CPU)" in row.inner_text()
    heartbeat = row.locator(".heartbeat").inner_text()
    assert heartbeat == "just now" or heartbeat.endswith(" s ago"), heartbeat
    link = row.locator("a.current-run")
    assert link.inner_text() == "ops-long" and link.get_attribute("href") == f"/runs/{busy['long']}"
    assert page.locator('nav a[href="/workers"]').get_attribute("aria-current") == "page"
    shoot(page, "workers")
    link.click()
    page.wait_for_url(f"**/runs/{busy['long']}")
    assert page.errors == []


def test_launch_preview_of_a_synth_dataset(page, server, idle):
    held = []
    page.route("**/api/v1/datasets/check", lambda route: held.append(route))
    page.goto(server["base"] + "/launch")
    page.wait_for_selector(".reward")
    assert page.input_value('[name="resources.gpus"]') == "0"  # the only live worker has no GPU
    page.fill('[name="dataset.source"]', "synth:count-red")
    page.fill('[name="dataset.rows"]', "200")
    page.fill('[name="model.path"]', "tiny:qwen2-vl")
    page.fill('[name="train.max_prompt_length"]', "256")
    page.click("#preview-btn")
    # while the check is held back, the form says it is working
    wait_js(page, "!!document.querySelector('#preview .preview-progress progress')")
    assert page.get_attribute("#preview", "aria-busy") == "true" and page.is_disabled("#preview-btn")
    # evaluating something lets Playwright dispatch the held request to its route handler
    wait_for(lambda: (page.evaluate("1"), held)[1], "the check request")
    wait_js(page, "document.querySelectorAll('#preview .preview-rows tbody tr').length === 5", timeout=90)
    shoot(page, "launch-preview-progress")
    held[0].continue_()
    wait_js(page, "!!document.querySelector('#preview').dataset.done", timeout=90)
    assert not page.is_visible("#preview .preview-progress")
    summary = page.inner_text("#preview .preview-report")
    assert "200 rows, 0 bad" in summary and "image tokens/row" in summary
    rows = page.locator("#preview .preview-rows tbody tr")
    markers = page.locator("#preview .preview-rows .image-marker").all_inner_texts()
    assert "[image 1]" in markers and not any("{" in rows.nth(i).inner_text() for i in range(5))
    with_images = page.evaluate(
        "[...document.querySelectorAll('#preview .preview-rows tbody tr')].map(r => "
        "[r.querySelectorAll('img.thumb').length, r.querySelectorAll('.image-marker').length])"
    )
    assert all(thumbs == marks for thumbs, marks in with_images) and any(t > 0 for t, _ in with_images)
    assert page.locator("#preview .error").count() == 0
    shoot(page, "launch-preview")
    assert page.errors == []


def test_launch_maps_a_datasets_own_columns_and_shows_the_rendered_prompts(page, server, idle):
    """A dataset with question / image_1 / image_2 / solution: Preview lists its columns and guesses the mapping,
    the rows show the prompts as it renders them (live when the template changes), and the launched run records it;
    a template naming a missing column is refused at its field, before any run exists."""
    import io
    import json

    from PIL import Image

    folder = server["home"] / "byod"
    folder.mkdir(exist_ok=True)
    for name, colour in (("red.png", (220, 30, 30)), ("blue.png", (40, 70, 220))):
        buf = io.BytesIO()
        Image.new("RGB", (40, 40), colour).save(buf, format="PNG")
        (folder / name).write_bytes(buf.getvalue())
    rows = [{"question": f"q{i}", "image_1": "red.png", "image_2": "blue.png" if i % 2 else None, "solution": str(i)}
            for i in range(6)]  # fmt: skip
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page.goto(server["base"] + "/launch")
    page.wait_for_selector(".reward")
    page.fill('[name="dataset.source"]', str(folder))
    page.click("#preview-btn")
    # the guess fills the dropdowns, and Preview and check run again with it: every row usable
    wait_js(page, "document.querySelector('#map-prompt').value === 'question'", timeout=90)
    wait_js(page, "!!document.querySelector('#preview').dataset.done && "
                  "document.querySelector('#preview .preview-report').innerText.includes('6 rows, 0 bad')",
            timeout=90)  # fmt: skip
    assert page.input_value("#map-prompt") == "question" and page.input_value("#map-answer") == "solution"
    chosen = page.evaluate("[...document.querySelector('#map-images').selectedOptions].map(o => o.value)")
    assert chosen == ["image_1", "image_2"]
    first = page.locator("#preview .preview-rows tbody tr").nth(1)
    assert "q1" in first.inner_text() and first.locator("img.thumb").count() == 2
    assert first.locator(".image-marker").count() == 2
    assert page.locator("#preview .preview-rows tbody tr").nth(0).locator("img.thumb").count() == 1  # empty skipped
    # a template: the rows follow it live
    page.select_option("#map-prompt", "")
    page.fill('[name="dataset.prompt_template"]', "{images}Question: {question}")
    wait_js(page, "[...document.querySelectorAll('#preview .preview-rows tbody tr')].some(r => "
                  "r.innerText.includes('Question: q3'))")  # fmt: skip
    shoot(page, "launch-column-mapping")
    # a column the dataset lacks: 422 at the template's field, no run
    page.fill('[name="dataset.prompt_template"]', "{images}Question: {question} {hint}")
    page.fill('[name="name"]', "byod-missing")
    page.click("#launch-btn")
    slot = '[data-error-for="dataset.prompt_template"]'
    wait_js(page, f"document.querySelector('{slot}').textContent.includes(\"no column 'hint'\")")
    assert server["client"].get("/runs", params={"q": "byod-missing"}).json()["items"] == []
    page.fill('[name="dataset.prompt_template"]', "{images}Question: {question}")
    page.fill('[name="name"]', "byod")
    page.fill('[name="train.max_steps"]', "1")
    page.click("#launch-btn")
    page.wait_for_url("**/runs/*")
    run_id = page.url.rstrip("/").rsplit("/", 1)[1]
    dataset = server["client"].get(f"/runs/{run_id}").json()["config"]["dataset"]
    assert dataset["columns"]["images"] == ["image_1", "image_2"] and dataset["columns"]["answer"] == "solution"
    assert dataset["columns"]["prompt"] is None and dataset["prompt_template"] == "{images}Question: {question}"
    server["client"].post(f"/runs/{run_id}/cancel")
    # the one console error is the browser logging the refused launch's 422
    assert [e for e in page.errors if "status of 422" not in e] == [], page.errors


def test_patch_from_a_browser_session_needs_the_csrf_header(page, server, busy):
    page.goto(server["base"] + "/runs")
    run_id = busy["long"]
    script = """async ([id, withHeader]) => {
        const headers = {"Content-Type": "application/json"};
        if (withHeader) headers["X-CSRF-Token"] = document.querySelector('meta[name="csrf-token"]').content;
        const r = await fetch("/api/v1/runs/" + id, {method: "PATCH", headers, body: JSON.stringify({notes: "from the page"})});
        return r.status;
    }"""
    assert page.evaluate(script, [run_id, False]) == 403
    assert page.evaluate(script, [run_id, True]) == 200
    assert server["client"].get(f"/runs/{run_id}").json()["notes"] == "from the page"
    page.errors.clear()  # the refused fetch logs a console error by design
