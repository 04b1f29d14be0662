"""The find-digit synthetic task: one large image, one small digit, and a ``region`` that really holds it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from collage.training.data.loader import load_dataset
from collage.training.data.synth import (
    DIGIT_SCALE,
    FIND_DIGIT_SIZE,
    GLYPHS,
    TASKS,
    SynthError,
    generate,
    synth_rows,
    write_synth,
)


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(folder.rglob("*")):
        if file.is_file():
            h.update(file.relative_to(folder).as_posix().encode())
            h.update(file.read_bytes())
    return h.hexdigest()


def _ink(image: Image.Image) -> np.ndarray:
    """Where the digit's dark ink is: every channel at most 60 (no distracting colour is that dark)."""
    return (np.asarray(image.convert("RGB")) <= 60).all(axis=2)


def _read_digit(crop: Image.Image) -> str | None:
    """The digit a crop shows, read back cell by cell against the 5x7 glyphs (None: no glyph matches)."""
    ys, xs = np.nonzero(_ink(crop))
    if len(xs) == 0:
        return None
    left, top = xs.min(), ys.min()
    cells = _ink(crop)
    matches = []
    for digit, rows in GLYPHS.items():
        # a glyph's first inked column or row need not be its cell 0: try each offset its bitmap allows
        first_col = min(r.index("1") for r in rows if "1" in r)
        first_row = next(i for i, r in enumerate(rows) if "1" in r)
        x0, y0 = left - first_col * DIGIT_SCALE, top - first_row * DIGIT_SCALE
        if x0 < 0 or y0 < 0:
            continue
        want = np.zeros_like(cells)
        for i, bits in enumerate(rows):
            for j, bit in enumerate(bits):
                if bit == "1":
                    y, x = y0 + i * DIGIT_SCALE, x0 + j * DIGIT_SCALE
                    want[y : y + DIGIT_SCALE, x : x + DIGIT_SCALE] = True
        if (want == cells).all():
            matches.append(digit)
    return matches[0] if len(matches) == 1 else None


def test_find_digit_is_a_registered_one_image_task():
    assert TASKS["find-digit"].min_needed == 1 and TASKS["find-digit"].max_needed == 1


def test_find_digit_is_deterministic_for_a_seed(tmp_path):
    write_synth("find-digit", tmp_path / "a", rows=6, min_images=1, max_images=1, seed=3)
    write_synth("find-digit", tmp_path / "b", rows=6, min_images=1, max_images=1, seed=3)
    write_synth("find-digit", tmp_path / "c", rows=6, min_images=1, max_images=1, seed=4)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert _digest(tmp_path / "a") != _digest(tmp_path / "c")
    # the in-memory preview holds the very bytes the written dataset does
    made, _ = synth_rows("find-digit", 3, rows=6, min_images=1, max_images=1, seed=3)
    for raw in made:
        (png,) = raw.data["images"]
        assert (tmp_path / "a" / "images" / f"{hashlib.sha256(png).hexdigest()}.png").is_file()


def test_the_region_holds_the_digit_and_only_the_region_does(tmp_path):
    write_synth("find-digit", tmp_path, rows=40, min_images=1, max_images=1, seed=0)
    samples = load_dataset(str(tmp_path)).load_all()
    assert len(samples) == 40
    for sample in samples:
        (image,) = sample.images
        assert image.size == (FIND_DIGIT_SIZE, FIND_DIGIT_SIZE)
        x1, y1, x2, y2 = region = sample.columns["region"]
        assert all(isinstance(v, int) for v in region) and 0 <= x1 < x2 <= FIND_DIGIT_SIZE and 0 <= y1 < y2
        assert (x2 - x1, y2 - y1) == (5 * DIGIT_SCALE, 7 * DIGIT_SCALE)  # 10x14 pixels: small in 640x640
        ink = _ink(image)
        inside = np.zeros_like(ink)
        inside[y1:y2, x1:x2] = True
        assert ink[inside].any()  # the crop is not background only
        assert not ink[~inside].any()  # every pixel of the digit lies inside the region
        crop = image.crop(tuple(region))
        assert len(np.unique(np.asarray(crop).reshape(-1, 3), axis=0)) >= 2
        # read back from the crop alone, and from a looser crop such as a model's zoom: the digit is the answer
        assert _read_digit(crop) == sample.columns["answer"]
        side = FIND_DIGIT_SIZE
        loose = image.crop((max(0, x1 - 30), max(0, y1 - 30), min(side, x2 + 30), min(side, y2 + 30)))
        assert _read_digit(loose) == sample.columns["answer"]


def test_answers_are_single_digits_and_all_ten_occur():
    rows = [row for row, _ in generate("find-digit", 120, 1, 1, seed=1)]
    assert {row["answer"] for row in rows} == {str(d) for d in range(10)}
    for row in rows:
        assert row["task"] == "find-digit" and len(row["region"]) == 4
        text = " ".join(p.get("text", "") for p in row["prompt"][0]["content"])
        assert f"{FIND_DIGIT_SIZE}x{FIND_DIGIT_SIZE}" in text and "image_zoom_in" in text and "bbox_2d" in text
        assert "<answer></answer>" in text
        assert [p["type"] for p in row["prompt"][0]["content"]].count("image") == 1


def test_image_counts_clip_to_one_and_text_only_rows_mix_in():
    rows = list(generate("find-digit", 60, 0, 4, seed=2))  # max_images above 1: still one image per row
    counts = {len(images) for _, images in rows}
    assert counts == {0, 1}
    assert all("region" not in row and row["task"] == "arith" for row, images in rows if not images)
    with pytest.raises(SynthError, match="at most 1 images"):
        list(generate("find-digit", 2, 2, 3, seed=0))


def test_the_digit_is_tiny_next_to_the_image():
    """What makes zooming worth it: shrunk to a 224-pixel view (a common fixed encoder size), the digit's box is
    under 5 pixels tall, too few for its 7 rows of strokes; a 4x enlarged crop of the region is 56 pixels tall."""
    (row, (image,)), *_ = generate("find-digit", 1, 1, 1, seed=0)
    x1, y1, x2, y2 = row["region"]
    assert (y2 - y1) * 224 / image.height < 5
    crop = image.crop((x1, y1, x2, y2)).resize(((x2 - x1) * 4, (y2 - y1) * 4), Image.Resampling.NEAREST)
    assert crop.height == 56
