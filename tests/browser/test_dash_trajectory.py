"""Multi-turn rollouts with image tools on the rollouts page, in a real browser against a real `collage serve`: a
trajectory with two crops (the second a crop of the first) shows both, each beside the thumbnail it was cropped
from with the crop's box drawn where its bbox_2d says; a tool error shows; the tool filters hide the rows without
tool calls; the group view draws where each completion zoomed."""

from __future__ import annotations

import json

import pytest
from PIL import Image, ImageDraw

from collage.training.callbacks import RolloutImage, RolloutRow, TrajectoryTurn
from tests.support.browser import login, shoot, small_config, wait_js
from tests.support.serve import store_writer

SIZE = (200, 150)  # the row's own image (image 0)
BOX_A1 = [40, 30, 140, 105]  # completion 0's first crop, on image 0: 100 x 75
BOX_A2 = [10, 5, 60, 45]  # its second, on the first crop (image 1): 50 x 40
BOX_C = [120, 60, 190, 140]  # completion 2's crop, on image 0
ERROR = "bbox_2d [150, 100, 400, 300] is outside image 0 (200x150)"


def _pil(image: Image.Image) -> RolloutImage:
    return RolloutImage(None, None, image.width, image.height, image=image)


def _zoom(image: int, box: list[int]) -> dict:
    return {"name": "image_zoom_in", "arguments": {"image": image, "bbox_2d": box}}


@pytest.fixture(scope="module")
def seeded(server):
    """A finished run with one group of three completions of one prompt image: #0 zooms twice (the second crop of
    the first), #1 uses no tool, #2 zooms once and then makes a call the tool refuses. ``{run, ids}``: ids by
    completion index."""
    from collage.training.config import parse_config

    engine, writer = store_writer(server)
    run = writer.create_run(parse_config(small_config("rollouts-trajectory")).model_dump(mode="json"))
    writer.transition(run.id, ["queued", "running"], "succeeded")
    source = Image.new("RGB", SIZE, (235, 235, 235))
    draw = ImageDraw.Draw(source)
    draw.rectangle((60, 40, 120, 90), fill=(210, 30, 30))
    draw.rectangle((140, 80, 180, 130), fill=(30, 30, 210))
    crop_a1 = source.crop(tuple(BOX_A1))
    trajectories = [
        [TrajectoryTurn("assistant", "Zooming in on the red shape.", tool_call=_zoom(0, BOX_A1)),
         TrajectoryTurn("tool", "", images=[_pil(crop_a1)], sources=[{"image": 0, "bbox_2d": BOX_A1}]),
         TrajectoryTurn("assistant", "Closer.", tool_call=_zoom(1, BOX_A2)),
         TrajectoryTurn("tool", "", images=[_pil(crop_a1.crop(tuple(BOX_A2)))], sources=[{"image": 1, "bbox_2d": BOX_A2}]),
         TrajectoryTurn("assistant", "1")],
        [],
        [TrajectoryTurn("assistant", "The blue one.", tool_call=_zoom(0, BOX_C)),
         TrajectoryTurn("tool", "", images=[_pil(source.crop(tuple(BOX_C)))], sources=[{"image": 0, "bbox_2d": BOX_C}]),
         TrajectoryTurn("assistant", "Wider.", tool_call=_zoom(0, [150, 100, 400, 300])),
         TrajectoryTurn("tool", "", error=ERROR),
         TrajectoryTurn("assistant", "2")],
    ]  # fmt: skip
    rows = [
        RolloutRow(step=1, group=0, index=i, completion=t[-1].text if t else "1", images=[_pil(source)],
                   prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many red?"}]}],
                   rewards={"accuracy": [1.0, 0.5, 0.0][i]}, reward=[1.0, 0.5, 0.0][i], advantage=[1.0, 0.0, -1.0][i],
                   completion_length=3, truncated=False, row=0, group_mean=0.5, group_std=0.5, trajectory=t)
        for i, t in enumerate(trajectories)
    ]  # fmt: skip
    writer.append_samples(run.id, 1, rows)
    engine.dispose()
    items = server["client"].get(f"/runs/{run.id}/samples").json()["items"]
    return {"run": run.id, "ids": {s["index"]: str(s["id"]) for s in items}}


def _ids(page) -> list[str]:
    return page.eval_on_selector_all("tr.sample", "rows => rows.map(r => r.dataset.id)")


