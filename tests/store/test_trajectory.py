"""Multi-turn rollouts with image tools through the store, on SQLite and PostgreSQL: the trainer's ``RolloutRow`` with
a trajectory of two crops (the second a crop of the first) goes through the real writer; the API serves its turns
with fetchable crops and their source boxes, filters and sorts by tool calls, tool errors and turns, and the
exports carry the trajectory."""

from __future__ import annotations

import csv
import io
import json

import pytest
from PIL import Image, ImageDraw
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from collage.training.callbacks import RolloutImage, RolloutRow, TrajectoryTurn
from tests.support import API
from tests.support.api import config, count_rows

BOX_1 = [8, 4, 40, 28]  # on the row's own image (image 0)
BOX_2 = [4, 2, 20, 14]  # on the first crop (image 1: the first tool image of the rollout)


def _source() -> Image.Image:
    image = Image.new("RGB", (64, 48), (240, 240, 240))
    draw = ImageDraw.Draw(image)
    draw.rectangle((12, 8, 30, 20), fill=(200, 0, 0))
    draw.rectangle((44, 30, 60, 44), fill=(0, 0, 200))
    return image


def _pil(image: Image.Image) -> RolloutImage:
    return RolloutImage(None, None, image.width, image.height, image=image)


def _row(index: int, trajectory: list[TrajectoryTurn], source: Image.Image, completion: str) -> RolloutRow:
    return RolloutRow(
        step=1, group=0, index=index,
        prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many red shapes?"}]}],
        completion=completion, images=[_pil(source)], rewards={"accuracy": 1.0 - 0.5 * index},
        reward=1.0 - 0.5 * index, advantage=0.5 - 0.5 * index, completion_length=10 + index, truncated=False, row=3,
        trajectory=trajectory,
    )  # fmt: skip


def _rows():
    """Row 0: two crops (the second of the first), then a failed call, then the answer (7 turns, 3 calls, 1 error).
    Row 1: no tools. Row 2: one crop, the same as row 0's first (stored once), and a box that is not four numbers
    (its image is kept, without a box)."""
    source = _source()
    crop_1 = source.crop(tuple(BOX_1))
    crop_2 = crop_1.crop(tuple(BOX_2))
    call = lambda image, box: {"name": "image_zoom_in", "arguments": {"image": image, "bbox_2d": box}}  # noqa: E731
    zoomed = [
        TrajectoryTurn("assistant", "Let me zoom in on the left.", tool_call=call(0, BOX_1)),
        TrajectoryTurn("tool", "Zoomed in on image 0.", images=[_pil(crop_1)], sources=[{"image": 0, "bbox_2d": BOX_1}]),
        TrajectoryTurn("assistant", "Closer still.", tool_call=call(1, BOX_2)),
        TrajectoryTurn("tool", "Zoomed in on image 1.\x00", images=[_pil(crop_2)], sources=[{"image": 1, "bbox_2d": BOX_2}]),
        TrajectoryTurn("assistant", "And the corner.", tool_call=call(0, [60, 40, 90, 80])),
        TrajectoryTurn("tool", "", error="bbox_2d [60, 40, 90, 80] is outside image 0 (64x48)"),
        TrajectoryTurn("assistant", "One red shape: 1"),
    ]  # fmt: skip
    once = [
        TrajectoryTurn("assistant", "Zoom.", tool_call=call(0, BOX_1)),
        TrajectoryTurn("tool", "", images=[_pil(source.crop(tuple(BOX_1)))], sources=[{"image": 0, "bbox_2d": "left"}]),
        TrajectoryTurn("assistant", "2"),
    ]
    rows = [_row(0, zoomed, source, "One red shape: 1"), _row(1, [], source, "1"), _row(2, once, source, "2")]
    pngs = {"source": rows[0].images[0].png, "crop_1": zoomed[1].images[0].png, "crop_2": zoomed[3].images[0].png}
    return rows, pngs


def _items(client, run, **params):
    response = client.get(f"{API}/runs/{run}/samples", params=params)
    assert response.status_code == 200, response.text
    return response.json()["items"]


