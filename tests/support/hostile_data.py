"""Data that tries to get through the data door (issue 17), shared by the unit, training and process tests of it:
rows whose image paths leave the data roots, a folder outside them, PostScript posing as an image, decompression
bombs, and rows nested past any reader's limit."""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image

POSTSCRIPT = (
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n"
    b"(/etc/hostname) (r) file pop\nnewpath 0 0 moveto 8 8 lineto stroke\nshowpage\n%%EOF\n"
)


def hostile_png(colour=(200, 30, 30), size=(16, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A 60-byte PNG whose header announces ``width x height`` pixels: a decompression bomb's calling card."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00")) + chunk(b"IEND", b"")


def write_rows(file: Path, rows: list[dict]) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def outside_images(tmp_path_factory):
    """A folder outside every root, holding a real image, a PostScript file and a secret."""
    folder = tmp_path_factory.mktemp("outside")
    (folder / "file.png").write_bytes(hostile_png((1, 2, 3)))
    (folder / "x.jpg").write_bytes(hostile_png((4, 5, 6)))  # content decides the decoder, not the name
    (folder / "secret").mkdir()
    (folder / "secret" / "token.png").write_bytes(hostile_png((7, 8, 9)))
    return folder


def escaping_rows(root: Path, outside_images: Path) -> tuple[list[dict], list[str]]:
    """Rows (in ``root/data/train.jsonl``) that name outside files every way there is, and each one's counterpart
    naming a missing outside file: the refusals must read the same."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "ok.png").write_bytes(hostile_png())
    (data / "escape").symlink_to(outside_images)  # a link inside the root that points out
    (data / "link.png").symlink_to(outside_images / "file.png")
    up = os.path.relpath(outside_images, data)  # ../../outside0
    existing = [str(outside_images / "file.png"), f"{up}/x.jpg", "escape/file.png", "link.png",
                f"{data}/../../{outside_images.name}/secret/token.png"]  # fmt: skip
    missing = [str(outside_images / "nope.png"), f"{up}/nope.jpg", "escape/nope.png", "dangling.png",
               f"{data}/../../{outside_images.name}/secret/nope.png"]  # fmt: skip
    (data / "dangling.png").symlink_to(outside_images / "gone.png")
    rows = [{"prompt": "fine", "images": ["ok.png"]}]
    rows += [{"prompt": f"existing {k}", "images": [p]} for k, p in enumerate(existing)]
    rows += [{"prompt": f"missing {k}", "images": [p]} for k, p in enumerate(missing)]
    write_rows(data / "train.jsonl", rows)
    return rows, existing


def nested(levels: int):
    value: object = "bottom"
    for _ in range(levels):
        value = [value]
    return value
