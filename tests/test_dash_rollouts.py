"""The rollouts page and the samples API (issue 13): dataset columns from the trainer to the page and the exports,
per-reward-function sorts and filters with keyset paging on SQLite and PostgreSQL, the dataset row and group
filters, and the page in a real browser: live rows, URL state, the gallery, the group view, field errors.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random

import pytest
from PIL import Image

from collage.app.store.writer import ImageIn, SampleIn
from collage.training.callbacks import COLUMN_TEXT_MAX, RolloutImage, RolloutRow, scalar_columns

from .dashboard_support import shoot, small_config, wait_done, wait_js

API = "/api/v1"
LONG = "x" * (COLUMN_TEXT_MAX + 50)


def _png(colour, size=(20, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


# ----------------------------------------------------------------------------------------- dataset columns


def test_scalar_columns_keep_scalars_cut_long_text_and_drop_the_rest():
    import numpy as np

    got = scalar_columns(
        {"answer": "3", "n": 2, "ok": True, "score": 0.5, "bad": math.nan, "none": None, "tags": ["a"],
         "meta": {"k": 1}, "long": LONG, "np_int": np.int64(7), "np_float": np.float32(0.25), "prompt": "p"}
    )  # fmt: skip
    assert got == {"answer": "3", "n": 2, "ok": True, "score": 0.5, "bad": None, "none": None,
                   "long": "x" * COLUMN_TEXT_MAX + "…", "np_int": 7, "np_float": 0.25}  # fmt: skip
    assert type(got["np_int"]) is int and type(got["ok"]) is bool


def _row(**changes) -> RolloutRow:
    image = RolloutImage(None, None, 20, 20, image=Image.new("RGB", (20, 20), (200, 0, 0)))
    values = dict(step=1, group=0, index=0, prompt="p", completion="c", images=[image], rewards={"accuracy": 1.0},
                  reward=1.0, advantage=0.5, completion_length=3, truncated=False, row=4,
                  columns={"answer": "2", "task": "count-red", "images_meta": [1, 2], "long": LONG})  # fmt: skip
    values.update(changes)
    return RolloutRow(**values)


def test_rollout_rows_carry_columns_to_the_output_folder_and_the_store_callback(tmp_path):
    from collage.training.output import OutputFolder
    from collage.worker.store_callback import _sample_in

    row = _row()
    assert row.columns == {"answer": "2", "task": "count-red", "long": "x" * COLUMN_TEXT_MAX + "…"}
    folder = OutputFolder(tmp_path)
    folder.images.mkdir(parents=True)  # (on_start needs a whole run config: the rows are written directly)
    folder._write_samples([row])
    record = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    assert record["columns"] == row.columns and record["dataset_row"] == 4
    sample = _sample_in(row)
    assert sample.columns == row.columns and sample.dataset_row == 4
    # a row pickled by an older version (a checkpoint's generation buffer) has no columns: it still serialises
    state = dict(row.__dict__)
    del state["columns"]
    old = RolloutRow.__new__(RolloutRow)
    old.__setstate__(state)
    assert old.to_json()["columns"] == {}


# ---------------------------------------------------------------------------------------------- the API


def _config(**changes):
    base = small_config("rollouts-api")
    base["train"]["max_steps"] = 5
    base.update(changes)
    return base


def _fill(app, run_id, steps=3, groups=4, gens=4, seed=3):
    """Rows with rewards for `accuracy` and `numeric` (some unscorable), dataset columns and images."""
    rng = random.Random(seed)
    expected = []
    for step in range(1, steps + 1):
        rows = []
        for g in range(groups):
            for i in range(gens):
                acc = None if (g == 1 and i == 0) else rng.choice([0.0, 0.25, 0.5, 1.0])
                num = None if (g == 2 and i == 1) else round(rng.uniform(-1, 1), 3)
                total = None if acc is None and num is None else (acc or 0.0) + 0.5 * (num or 0.0)
                columns = {"answer": str(g), "task": "count-red", "difficulty": g * 0.5, "hard": g > 1}
                if g == 3:
                    columns["note"] = LONG
                rows.append(
                    SampleIn(group=g, index=i, prompt=[{"role": "user", "content": [{"type": "image"},
                             {"type": "text", "text": f"how many? {g}"}]}], completion=f"s{step} g{g} c{i}",
                             images=[ImageIn(_png((40 * g, 0, 40 * i)))], rewards={"accuracy": acc, "numeric": num},
                             reward=total, advantage=rng.uniform(-1, 1), completion_length=3 + i, truncated=False,
                             group_mean=0.5, group_std=0.1, dataset_row=10 + g, columns=columns)
                )  # fmt: skip
                expected.append({"step": step, "group": g, "index": i, "accuracy": acc, "numeric": num,
                                 "reward": total, "dataset_row": 10 + g})  # fmt: skip
        app.state.writer.append_samples(run_id, step, rows)
    return expected


def _pages(client, run, **params):
    items, cursor = [], None
    while True:
        answer = client.get(f"{API}/runs/{run}/samples", params={**params, **({"cursor": cursor} if cursor else {})})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        items += body["items"]
        cursor = body["next_cursor"]
        if cursor is None:
            return items


def _position(item):
    return item["step"], item["group"], item["index"]


def test_sort_and_filter_by_each_reward_function_with_keyset_pages(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=_config()).json()["id"]
    expected = _fill(app, run)
    assert len(expected) == 48
    for name in ("accuracy", "numeric"):
        for prefix in ("", "-"):
            got = _pages(client, run, sort=f"{prefix}reward.{name}", limit=5)  # many ties: pages split them
            assert len(got) == 48 and len({s["id"] for s in got}) == 48, (name, prefix)
            values = [-1e300 if s["rewards"][name] is None else s["rewards"][name] for s in got]
            assert values == sorted(values, reverse=prefix == "-"), (name, prefix)
            ids = [s["id"] for s in got]  # ties are broken by id, in the sort's direction
            pairs = list(zip(values, ids, strict=True))
            assert pairs == sorted(pairs, reverse=prefix == "-")
            if prefix == "-":
                assert got[-1]["rewards"][name] is None  # unscorable rows sort lowest
    # the reward_name filter bounds one function's value; rows it could not score never match
    cases = [
        ({"reward_name": "accuracy", "min_reward": 0.5}, lambda e: e["accuracy"] is not None and e["accuracy"] >= 0.5),
        ({"reward_name": "accuracy", "max_reward": 0.25}, lambda e: e["accuracy"] is not None and e["accuracy"] <= 0.25),
        ({"reward_name": "numeric", "min_reward": -0.2, "max_reward": 0.4},
         lambda e: e["numeric"] is not None and -0.2 <= e["numeric"] <= 0.4),
        ({"min_reward": 0.5}, lambda e: e["reward"] is not None and e["reward"] >= 0.5),  # the total, as before
        ({"dataset_row": 12}, lambda e: e["dataset_row"] == 12),
        ({"step": 2, "group": 3}, lambda e: e["step"] == 2 and e["group"] == 3),
        ({"dataset_row": 11, "reward_name": "numeric", "max_reward": 0.0},
         lambda e: e["dataset_row"] == 11 and e["numeric"] is not None and e["numeric"] <= 0),
    ]  # fmt: skip
    for params, keep in cases:
        got = _pages(client, run, limit=4, sort="-reward.numeric", **params)
        want = sorted(_position(e) for e in expected if keep(e))
        assert want and sorted(map(_position, got)) == want, params
    # a cursor belongs to its sort: another reward function's sort refuses it
    first = client.get(f"{API}/runs/{run}/samples", params={"sort": "reward.accuracy", "limit": 3}).json()
    other = client.get(f"{API}/runs/{run}/samples", params={"sort": "reward.numeric", "cursor": first["next_cursor"]})
    assert other.status_code == 400 and "sorted by reward.accuracy" in other.json()["detail"]


def test_unknown_reward_names_are_422_naming_the_parameter(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=_config()).json()["id"]
    _fill(app, run, steps=1)
    bad = client.get(f"{API}/runs/{run}/samples", params={"sort": "-reward.speed"})
    assert bad.status_code == 422
    [error] = bad.json()["detail"]
    assert error["path"] == "query.sort" and "'speed'" in error["message"] and "accuracy, numeric" in error["message"]
    bad = client.get(f"{API}/runs/{run}/samples", params={"reward_name": "nope", "min_reward": 1})
    assert bad.status_code == 422 and bad.json()["detail"][0]["path"] == "query.reward_name"
    bad = client.get(f"{API}/runs/{run}/samples", params={"min_reward": "high"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["path"] == "query.min_reward"
    for params in ({"dataset_row": -1}, {"group": "x"}, {"sort": "reward."}, {"sort": "reward.a\x01"}):
        bad = client.get(f"{API}/runs/{run}/samples", params=params)
        assert bad.status_code == 422, params
        assert bad.json()["detail"][0]["path"] == "query." + next(iter(params)), params


def test_columns_in_rows_and_every_export_format(api):
    import pyarrow.parquet as pq

    client, _, _, app = api
    run = client.post(API + "/runs", json=_config()).json()["id"]
    _fill(app, run, steps=1, groups=4, gens=2)
    rows = client.get(f"{API}/runs/{run}/samples", params={"group": 3, "limit": 10}).json()["items"]
    assert len(rows) == 2
    assert rows[0]["columns"] == {"answer": "3", "task": "count-red", "difficulty": 1.5, "hard": True,
                                  "note": "x" * COLUMN_TEXT_MAX + "…"}  # fmt: skip
    jsonl = client.get(f"{API}/runs/{run}/export", params={"what": "samples", "format": "jsonl"})
    records = [json.loads(line) for line in jsonl.text.splitlines()]
    assert len(records) == 8 and records[0]["columns"]["answer"] == "0" and records[0]["columns"]["hard"] is False
    table = list(csv.DictReader(io.StringIO(client.get(f"{API}/runs/{run}/export?what=samples&format=csv").text)))
    assert json.loads(table[-1]["columns"])["answer"] == "3"
    parquet = client.get(f"{API}/runs/{run}/export", params={"what": "samples", "format": "parquet"})
    frame = pq.read_table(io.BytesIO(parquet.content)).to_pylist()
    assert [json.loads(r["columns"])["answer"] for r in frame] == [str(g) for g in range(4) for _ in range(2)]


# -------------------------------------------------------------------------------------------- the page


@pytest.fixture(scope="module")
def seeded(server):
    """A finished run written straight into the server's store: 2 steps x 2 groups x 4 completions with known
    rewards per function, 3 images per row of group 0, and dataset columns."""
    from collage.app.db import make_engine
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
    page.wait_for_selector("#new-steps-bar:not([hidden])", timeout=180_000)  # rows arrived: announced, not pushed
    assert page.locator("tr.sample").count() == 0
    assert "new step" in page.inner_text("#new-steps")
    assert int(page.get_attribute('[name="step"]', "max")) >= 1  # the slider reaches the new steps
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
