"""The rollouts page (issue 13) in a real browser against a real `collage serve`: live rows of a running run with
their dataset columns, filters and sort kept in the URL through a reload, a sort by one reward function from its
header, the gallery's keys and the group view, and a bad filter value's API message next to its field."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from collage.app.store.writer import ImageIn, SampleIn
from tests.support.browser import page_ms, shoot, small_config, wait_done, wait_js


def _png(colour, size=(20, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def seeded(server):
    """A finished run written straight into the server's store: 2 steps x 2 groups x 4 completions with known
    rewards per function, 3 images per row of group 0, and dataset columns."""
    from collage.app.store.engine import make_engine
    from collage.app.store.writer import StoreWriter
    from collage.training.config import parse_config

    engine = make_engine(f"sqlite:///{server['home'] / 'collage.db'}")
    writer = StoreWriter(engine, server["home"] / "artifacts")
    run = writer.create_run(parse_config(small_config("rollouts-seeded")).model_dump(mode="json"))
    writer.transition(run.id, ["queued", "running"], "succeeded")
    colours = [(220, 30, 30), (30, 160, 30), (30, 30, 220)]
    for step in (1, 2):
        rows = []
        for g in range(2):
            for i in range(4):
                accuracy = [1.0, 0.0, 0.5, None][(i + g + step) % 4]
                numeric = round(0.1 * (4 * g + i) - 0.3 * step, 3)
                total = None if accuracy is None else accuracy + 0.5 * numeric
                images = [ImageIn(_png(c, (32 + 8 * k, 24))) for k, c in enumerate(colours)] if g == 0 else []
                content = [{"type": "image"} for _ in images] + [{"type": "text", "text": f"How many red? (group {g})"}]
                rows.append(SampleIn(group=g, index=i, prompt=[{"role": "user", "content": content}],
                                     completion=f"answer {i} (step {step}, group {g})", images=images,
                                     rewards={"accuracy": accuracy, "numeric": numeric}, reward=total,
                                     advantage=0.6 - 0.4 * i, completion_length=4 + i, truncated=i == 3,
                                     group_mean=0.4, group_std=0.3, dataset_row=5 + g,
                                     columns={"answer": str(g + 1), "task": "count-red"}))  # fmt: skip
        writer.append_samples(run.id, step, rows)
    engine.dispose()
    return run.id


def _rows(page) -> list[str]:
    return page.eval_on_selector_all("tr.sample", "rows => rows.map(r => r.dataset.id)")


def _wait_rows(page, n: int) -> None:
    wait_js(page, f"document.querySelectorAll('tr.sample').length === {n}")


def test_live_rows_arrive_during_a_running_run_and_carry_dataset_columns(page, server):
    client = server["client"]
    run = client.post("/runs", json=small_config("rollouts-live", max_steps=3)).json()["id"]
    page.goto(f"{server['base']}/runs/{run}/rollouts")  # opened while queued: no rows yet
    page.wait_for_selector("#count")
    page.wait_for_selector("#new-steps-bar:not([hidden])", timeout=page_ms(180))  # rows arrived: announced, not pushed
    assert page.locator("tr.sample").count() == 0
    assert "new step" in page.inner_text("#new-steps")
    wait_js(page, "Number(document.getElementById('step-slider').max) >= 1")  # the slider reaches the new steps
    shoot(page, "rollouts-live-notice", full_page=False)
    page.click("#new-steps")
    wait_js(page, "document.querySelectorAll('tr.sample').length > 0")
    assert page.is_hidden("#new-steps-bar")
    shown = page.locator("tr.sample").count()
    assert wait_done(client, run)["status"] == "succeeded"
    wait_js(
        page,
        "!document.getElementById('new-steps-bar').hidden || document.querySelectorAll('tr.sample').length === 24",
    )
    if page.is_visible("#new-steps-bar"):
        assert page.locator("tr.sample").count() == shown  # the table stays as it was until the reader asks
        page.click("#new-steps")
    _wait_rows(page, 24)  # 3 steps x 8 completions
    # the dataset row's columns came from the trainer through the worker and the store: shown beside the completion
    api_rows = client.get(f"/runs/{run}/samples", params={"limit": 500}).json()["items"]
    assert all(r["columns"]["answer"] == str(r["columns"]["answer"]) and r["columns"]["task"] == "count-red"
               for r in api_rows)  # fmt: skip
    first = page.locator("tr.sample").first
    assert first.locator('.column[data-column="answer"]').inner_text() == f"answer: {api_rows[0]['columns']['answer']}"
    assert "answer: " in page.inner_text("tr.sample .columns")
    shoot(page, "rollouts-live")
    assert not page.errors, page.errors


def test_filters_and_sort_survive_a_reload_through_the_url(page, server, seeded):
    page.goto(f"{server['base']}/runs/{seeded}/rollouts")
    _wait_rows(page, 16)
    page.select_option('[name="sort"]', "-reward.numeric")
    page.select_option('[name="reward_name"]', "accuracy")
    page.fill('[name="min_reward"]', "0.5")
    page.fill('[name="dataset_row"]', "5")
    page.fill('[name="max_step"]', "2")
    wait_js(page, "location.search.includes('dataset_row=5') && location.search.includes('max_step=2')")
    want = {"sort": "-reward.numeric", "reward_name": "accuracy", "min_reward": "0.5", "dataset_row": "5",
            "max_step": "2"}  # fmt: skip
    api_ids = [str(r["id"]) for r in server["client"].get(f"/runs/{seeded}/samples", params=want).json()["items"]]
    assert api_ids
    _wait_ids(page, api_ids)
    query = dict(p.split("=", 1) for p in page.url.split("?", 1)[1].split("&"))
    assert {k: query[k].replace("%2C", ",") for k in want} == want  # the API's own names and values
    shoot(page, "rollouts-filtered")
    page.reload()
    _wait_ids(page, api_ids)
    for name, value in want.items():
        assert page.input_value(f'[name="{name}"]') == value, name
    # a shared link opens the same view in a new page
    other = page.context.new_page()
    other.goto(page.url)
    wait_js(other, f"document.querySelectorAll('tr.sample').length === {len(api_ids)}")
    assert _rows(other) == api_ids
    other.close()
    assert not page.errors, page.errors


def _wait_ids(page, ids: list[str]) -> None:
    wait_js(
        page,
        f"JSON.stringify([...document.querySelectorAll('tr.sample')].map(r => r.dataset.id)) === '{json.dumps(ids, separators=(',', ':'))}'",
    )


def test_sort_by_one_reward_function_from_its_header(page, server, seeded):
    client = server["client"]
    page.goto(f"{server['base']}/runs/{seeded}/rollouts")
    _wait_rows(page, 16)
    for sort in ("-reward.accuracy", "-reward.numeric", "reward.numeric"):  # a second click turns the order around
        page.click(f'th[data-sort="{sort.lstrip("-")}"]')
        ids = [str(r["id"]) for r in client.get(f"/runs/{seeded}/samples", params={"sort": sort}).json()["items"]]
        _wait_ids(page, ids)
        assert page.input_value('[name="sort"]') == sort
        name = sort.split(".", 1)[1]
        values = [
            -1e300 if t == "–" else float(t)
            for t in page.locator(f'tr.sample td[data-reward="{name}"]').all_inner_texts()
        ]
        assert len(values) == 16 and values == sorted(values, reverse=sort.startswith("-")), sort
        assert page.locator("tr.group").count() == 0  # rows are grouped only when sorted by step
    shoot(page, "rollouts-sorted-by-reward")
    assert not page.errors, page.errors


def test_gallery_keys_and_the_group_view(page, server, seeded):
    page.goto(f"{server['base']}/runs/{seeded}/rollouts?min_images=3&step=2")
    _wait_rows(page, 4)
    assert page.input_value('[name="step"]') == "2" and page.inner_text("#step-out") == "2"
    wait_js(page, "document.getElementById('step-slider').value === '2'")  # steps 1 and 2 have rows: the second
    # dataset columns beside the completion
    assert page.locator("tr.sample").first.locator('.column[data-column="answer"]').inner_text() == "answer: 1"
    page.locator("tr.sample").first.locator("img.thumb").nth(1).click()
    page.wait_for_selector("#modal:not([hidden]) figure.gallery img.full")
    index = "document.querySelector('#modal figure.gallery').dataset.index"
    assert page.evaluate(index) == "1"
    wait_js(page, "document.querySelector('#modal img.full').naturalWidth === 40")  # the second image is 40 px wide
    for key, want in [("j", "2"), ("j", "2"), ("k", "1"), ("ArrowLeft", "0"), ("ArrowLeft", "0"), ("ArrowRight", "1")]:
        page.keyboard.press(key)
        assert page.evaluate(index) == want, key
    assert "image 2 of 3" in page.inner_text("#modal figcaption")
    shoot(page, "rollouts-gallery", full_page=False)
    page.keyboard.press("Escape")
    assert page.is_hidden("#modal")
    page.keyboard.press("j")  # the closed gallery no longer listens
    assert page.is_hidden("#modal")
    # the group view: one prompt and its images once, the completions side by side ranked by reward
    page.locator("tr.group button.open-group").first.click()
    page.wait_for_selector("#group-view .group-completion")
    assert "view=group%3A2%3A0" in page.url or "view=group:2:0" in page.url
    assert page.is_hidden("#table-box")
    assert page.locator("#group-view .group-prompt img.thumb").count() == 3
    assert page.locator("#group-view .group-prompt .prompt").count() == 1
    cards = page.locator("#group-view .group-completion")
    assert cards.count() == 4
    totals = [-1e300 if t == "–" else float(t) for t in cards.locator("dd.total").all_inner_texts()]
    assert totals == sorted(totals, reverse=True)
    assert cards.first.locator('dd[data-reward="accuracy"]').inner_text() == "1.000"
    assert cards.first.locator("dd.adv-pos, dd.adv-neg, dd.adv-zero").count() == 1
    assert "answer: 1" in page.inner_text("#group-view .group-prompt .columns")
    shoot(page, "rollouts-group")
    page.reload()  # the open group is part of the URL
    page.wait_for_selector("#group-view .group-completion")
    assert page.locator("#group-view .group-completion").count() == 4
    page.click("#group-view button.back")
    _wait_rows(page, 4)
    assert "view=" not in page.url and page.is_hidden("#group-view")
    assert not page.errors, page.errors


def test_a_bad_filter_value_shows_the_api_message_next_to_its_field(page, server, seeded):
    page.goto(f"{server['base']}/runs/{seeded}/rollouts")
    _wait_rows(page, 16)
    page.fill('[name="min_reward"]', "lots")
    page.wait_for_selector('[data-error-for="min_reward"]:not(:empty)')
    message = page.inner_text('[data-error-for="min_reward"]')
    api_message = server["client"].get(f"/runs/{seeded}/samples", params={"min_reward": "lots"}).json()["detail"][0]
    assert api_message["path"] == "query.min_reward" and message == api_message["message"]
    assert page.locator("tr.sample").count() == 0 and page.inner_text("#count") == ""  # nothing stale
    assert page.locator('[name="min_reward"].invalid').count() == 1
    shoot(page, "rollouts-bad-filter", full_page=False)
    page.fill('[name="min_reward"]', "0.5")
    wait_js(page, "document.querySelectorAll('tr.sample').length > 0")
    assert page.inner_text('[data-error-for="min_reward"]') == "" and page.locator(".invalid").count() == 0
    # an unknown reward function in a shared URL: the API's 422 shows next to the sort field
    page.goto(f"{server['base']}/runs/{seeded}/rollouts?sort=-reward.speed")
    page.wait_for_selector('[data-error-for="sort"]:not(:empty)')
    assert "no reward function 'speed'" in page.inner_text('[data-error-for="sort"]')
    assert page.locator("tr.sample").count() == 0 and page.inner_text("#count") == ""
    # Chromium logs every 4xx fetch as "Failed to load resource": expected here; nothing else (no uncaught error)
    assert [e for e in page.errors if "status of 422" not in e] == [], page.errors