def test_a_trajectory_with_two_crops_is_stored_and_served_with_its_images_and_boxes(api):
    client, _, _, app = api
    from collage.app.store.tables import Image as ImageRow
    from collage.app.store.tables import SampleToolImage

    run = client.post(API + "/runs", json=config()).json()["id"]
    rows, pngs = _rows()
    assert app.state.writer.append_samples(run, 1, rows) == 3
    # the row's image and the two distinct crops, each once (row 2's crop is row 0's first), files and rows alike
    assert count_rows(app, ImageRow) == 3
    assert len(list((app.state.settings.artifacts / "images").rglob("*.png"))) == 3
    items = {s["index"]: s for s in _items(client, run)}
    zoomed, plain, once = items[0], items[1], items[2]
    assert (zoomed["tool_calls"], zoomed["tool_errors"], zoomed["turns"]) == (3, 1, 7)
    assert (plain["tool_calls"], plain["tool_errors"], plain["turns"], plain["trajectory"]) == (0, 0, 0, [])
    assert (once["tool_calls"], once["tool_errors"], once["turns"]) == (1, 0, 3)
    assert zoomed["completion"] == "One red shape: 1" and len(zoomed["images"]) == 1
    turns = zoomed["trajectory"]
    assert [t["role"] for t in turns] == ["assistant", "tool"] * 3 + ["assistant"]
    assert turns[0]["tool_call"] == {"name": "image_zoom_in", "arguments": {"image": 0, "bbox_2d": BOX_1}}
    assert turns[2]["tool_call"]["arguments"]["bbox_2d"] == BOX_2 and turns[6]["tool_call"] is None
    assert turns[3]["text"] == "Zoomed in on image 1.\ufffd"  # a NUL is stored as U+FFFD, as in every rollout text
    assert turns[5]["error"] == "bbox_2d [60, 40, 90, 80] is outside image 0 (64x48)" and turns[5]["images"] == []
    assert [t["error"] for t in turns if t["error"] is not None] == [turns[5]["error"]]
    (crop_1,), (crop_2,) = turns[1]["images"], turns[3]["images"]
    assert (crop_1["width"], crop_1["height"]) == (32, 24) and (crop_2["width"], crop_2["height"]) == (16, 12)
    assert crop_1["source"] == {"image": 0, "bbox_2d": BOX_1} and crop_2["source"] == {"image": 1, "bbox_2d": BOX_2}
    # the images by the same URL scheme as the row's own, returning each crop's own bytes
    for image, name in [(crop_1, "crop_1"), (crop_2, "crop_2"), (zoomed["images"][0], "source")]:
        assert image["url"] == f"{API}/images/{image['sha256']}?size=full"
        response = client.get(image["url"])
        assert response.status_code == 200 and response.content == pngs[name], name
        assert client.get(image["thumb_url"]).status_code == 200
    cropped = Image.open(io.BytesIO(client.get(crop_2["url"]).content)).convert("RGB")
    assert cropped.getpixel((2, 2)) == (200, 0, 0)  # (14, 8) of the source: inside its red rectangle
    # a box that is not four numbers: the image stays, without a source
    assert once["trajectory"][1]["images"][0]["sha256"] == crop_1["sha256"]
    assert once["trajectory"][1]["images"][0]["source"] is None
    # each tool image is referenced from its row (a foreign key, as the row's own images are), numbered over the
    # rollout: an image a row still names can never be deleted
    with Session(app.state.engine) as session:
        links = session.execute(select(SampleToolImage.sample_id, SampleToolImage.position, SampleToolImage.sha256)
                                .order_by(SampleToolImage.sample_id, SampleToolImage.position)).all()  # fmt: skip
    assert [(sid, pos, sha) for sid, pos, sha in links] == [
        (zoomed["id"], 1, crop_1["sha256"]), (zoomed["id"], 2, crop_2["sha256"]), (once["id"], 1, crop_1["sha256"])
    ]  # fmt: skip
    with pytest.raises(IntegrityError), Session(app.state.engine) as session, session.begin():
        session.execute(delete(ImageRow).where(ImageRow.sha256 == crop_2["sha256"]))
    app.state.writer.append_samples(run, 1, rows)  # a redelivered step replaces its rows, images stay once
    assert count_rows(app, ImageRow) == 3 and len(_items(client, run)) == 3 and count_rows(app, SampleToolImage) == 3
    # a resumed attempt that rewrites the step drops the old rows' links with them; the crop is free to go
    app.state.writer.begin_attempt(run, 0, 5)
    assert count_rows(app, SampleToolImage) == 0
    with Session(app.state.engine) as session, session.begin():
        session.execute(delete(ImageRow).where(ImageRow.sha256 == crop_2["sha256"]))