def _wait_ids(page, ids: list[str]) -> None:
    wait_js(
        page,
        f"JSON.stringify([...document.querySelectorAll('tr.sample')].map(r => r.dataset.id)) === '{json.dumps(ids, separators=(',', ':'))}'",
    )


def _box_on_thumb(frame) -> tuple[list[float], list[float]]:
    """The drawn box and the source thumbnail it sits on, each as [left, top, width, height] in CSS pixels."""
    box = frame.locator(".crop-box").bounding_box()
    thumb = frame.locator("img.source-thumb").bounding_box()
    return [box["x"], box["y"], box["width"], box["height"]], [thumb["x"], thumb["y"], thumb["width"], thumb["height"]]


def _expected(bbox: list[int], size: tuple[int, int], thumb: list[float]) -> list[float]:
    x1, y1, x2, y2 = bbox
    sx, sy = thumb[2] / size[0], thumb[3] / size[1]
    return [thumb[0] + x1 * sx, thumb[1] + y1 * sy, (x2 - x1) * sx, (y2 - y1) * sy]


def _loaded(page, selector: str) -> None:
    """Every image under ``selector`` has loaded (a box drawn on a thumbnail that is not there yet has no size)."""
    wait_js(page, f"[...document.querySelectorAll({selector!r} + ' img')].every(i => i.complete && i.naturalWidth > 0)"
                  f" && document.querySelectorAll({selector!r} + ' img').length > 0")  # fmt: skip


def test_each_crop_shows_beside_its_source_thumbnail_with_its_box_drawn_on_it(page, server, seeded):
    page.goto(f"{server['base']}/runs/{seeded['run']}/rollouts")
    wait_js(page, "document.querySelectorAll('tr.sample').length === 3")
    row = f'tr.sample[data-id="{seeded["ids"][0]}"]'
    assert page.inner_text(f"{row} details.trajectory > summary") == "trajectory: 5 turns · 2 tool calls"
    assert page.locator(f'tr.sample[data-id="{seeded["ids"][1]}"] details.trajectory').count() == 0  # no tools
    page.click(f"{row} details.trajectory > summary")
    page.wait_for_selector(f"{row} details.trajectory[open] figure.tool-image.crop")
    _loaded(page, f"{row} details.trajectory")
    turns = page.locator(f"{row} li.turn")
    assert turns.count() == 5
    assert turns.nth(0).locator(".tool-name").inner_text() == "image_zoom_in"
    assert turns.nth(0).locator(".tool-args").inner_text() == '{"image":0,"bbox_2d":[40,30,140,105]}'
    assert "Zooming in on the red shape." in turns.nth(0).inner_text()
    crops = page.locator(f"{row} figure.tool-image.crop")
    assert crops.count() == 2
    # the first crop is image 1 of the rollout, cut from image 0; the second is image 2, cut from image 1 (the first)
    assert crops.nth(0).get_attribute("data-image") == "1" and crops.nth(1).get_attribute("data-image") == "2"
    assert crops.nth(0).locator(".box-frame").get_attribute("data-image") == "0"
    assert crops.nth(1).locator(".box-frame").get_attribute("data-image") == "1"
    for crop, bbox, size, crop_size in [
        (crops.nth(0), BOX_A1, SIZE, (100, 75)),
        (crops.nth(1), BOX_A2, (100, 75), (50, 40)),
    ]:
        assert crop.locator("img.crop-thumb").evaluate("i => [i.naturalWidth, i.naturalHeight]") == list(crop_size)
        frame = crop.locator(".box-frame")
        assert frame.locator(".crop-box").count() == 1
        box, thumb = _box_on_thumb(frame)
        assert thumb[2] > 0 and abs(thumb[2] / thumb[3] - size[0] / size[1]) < 0.03  # the whole thumbnail, uncropped
        want = _expected(bbox, size, thumb)
        assert all(abs(a - b) <= 1.0 for a, b in zip(box, want, strict=True)), (bbox, box, want)
    assert "cropped from image 1 at [10, 5, 60, 45]" in crops.nth(1).inner_text()
    shoot(page, "rollouts-trajectory")
    # the tool's error: flagged on the row, and in its turn
    other = f'tr.sample[data-id="{seeded["ids"][2]}"]'
    assert page.inner_text(f"{other} .badge.tool-errors") == "1 tool error"
    page.click(f"{other} details.trajectory > summary")
    page.wait_for_selector(f"{other} details.trajectory[open] li.turn.has-error")
    assert page.inner_text(f"{other} li.turn.has-error .tool-error") == f"tool error: {ERROR}"
    assert not page.errors, page.errors


