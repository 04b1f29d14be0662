"""A new user's friction on the dashboard (issue 17, items 18-21), in a real browser against a real `collage serve`:
a chart's drag-zoom through live steps, the rollouts' filtered total and their layout at 1400 and 390 px, the
compare page's shared prompt and config differences, what a member may not do (said before, not after), a clone's
parent, a queued run's place in the runs list, and its "no live worker" note computed when the page looks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import API, ROOT
from tests.support.browser import login, shoot, small_config, wait_done, wait_js, wait_rows, wait_status
from tests.support.rollouts import seed_run
from tests.support.waiting import scaled


@pytest.fixture(scope="module")
def busy(server):
    """One long run the module's worker trains while the tests look: live steps for the zoom, a busy worker for the
    queue tests (one training process for all of them); cancelled at the end."""
    client = server["client"]
    run = client.post("/runs", json=small_config("busy-live", max_steps=5000)).json()["id"]
    wait_status(client, run, ("running",))
    yield run
    client.post(f"/runs/{run}/cancel")
    wait_done(client, run)


def test_a_drag_zoom_stays_through_live_steps_until_reset(browser, server, busy):
    client, run = server["client"], busy
    context, page = login(browser, server)
    try:
        page.goto(f"{server['base']}/runs/{run}")
        sel = '.chart[data-metric="reward"]'
        state = f"(() => {{ const c = document.querySelector('{sel}').chart; return [c.plot.scales.x.min, " \
                f"c.plot.scales.x.max, c.plot.data[0].length, c.plot.data[0][c.plot.data[0].length - 1]]; }})()"  # fmt: skip
        wait_js(page, f"!!document.querySelector('{sel}') && document.querySelector('{sel}').chart.plot.data[0].length >= 6",
                timeout=180)  # fmt: skip
        box = page.locator(f"{sel} .u-over").bounding_box()
        y = box["y"] + box["height"] / 2
        page.mouse.move(box["x"] + box["width"] * 0.2, y)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.6, y, steps=6)
        page.mouse.up()
        lo, hi, points, last = page.evaluate(state)
        assert hi < last and page.get_attribute(sel, "data-zoom") == f"{lo},{hi}"
        assert page.is_visible(f"{sel} .zoom-reset")
        wait_js(page, f"{state}[2] >= {points + 2}", timeout=120)  # two live steps arrived ...
        now = page.evaluate(state)
        assert now[:2] == [lo, hi], (now, lo, hi)  # ... and the reader's zoom stayed
        shoot(page, "run-zoom-kept", full_page=False)
        page.click(f"{sel} .zoom-reset")
        wait_js(page, f"{state}[1] === {state}[3]")  # every step again, the newest included
        assert page.get_attribute(sel, "data-zoom") == "" and page.is_hidden(f"{sel} .zoom-reset")
        assert client.get(f"/runs/{run}").json()["status"] == "running"
        assert not page.errors, page.errors
    finally:
        context.close()


@pytest.fixture(scope="module")
def wide(server):
    return seed_run(server, "rollouts-wide", "because")


def test_rollouts_show_the_filtered_total_and_fit_1400_px(browser, server, wide):
    context, page = login(browser, server)
    page.goto(f"{server['base']}/runs/{wide}/rollouts")
    # the count and the rows are two requests: either may answer first, and the line never says "0 of 12"
    wait_rows(page, 12)
    assert page.inner_text("#total") == "12 rows match" and page.inner_text("#count") == "12 of 12 rows shown"
    page.select_option('[name="advantage"]', "pos")  # completion 2 of each group: 4 rows
    wait_rows(page, 4)
    assert page.inner_text("#total") == "4 rows match"
    page.select_option('[name="advantage"]', "")
    wait_js(page, "document.querySelectorAll('tr.sample').length === 12")
    table = page.evaluate("(() => { const b = document.getElementById('table-box'); "
                          "return [b.scrollWidth, b.clientWidth, b.getBoundingClientRect().right]; })()")  # fmt: skip
    assert table[0] <= table[1], f"the rollout table is {table[0]} px wide in a {table[1]} px box"
    for cell in page.locator("tr.sample td.advantage").all():
        rect = cell.bounding_box()
        assert rect["x"] + rect["width"] <= table[2] + 0.5 and rect["x"] + rect["width"] <= 1400
    shoot(page, "rollouts-wide-1400", full_page=False)
    assert not page.errors, page.errors
    context.close()


def test_rollouts_at_390_px_show_each_completion_on_screen(browser, server, wide):
    context, page = login(browser, server, 390, 844)
    page.goto(f"{server['base']}/runs/{wide}/rollouts")
    wait_js(page, "document.querySelectorAll('tr.sample').length === 12")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    box = page.evaluate(
        "(() => { const b = document.getElementById('table-box'); return [b.scrollWidth, b.clientWidth]; })()"
    )
    assert box[0] <= box[1], box  # nothing to scroll sideways to
    for row in page.locator("tr.sample").all()[:4]:
        for part in ("pre.completion", "td.advantage", ".prompt", 'td[data-reward="accuracy"]'):
            rect = row.locator(part).bounding_box()
            assert rect["x"] >= 0 and rect["x"] + rect["width"] <= 390, (part, rect)
        label = row.locator("td.advantage").evaluate("td => getComputedStyle(td, '::before').content")
        assert label == '"advantage "', label  # a card's numbers say what they are
    page.locator("tr.sample").first.scroll_into_view_if_needed()
    shoot(page, "rollouts-wide-390", full_page=False)
    assert not page.errors, page.errors
    context.close()


def test_compare_shows_the_prompt_images_answer_and_only_differing_keys(browser, server):
    one = seed_run(server, "compare-one", "one says", images=3, rewards=("accuracy", "numeric"))
    two = seed_run(server, "compare-two", "two says", images=3, rewards=("accuracy", "numeric"),
                config_changes={"train": {**small_config("x")["train"], "learning_rate": 0.003}})  # fmt: skip
    context, page = login(browser, server)
    page.goto(f"{server['base']}/compare?ids={one},{two}")
    wait_js(page, "!!document.getElementById('side-by-side').dataset.shown")
    step, row = page.get_attribute("#side-by-side", "data-shown").split(":")
    assert step == "2" and row == "row 5"
    shared = page.locator("#shared-prompt")
    assert "Count the images that show a red shape (prompt 0)." in shared.inner_text()
    assert shared.locator("img.thumb").count() == 3 and shared.locator(".image-marker").count() == 3
    assert shared.locator('.column[data-column="answer"]').inner_text() == "answer: 3"
    for run_id, said in ((one, "one says"), (two, "two says")):
        column = page.locator(f'#side-by-side .column[data-run="{run_id}"]')
        assert column.locator(".cmp-sample").count() == 3 and said in column.inner_text()
        assert "accuracy 0.500" in column.inner_text()  # each reward function's value of each completion
    # the other prompt of the step
    page.select_option("#prompt-row", "row 6")
    wait_js(page, "document.getElementById('side-by-side').dataset.shown === '2:row 6'")
    assert "(prompt 1)" in page.inner_text("#shared-prompt")
    assert page.inner_text('#shared-prompt .column[data-column="answer"]') == "answer: 4"
    # config differences: the keys that differ, all of them on request
    keys = page.eval_on_selector_all("#config-diff tr[data-key]", "rows => rows.map(r => r.dataset.key)")
    assert keys == ["name", "train.learning_rate"], keys
    assert page.inner_text("#diff-summary").startswith("2 of ")
    page.check("#diff-all")
    total = int(page.inner_text("#diff-summary").split(" of ")[1].split()[0])
    assert page.locator("#config-diff tr[data-key]").count() == total > 30
    assert page.locator("#config-diff tr.differs").count() == 2
    shoot(page, "compare-prompt-and-diff")
    assert not page.errors, page.errors
    context.close()


@pytest.fixture(scope="module")
def member(server):
    env = {**server["env"], "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "collage.app.cli", "token", "create", "mia"], env=env,
                          capture_output=True, text=True, timeout=scaled(60), cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_member_is_told_what_it_may_not_do_before_trying(browser, server, member, wide):
    import httpx

    client = server["client"]
    theirs = client.post("/runs", json=small_config("admins-run")).json()["id"]
    client.post(f"/runs/{theirs}/cancel")
    wait_done(client, theirs)
    context, page = login(browser, server, token=member)
    requests = []
    page.on("request", lambda r: requests.append((r.method, r.url)) if r.method != "GET" else None)
    page.goto(f"{server['base']}/runs/{wide}")  # made before runs recorded their creator: admins only
    assert page.inner_text("#refusal") == "Only an admin can cancel, resume, delete or edit this run. You can clone it."
    page.goto(f"{server['base']}/runs/{theirs}")  # the admin's run, ended: Delete would be allowed for its owner
    page.wait_for_selector("#status.status-cancelled")
    assert page.inner_text("#refusal") == (
        "Only collage serve (who created it) or an admin can cancel, resume, delete or edit this run. You can clone it."
    )
    for button in ("#delete", "#cancel", "#resume", "#edit-meta"):
        assert page.is_disabled(button), button
        assert page.get_attribute(button, "aria-describedby") == "refusal"
    page.click("#delete", force=True)  # a disabled button does nothing: no dialog, no request
    assert not page.is_visible("#confirm") and not requests
    assert page.is_enabled('a.button[href^="/launch?clone="]')  # cloning is for everyone
    shoot(page, "run-member-refused", full_page=False)
    # the member's own run: its buttons work
    mine = httpx.post(f"{server['base']}{API}/runs", json=small_config("mine"),
                      headers={"Authorization": f"Bearer {member}"}, timeout=scaled(30)).json()["id"]  # fmt: skip
    server["client"].post(f"/runs/{mine}/cancel")
    wait_done(server["client"], mine)
    page.goto(f"{server['base']}/runs/{mine}")
    page.wait_for_selector("#status.status-cancelled")
    assert page.locator("#refusal").count() == 0 and page.is_enabled("#delete") and page.is_enabled("#edit-meta")
    # Resume continues from a checkpoint; a run without one starts again from step 0, and its button says so
    saved = bool(server["client"].get(f"/runs/{mine}/checkpoints").json()["items"])
    wait_js(page, "!!document.getElementById('resume').dataset.fromCheckpoint", what="the resume button's label")
    assert page.inner_text("#resume") == ("Resume" if saved else "Run again"), saved
    assert not page.errors, page.errors
    context.close()


def test_a_clone_from_the_form_records_its_parent_and_the_page_links_it(browser, server):
    client = server["client"]
    source_config = small_config("lineage-source", top_k=5)  # top_k: a key the launch form has no field for
    source = client.post("/runs", json=source_config).json()["id"]
    client.post(f"/runs/{source}/cancel")
    wait_done(client, source)
    context, page = login(browser, server)
    page.goto(f"{server['base']}/launch?clone={source}")
    wait_js(page, "document.querySelector('[name=\"name\"]').value === 'lineage-source-clone'")
    page.fill('[name="train.max_steps"]', "2")
    page.click("#launch-btn")
    page.wait_for_url(f"{server['base']}/runs/*")
    clone = page.url.rsplit("/", 1)[1]
    assert clone != source
    run = client.get(f"/runs/{clone}").json()
    assert run["parent_id"] == source and run["progress"]["max_steps"] == 2
    assert run["config"]["train"]["top_k"] == 5  # kept from the source, not reset to the default
    link = page.locator("#lineage a")
    assert link.inner_text() == "lineage-source" and link.get_attribute("href") == f"/runs/{source}"
    shoot(page, "run-cloned-from", full_page=False)
    client.post(f"/runs/{clone}/cancel")
    wait_done(client, clone)
    assert not page.errors, page.errors
    context.close()


def test_the_runs_list_shows_a_queued_runs_place(browser, server, busy):
    client = server["client"]
    waiting = [client.post("/runs", json=small_config(f"queue-{i}")).json()["id"] for i in (1, 2)]
    context, page = login(browser, server)
    try:
        for place, run_id in enumerate(waiting, 1):
            page.wait_for_selector(f'tr[data-run="{run_id}"][data-queue-position="{place}"]')
            assert page.inner_text(f'tr[data-run="{run_id}"] .queue-place').startswith(f" #{place} in default")
        assert page.locator(f'tr[data-run="{busy}"] .queue-place').inner_text() == ""
        shoot(page, "runs-queue-place", full_page=False)
        assert not page.errors, page.errors
    finally:
        context.close()
        for run_id in waiting:
            client.post(f"/runs/{run_id}/cancel")
        for run_id in waiting:
            wait_done(client, run_id)


def test_a_queued_run_says_live_whether_a_worker_takes_its_queue(browser, server, busy):
    """The run page's "no live worker" note is computed when the page looks (queue_workers), never an event frozen
    at submit: shown for a queue nobody serves, absent for serve's own queue (the demo's false warning)."""
    client = server["client"]
    waiting = client.post("/runs", json=small_config("note-default")).json()["id"]
    orphan_config = small_config("note-orphan")
    orphan_config["resources"] = {**orphan_config.get("resources", {}), "queue": "nobody-serves-this"}
    orphan = client.post("/runs", json=orphan_config).json()["id"]
    context, page = login(browser, server)
    try:
        page.goto(f"{server['base']}/runs/{orphan}")
        page.wait_for_selector("#queue-note:not([hidden])")
        assert 'queue "nobody-serves-this"' in page.inner_text("#queue-note")
        page.goto(f"{server['base']}/runs/{waiting}")
        # the page's own render (not the server's first HTML) has shown the run as queued: the note is decided
        wait_js(page, "document.getElementById('status').className === 'status status-queued'")
        assert page.locator("#queue-note").is_hidden()
        events = client.get(f"/runs/{orphan}/events").json()["items"]
        assert [e["level"] for e in events] == ["info"], events  # nothing frozen into the run's history
        assert not page.errors, page.errors
    finally:
        context.close()
        for run_id in (orphan, waiting):
            client.post(f"/runs/{run_id}/cancel")
        for run_id in (orphan, waiting):
            wait_done(client, run_id)


def test_a_run_that_failed_before_any_checkpoint_offers_to_run_again_not_resume(browser, server):
    """A resume continues from the newest checkpoint: a run that failed at step 0 has none, so the page offers to
    run it again from step 0 instead of promising a resume it cannot make."""
    from collage.training.config import parse_config
    from tests.support.serve import store_writer

    engine, writer = store_writer(server)
    try:
        early = writer.create_run(parse_config(small_config("failed-early")).model_dump(mode="json")).id
        assert writer.transition(early, ["queued"], "failed", error="CUDA out of memory")
    finally:
        engine.dispose()
    context, page = login(browser, server)
    try:
        page.goto(f"{server['base']}/runs/{early}")
        page.wait_for_selector("#status.status-failed")
        wait_js(page, "!!document.getElementById('resume').dataset.fromCheckpoint", what="the resume button's label")
        assert page.inner_text("#resume") == "Run again" and "step 0" in page.get_attribute("#resume", "title")
        assert page.is_enabled("#resume")
        assert not page.errors, page.errors
    finally:
        context.close()