@pytest.mark.parametrize(
    "params,indexes",
    [
        ({"min_tool_calls": 1}, [0, 2]),
        ({"min_tool_calls": 2}, [0]),
        ({"max_tool_calls": 0}, [1]),
        ({"min_tool_calls": 1, "max_tool_calls": 1}, [2]),
        ({"has_tool_error": "true"}, [0]),
        ({"has_tool_error": "false"}, [1, 2]),
        ({"min_turns": 3}, [0, 2]),
        ({"max_turns": 3}, [1, 2]),
        ({"min_turns": 4, "has_tool_error": "false"}, []),
    ],
)
def test_filters_by_tool_calls_tool_errors_and_turns(api, params, indexes):
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    app.state.writer.append_samples(run, 1, _rows()[0])
    assert sorted(s["index"] for s in _items(client, run, **params)) == indexes
    count = client.get(f"{API}/runs/{run}/samples/count", params=params).json()
    assert count["count"] == len(indexes) and count["capped"] is False


def test_sorts_by_tool_calls_tool_errors_and_turns_page_through_every_row(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    app.state.writer.append_samples(run, 1, _rows()[0])
    for sort, want in [("-tool_calls", [0, 2, 1]), ("tool_calls", [1, 2, 0]), ("-turns", [0, 2, 1]),
                       ("turns", [1, 2, 0]), ("-tool_errors", [0, 2, 1]), ("tool_errors", [1, 2, 0])]:  # fmt: skip
        # ties (rows 1 and 2 have no tool error) go by id, in the sort's direction
        got, cursor = [], None
        while True:  # one row a page: the keyset cursor of each sort
            page = client.get(f"{API}/runs/{run}/samples", params={"sort": sort, "limit": 1,
                                                                     **({"cursor": cursor} if cursor else {})})  # fmt: skip
            assert page.status_code == 200, page.text
            got += [s["index"] for s in page.json()["items"]]
            if (cursor := page.json()["next_cursor"]) is None:
                break
        assert got == want, sort
    for bad in ({"min_tool_calls": -1}, {"has_tool_error": "maybe"}, {"max_turns": "x"}, {"sort": "tool_call"}):
        response = client.get(f"{API}/runs/{run}/samples", params=bad)
        assert response.status_code == 422, bad
        assert response.json()["detail"][0]["path"] == f"query.{next(iter(bad))}"


def test_exports_carry_the_trajectory(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    app.state.writer.append_samples(run, 1, _rows()[0])
    served = {s["index"]: s for s in _items(client, run)}
    jsonl = client.get(f"{API}/runs/{run}/export", params={"what": "samples", "format": "jsonl"})
    exported = {r["index"]: r for r in map(json.loads, jsonl.text.splitlines())}
    assert exported[1]["trajectory"] == [] and exported[1]["tool_calls"] == 0
    turns = exported[0]["trajectory"]
    assert (exported[0]["tool_calls"], exported[0]["tool_errors"], exported[0]["turns"]) == (3, 1, 7)
    assert len(turns) == 7 and turns[5]["error"] == served[0]["trajectory"][5]["error"]
    # images by SHA-256, as the row's own images are in an export, with their size and source
    assert turns[3]["images"] == [
        {k: v for k, v in image.items() if k not in ("url", "thumb_url")}
        for image in served[0]["trajectory"][3]["images"]
    ]
    assert turns[3]["images"][0]["source"] == {"image": 1, "bbox_2d": BOX_2}
    assert "tool_call" not in turns[6] and turns[0]["tool_call"]["name"] == "image_zoom_in"
    table = {int(r["index"]): r for r in csv.DictReader(io.StringIO(
        client.get(f"{API}/runs/{run}/export", params={"format": "csv"}).text))}  # fmt: skip
    assert json.loads(table[0]["trajectory"]) == turns and table[0]["tool_errors"] == "1"
    import pyarrow.parquet as pq

    parquet = pq.read_table(io.BytesIO(client.get(f"{API}/runs/{run}/export", params={"format": "parquet"}).content))
    records = {r["index"]: r for r in parquet.to_pylist()}
    assert json.loads(records[0]["trajectory"]) == turns and records[0]["turns"] == 7
    assert json.loads(records[1]["trajectory"]) == []
