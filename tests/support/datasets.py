"""Datasets the tests of several tiers build: images of known colours and a column-mapped JSONL split with one
corrupt image (bring your own data), a split with one bad row of each kind (data check), and large Parquet splits
of inline images (the count-red task, for the large-dataset tests)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

RED, GREY = (220, 30, 30), (200, 200, 200)
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220)}


def colour_png(colour: str, size: int = 28, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), COLOURS[colour]).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def mixed_dataset(folder: Path, corrupt: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for colour in COLOURS:
        (folder / f"{colour}.png").write_bytes(colour_png(colour, mode="RGBA" if colour == "green" else "RGB"))
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    rows = [
        {"question": f"q{i}", "image_1": f"{c}.png", "solution": c} for i, c in enumerate(["red", "green", "blue"] * 2)
    ]
    if corrupt:
        rows[3]["image_1"] = "corrupt.png"
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def mode_png(mode="RGB", size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def bad_dataset(tmp_path):
    (tmp_path / "ok.png").write_bytes(mode_png())
    (tmp_path / "gray.png").write_bytes(mode_png("L"))
    (tmp_path / "rgba.png").write_bytes(mode_png("RGBA"))
    (tmp_path / "broken.png").write_bytes(b"this is not a png")
    (tmp_path / "empty.png").write_bytes(b"")
    two_placeholders = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}
    ]
    rows = [
        {"prompt": "good", "images": ["ok.png", "ok.png"]},  # 0 fine
        {"prompt": two_placeholders, "images": ["ok.png"]},  # 1 placeholder/image count mismatch
        {"prompt": "where?", "images": ["missing.png"]},  # 2 missing file
        {"prompt": "what?", "images": ["broken.png"]},  # 3 unreadable
        {"prompt": "gray", "images": ["gray.png"]},  # 4 grayscale: converted as the processor does, fine
        {"prompt": "alpha", "images": ["ok.png", "rgba.png"]},  # 5 RGBA, second image: composited onto white, fine
        {"prompt": "void", "images": ["empty.png"]},  # 6 zero-size file
        {"prompt": {"text": "hi"}, "images": []},  # 7 not conversational
        {"prompt": [{"role": "robot", "content": "hi"}]},  # 8 not conversational (role)
        {"prompt": "text only row"},  # 9 fine
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    # 10: a malformed line is a bad row naming its file and line; 11: the rows after it are still read
    (tmp_path / "train.jsonl").write_text(text + '{"prompt": "cut off\n' + json.dumps({"prompt": "after"}) + "\n")
    return tmp_path


BAD_ROWS = {
    1: "prompt has 2 image placeholder(s) but the row has 1 image(s)",
    2: "image 0 file not found",
    3: "unreadable",
    6: "zero size",
    7: "prompt is not conversational",
    8: "role 'robot'",
    10: "train.jsonl line 11 is not valid JSON",
}


def scene(reds: int, seed: int, size: int = 28) -> bytes:
    """A PNG with ``reds`` red squares on grey (and a little noise, so images differ)."""
    rng = np.random.default_rng(seed)
    pixels = np.full((size, size, 3), GREY, dtype=np.uint8) + rng.integers(0, 8, (size, size, 3), dtype=np.uint8)
    for k in range(reds):
        x = 2 + 8 * k
        pixels[4:10, x : x + 6] = RED
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def write_parquet(path: Path, rows: int, group: int = 50, bad: tuple[int, ...] = (), noise_bytes: int = 0) -> Path:
    """``rows`` rows of one or two inline images each (the count-red task), in row groups of ``group``; the rows
    in ``bad`` carry bytes that are not an image. ``noise_bytes``: extra incompressible bytes in a side column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pool = [scene(1 + k % 3, k) for k in range(12)]
    rng = np.random.default_rng(0)
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    writer = None
    for lo in range(0, rows, group):
        hi = min(rows, lo + group)
        images, prompts, answers, noise = [], [], [], []
        for i in range(lo, hi):
            n = 1 + i % 2
            picks = [pool[(i * 7 + k) % len(pool)] for k in range(n)]
            if i in bad:
                picks[0] = b"\x89PNG\r\n\x1a\n not an image"
            images.append([{"bytes": b, "path": None} for b in picks])
            prompts.append(f"Row {i}: how many red squares are there in all?")
            answers.append(str(sum(1 + ((i * 7 + k) % len(pool)) % 3 for k in range(n))))
            noise.append(rng.bytes(noise_bytes) if noise_bytes else b"")
        table = pa.table(
            {
                "prompt": pa.array(prompts),
                "images": pa.array(images, type=pa.list_(image)),
                "answer": pa.array(answers),
                "noise": pa.array(noise, type=pa.binary()),
            }
        )
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema, use_dictionary=False, compression="none")
        writer.write_table(table, row_group_size=group)
    assert writer is not None
    writer.close()
    return path