def test_filters_and_sorts_by_tool_calls_tool_errors_and_turns(page, server, seeded):
    ids = seeded["ids"]
    page.goto(f"{server['base']}/runs/{seeded['run']}/rollouts")
    wait_js(page, "document.querySelectorAll('tr.sample').length === 3")
    page.fill('[name="min_tool_calls"]', "1")
    wait_js(page, "location.search.includes('min_tool_calls=1') && document.querySelectorAll('tr.sample').length === 2")
    assert sorted(_ids(page)) == sorted([ids[0], ids[2]])  # the row without tool calls is gone
    page.select_option('[name="has_tool_error"]', "true")
    _wait_ids(page, [ids[2]])
    page.select_option('[name="has_tool_error"]', "")
    page.fill('[name="min_tool_calls"]', "")
    page.select_option('[name="sort"]', "-turns")
    want = [ids[2], ids[0], ids[1]]  # 5 turns each (ties by id, descending), then none
    _wait_ids(page, want)
    page.fill('[name="min_turns"]', "x")  # the API's message next to the field
    page.wait_for_selector('[data-error-for="min_turns"]:not(:empty)')
    assert page.locator('[name="min_turns"].invalid').count() == 1
    assert [e for e in page.errors if "status of 422" not in e] == [], page.errors


def test_the_group_view_shows_where_each_completion_zoomed(page, server, seeded):
    ids = seeded["ids"]
    page.goto(f"{server['base']}/runs/{seeded['run']}/rollouts?view=group:1:0")
    page.wait_for_selector("#group-view .zoom-map .box-frame")
    _loaded(page, "#group-view .zoom-map")
    frame = page.locator("#group-view .zoom-map .box-frame")
    assert frame.count() == 1  # the prompt's one image
    boxes = frame.locator(".crop-box")
    # crops of the prompt's image: completion 0's first (its second is of its own crop) and completion 2's
    assert boxes.count() == 2
    assert [boxes.nth(k).get_attribute("data-id") for k in range(2)] == [ids[0], ids[2]]
    assert [boxes.nth(k).inner_text() for k in range(2)] == ["#1", "#3"]  # ranked by reward: 1.0, 0.5, 0.0
    thumb = frame.locator("img.source-thumb").bounding_box()
    thumb_box = [thumb["x"], thumb["y"], thumb["width"], thumb["height"]]
    for k, bbox in enumerate([BOX_A1, BOX_C]):
        got = boxes.nth(k).bounding_box()
        want = _expected(bbox, SIZE, thumb_box)
        assert all(
            abs(a - b) <= 1.0 for a, b in zip([got["x"], got["y"], got["width"], got["height"]], want, strict=True)
        )
    # each completion's own trajectory is in its card
    cards = page.locator("#group-view .group-completion")
    assert cards.count() == 3 and cards.nth(0).locator("details.trajectory").count() == 1
    assert cards.nth(1).locator("details.trajectory").count() == 0
    shoot(page, "rollouts-group-zoom")
    assert not page.errors, page.errors


def test_an_open_trajectory_fits_a_390_px_screen(browser, server, seeded):
    context, page = login(browser, server, 390, 844)
    page.goto(f"{server['base']}/runs/{seeded['run']}/rollouts")
    wait_js(page, "document.querySelectorAll('tr.sample').length === 3")
    row = f'tr.sample[data-id="{seeded["ids"][0]}"]'
    page.click(f"{row} details.trajectory > summary")
    _loaded(page, f"{row} details.trajectory")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    box = page.evaluate(
        "(() => { const b = document.getElementById('table-box'); return [b.scrollWidth, b.clientWidth]; })()"
    )
    assert box[0] <= box[1], box  # nothing to scroll sideways to
    for part in page.locator(f"{row} figure.tool-image, {row} .tool-call").all():
        rect = part.bounding_box()
        assert rect["x"] >= 0 and rect["x"] + rect["width"] <= 390, rect
    page.locator(f"{row} figure.tool-image").first.scroll_into_view_if_needed()
    shoot(page, "rollouts-trajectory-390", full_page=False)
    assert not page.errors, page.errors
    context.close()
