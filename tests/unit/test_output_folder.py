"""The output folder's ``samples.jsonl`` (contract section 4) carries a multi-turn rollout's trajectory, its tool
images written to ``images/`` once by hash like the row's own."""

from __future__ import annotations

import hashlib
import json

from PIL import Image

from collage.training.callbacks import RolloutImage, RolloutRow, TrajectoryTurn
from collage.training.config import parse_config
from collage.training.output import OutputFolder


def _pil(image: Image.Image) -> RolloutImage:
    return RolloutImage(None, None, image.width, image.height, image=image)


def test_samples_jsonl_carries_the_trajectory_and_its_crops(tmp_path):
    source = Image.new("RGB", (64, 48), (10, 200, 10))
    crop_1 = source.crop((8, 4, 40, 28))
    crop_2 = crop_1.crop((4, 2, 20, 14))
    call = {"name": "image_zoom_in", "arguments": {"image": 0, "bbox_2d": [8, 4, 40, 28]}}
    trajectory = [
        TrajectoryTurn("assistant", "zoom", tool_call=call),
        TrajectoryTurn("tool", "", images=[_pil(crop_1)], sources=[{"image": 0, "bbox_2d": [8, 4, 40, 28]}]),
        TrajectoryTurn("assistant", "closer", tool_call={"name": "image_zoom_in", "arguments": {"image": 1}}),
        TrajectoryTurn("tool", "", images=[_pil(crop_2)], sources=[{"image": 1, "bbox_2d": [4, 2, 20, 14]}]),
        TrajectoryTurn("assistant", "bad", tool_call={"name": "image_zoom_in", "arguments": {}}),
        TrajectoryTurn("tool", "", error="missing bbox_2d"),
        TrajectoryTurn("assistant", "3"),
    ]
    rows = [
        RolloutRow(step=1, group=0, index=i, prompt="p", completion="3", images=[_pil(source)], rewards={"a": 1.0},
                   reward=1.0, advantage=0.0, completion_length=1, truncated=False, row=0,
                   trajectory=trajectory if i == 0 else [])
        for i in range(2)
    ]  # fmt: skip
    folder = OutputFolder(tmp_path)
    folder.on_start(parse_config({}), 0)
    folder.on_samples(1, rows)
    folder.on_end("succeeded")
    written = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["trajectory"] == [] for r in written] == [False, True]
    turns = written[0]["trajectory"]
    assert [t["role"] for t in turns] == ["assistant", "tool"] * 3 + ["assistant"]
    assert turns[0]["tool_call"] == call and "tool_call" not in turns[6] and turns[5]["error"] == "missing bbox_2d"
    assert written[0]["completion"] == "3" and len(written[0]["images"]) == 1
    (first,), (second,) = turns[1]["images"], turns[3]["images"]
    assert (first["width"], first["height"], first["source"]) == (32, 24, {"image": 0, "bbox_2d": [8, 4, 40, 28]})
    assert (second["width"], second["height"], second["source"]["image"]) == (16, 12, 1)
    # every image of the rows by its hash, once: the row's image and the two crops
    files = {p.name: p.read_bytes() for p in (tmp_path / "images").glob("*.png")}
    assert set(files) == {f"{im['sha256']}.png" for im in [written[0]["images"][0], first, second]}
    assert all(hashlib.sha256(data).hexdigest() == name[:-4] for name, data in files.items())
    assert Image.open(tmp_path / "images" / f"{second['sha256']}.png").size == (16, 12)
