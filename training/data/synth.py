"""Synthetic multi-image tasks with verifiable answers, written in the same on-disk format users use.

Tasks (all but ``find-digit`` need more than one image to answer):

- ``count-red``: how many of the images show a red shape (answer: a number);
- ``odd-one-out``: all images show the same shape but one; which one (answer: its 1-based position);
- ``same-shape``: do images *i* and *j* show the same shape (answer: ``yes`` / ``no``);
- ``find-digit``: one large image (``FIND_DIGIT_SIZE`` pixels square, whatever ``size`` says) with distracting
  shapes and one small digit somewhere (answer: the digit; column ``region``: its box ``[x1, y1, x2, y2]`` in
  pixels, exclusive ends as in ``Image.crop``), for multi-turn rollouts with ``image_zoom_in`` (docs/tools-task.md).
  The only task with a single image: it needs one and has at most one.

With ``min_images = 0`` text-only rows (task ``arith``: a small sum) are mixed in, so training code meets mixed
batches. Output: ``<out>/train.jsonl`` (or ``train.parquet`` with image bytes inline) plus ``<out>/images/``,
one PNG per distinct image, named by its SHA-256. Same arguments and seed, same bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from collage.training.infra.errors import InputError
from collage.training.infra.home import cache_dir

from .rows import RawRow

COLORS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 50, 170),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle", "cross")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")


@dataclass(frozen=True)
class Drawing:
    shape: str
    color: str


def draw(d: Drawing, size: int, rng: random.Random) -> Image.Image:
    """One shape on a light background; position and size jitter so images of one kind still differ."""
    bg = tuple(rng.randint(225, 255) for _ in range(3))
    image = Image.new("RGB", (size, size), bg)
    pen = ImageDraw.Draw(image)
    r = rng.uniform(0.28, 0.4) * size
    cx = size / 2 + rng.uniform(-0.08, 0.08) * size
    cy = size / 2 + rng.uniform(-0.08, 0.08) * size
    fill = COLORS[d.color]
    if d.shape == "circle":
        pen.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif d.shape == "square":
        pen.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif d.shape == "triangle":
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        w = r / 3
        pen.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
        pen.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
    return image


@dataclass
class SynthRow:
    question: str
    drawings: list[Drawing]
    answer: str
    task: str
    extra: dict[str, Any]
    pictures: list[Image.Image] | None = None  # images the task drew itself (then ``drawings`` is empty)


def _count_red(n: int, rng: random.Random) -> SynthRow:
    reds = rng.randint(0, n)
    colors = ["red"] * reds + [rng.choice([c for c in COLORS if c != "red"]) for _ in range(n - reds)]
    rng.shuffle(colors)
    drawings = [Drawing(rng.choice(SHAPES), c) for c in colors]
    question = rng.choice(
        ["How many of the images are red?", "Count the images that show a red shape.", "How many red images?"]
    )
    return SynthRow(question + " Answer with a number.", drawings, str(reds), "count-red", {})


def _odd_one_out(n: int, rng: random.Random) -> SynthRow:
    common, odd = rng.sample(SHAPES, 2)
    color = rng.choice(list(COLORS))
    position = rng.randrange(n)
    drawings = [Drawing(odd if i == position else common, color) for i in range(n)]
    question = rng.choice(["Which image is the odd one out?", "One image differs from the others. Which one?"])
    return SynthRow(question + " Answer with its number.", drawings, str(position + 1), "odd-one-out", {})


def _same_shape(n: int, rng: random.Random) -> SynthRow:
    i, j = sorted(rng.sample(range(n), 2))
    drawings = [Drawing(rng.choice(SHAPES), rng.choice(list(COLORS))) for _ in range(n)]
    same = rng.random() < 0.5
    if same:
        drawings[j] = Drawing(drawings[i].shape, drawings[j].color)
    else:
        drawings[j] = Drawing(rng.choice([s for s in SHAPES if s != drawings[i].shape]), drawings[j].color)
    question = f"Do image {i + 1} and image {j + 1} show the same shape? Answer yes or no."
    return SynthRow(question, drawings, "yes" if same else "no", "same-shape", {"pair": [i + 1, j + 1]})


def _arith(rng: random.Random) -> SynthRow:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return SynthRow(f"What is {a} plus {b}? Answer with a number.", [], str(a + b), "arith", {})


FIND_DIGIT_SIZE = 640  # the side of a find-digit image in pixels
DIGIT_SCALE = 2  # pixels per cell of a 5x7 glyph: a 10x14-pixel digit
DIGIT_MARGIN = 8  # pixels around the digit no distracting shape enters
# 5x7 bitmaps of the ten digits (no font file: the same pixels on every machine)
GLYPHS: dict[str, tuple[str, ...]] = {
    "0": ("01110", "10001", "10011", "10101", "11001", "10001", "01110"),
    "1": ("00100", "01100", "00100", "00100", "00100", "00100", "01110"),
    "2": ("01110", "10001", "00001", "00010", "00100", "01000", "11111"),
    "3": ("11111", "00010", "00100", "00010", "00001", "10001", "01110"),
    "4": ("00010", "00110", "01010", "10010", "11111", "00010", "00010"),
    "5": ("11111", "10000", "11110", "00001", "00001", "10001", "01110"),
    "6": ("00110", "01000", "10000", "11110", "10001", "10001", "01110"),
    "7": ("11111", "00001", "00010", "00100", "01000", "01000", "01000"),
    "8": ("01110", "10001", "10001", "01110", "10001", "10001", "01110"),
    "9": ("01110", "10001", "10001", "01111", "00001", "00010", "01100"),
}


def draw_digit(pen: ImageDraw.ImageDraw, digit: str, x: int, y: int, fill: tuple[int, ...], scale: int) -> None:
    """Digit ``digit`` with its glyph's top-left cell at ``(x, y)``: 5 x 7 cells of ``scale`` pixels."""
    for row, bits in enumerate(GLYPHS[digit]):
        for col, bit in enumerate(bits):
            if bit == "1":
                left, top = x + col * scale, y + row * scale
                pen.rectangle([left, top, left + scale - 1, top + scale - 1], fill=fill)


def _overlaps(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _find_digit(n: int, rng: random.Random) -> SynthRow:  # n is always 1 (Task.max_needed)
    size, scale = FIND_DIGIT_SIZE, DIGIT_SCALE
    digit = str(rng.randrange(10))
    w, h = 5 * scale, 7 * scale
    x = rng.randint(2 * DIGIT_MARGIN, size - w - 2 * DIGIT_MARGIN)
    y = rng.randint(2 * DIGIT_MARGIN, size - h - 2 * DIGIT_MARGIN)
    region = [x, y, x + w, y + h]
    keep_out = (x - DIGIT_MARGIN, y - DIGIT_MARGIN, x + w + DIGIT_MARGIN, y + h + DIGIT_MARGIN)
    image = Image.new("RGB", (size, size), tuple(rng.randint(225, 255) for _ in range(3)))
    pen = ImageDraw.Draw(image)
    for _ in range(rng.randint(8, 16)):  # distracting shapes, never on the digit
        for _attempt in range(20):
            r = rng.randint(10, 45)
            cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
            box = (cx - r, cy - r, cx + r + 1, cy + r + 1)
            if not _overlaps(box, keep_out):
                break
        else:
            continue
        fill = COLORS[rng.choice(list(COLORS))]
        shape = rng.choice(SHAPES)
        if shape == "circle":
            pen.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        elif shape == "square":
            pen.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
        elif shape == "triangle":
            pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
        else:
            t = max(2, r // 3)
            pen.rectangle([cx - t, cy - r, cx + t, cy + r], fill=fill)
            pen.rectangle([cx - r, cy - t, cx + r, cy + t], fill=fill)
    ink = tuple(rng.randint(0, 60) for _ in range(3))
    draw_digit(pen, digit, x, y, ink, scale)
    question = (
        f"This image is {size}x{size} pixels. Somewhere in it, among coloured shapes, a small dark digit (0-9, "
        f"about {h} pixels tall) is written, hard to read in the whole image. Which digit is it? You may look closer "
        'with <tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [x1, y1, x2, y2], "image": 0}}'
        f"</tool_call>: bbox_2d is a box in the pixel coordinates of image 0 (x from the left, y from the top, "
        f"0 to {size}), and you are shown that region on its own. Answer with the digit inside <answer></answer>."
    )
    return SynthRow(question, [], digit, "find-digit", {"region": region}, pictures=[image])


@dataclass(frozen=True)
class Task:
    make: Callable[[int, random.Random], SynthRow]
    min_needed: int  # fewest images a row of this task can have (text-only rows aside)
    max_needed: int | None = None  # most images a row of this task can have (None: any number)


TASKS: dict[str, Task] = {
    "count-red": Task(_count_red, 1),
    "odd-one-out": Task(_odd_one_out, 3),
    "same-shape": Task(_same_shape, 2),
    "find-digit": Task(_find_digit, 1, max_needed=1),
}


class SynthError(InputError):
    pass


def _image_counts(task: Task, min_images: int, max_images: int) -> list[int]:
    if min_images < 0 or max_images < min_images:
        raise SynthError(f"need 0 <= min_images <= max_images, got min_images={min_images}, max_images={max_images}")
    if task.max_needed is not None and min_images > task.max_needed:
        raise SynthError(f"this task has at most {task.max_needed} images per row: lower min_images")
    top = max_images if task.max_needed is None else min(max_images, task.max_needed)
    counts = [n for n in range(max(min_images, task.min_needed), top + 1)]
    if min_images == 0:
        counts = [0, *counts]
    if not counts or counts == [0] and max_images > 0:
        raise SynthError(f"this task needs at least {task.min_needed} images per row: raise max_images")
    return counts


def _content(question: str, n: int, rng: random.Random) -> list[dict[str, Any]]:
    """Place the image placeholders in one of several layouts so models do not learn a single position."""
    image = {"type": "image"}
    if n == 0:
        return [{"type": "text", "text": question}]
    style = rng.randrange(4)
    if style == 0:  # images, then the question
        return [image] * n + [{"type": "text", "text": question}]
    if style == 1:  # the question, then the images
        return [{"type": "text", "text": question + "\n"}] + [image] * n
    if style == 2:  # labelled images
        parts: list[dict[str, Any]] = []
        for i in range(n):
            parts += [{"type": "text", "text": f"Image {i + 1}: "}, image, {"type": "text", "text": "\n"}]
        return parts + [{"type": "text", "text": question}]
    parts = [{"type": "text", "text": "Look at these images. "}]
    for i in range(n):
        parts += [image, {"type": "text", "text": f" (the {ORDINALS[i % len(ORDINALS)]} one) "}]
    return parts + [{"type": "text", "text": question}]


def generate(task_name: str, rows: int, min_images: int, max_images: int, seed: int, size: int = 56):
    """Yield ``(row_dict, images)`` pairs; ``row_dict['images']`` is filled in by the writer."""
    if task_name not in TASKS:
        raise SynthError(f"unknown synthetic task {task_name!r}: choose one of {', '.join(TASKS)}")
    task = TASKS[task_name]
    counts = _image_counts(task, min_images, max_images)
    rng = random.Random(f"{task_name}:{seed}")
    for _ in range(rows):
        n = rng.choice(counts)
        item = _arith(rng) if n == 0 else task.make(n, rng)
        images = item.pictures if item.pictures is not None else [draw(d, size, rng) for d in item.drawings]
        prompt = [{"role": "user", "content": _content(item.question, n, rng)}]
        row = {"prompt": prompt, "answer": item.answer, "task": item.task, **item.extra}
        row["shapes"] = [d.shape for d in item.drawings]
        row["colors"] = [d.color for d in item.drawings]
        yield row, images


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def encoded_rows(task: str, rows: int, min_images: int, max_images: int, seed: int, size: int = 56):
    """Yield ``(row_dict, pngs)``: each row of :func:`generate` with its images as the PNG bytes the writer
    stores. Row *k* is the same whatever ``rows`` is (one seeded stream), so the first rows of a big dataset can
    be made without the rest."""
    for row, images in generate(task, rows, min_images, max_images, seed, size):
        yield row, [_png(image) for image in images]


def synth_rows(
    task: str, limit: int, rows: int = 256, min_images: int = 0, max_images: int = 3, seed: int = 0
) -> tuple[list[RawRow], int]:
    """The first ``limit`` rows of the dataset :func:`cached_synth_dataset` would write, made in memory (images as
    their PNG bytes: the same bytes, hence the same SHA-256, as the written files), and its row count. A preview
    of a 100,000-row dataset costs its shown rows, not the dataset."""
    if rows < 1:
        raise SynthError(f"rows must be at least 1, got {rows}")
    made = []
    for index, (row, pngs) in enumerate(encoded_rows(task, min(limit, rows), min_images, max_images, seed)):
        row["images"] = pngs
        made.append(RawRow(index, row, None, ()))  # images inline: no path to read, none allowed
    return made, rows


def write_synth(
    task: str,
    out: str | Path,
    rows: int = 256,
    min_images: int = 0,
    max_images: int = 3,
    seed: int = 0,
    fmt: str = "jsonl",
    size: int = 56,
    split: str = "train",
) -> Path:
    """Write a synthetic split to ``out`` and return the data file."""
    if fmt not in ("jsonl", "parquet"):
        raise SynthError(f"unknown format {fmt!r}: use jsonl or parquet")
    if rows < 1:
        raise SynthError(f"rows must be at least 1, got {rows}")
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for row, pngs in encoded_rows(task, rows, min_images, max_images, seed, size):
        refs: list[Any] = []
        for data in pngs:
            name = f"images/{hashlib.sha256(data).hexdigest()}.png"
            (out / name).write_bytes(data)
            refs.append(name if fmt == "jsonl" else {"bytes": data, "path": name})
        row["images"] = refs
        records.append(row)
    if fmt == "jsonl":
        file = out / f"{split}.jsonl"
        with file.open("w", encoding="utf-8") as fh:
            for row in records:
                fh.write(json.dumps(row) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        file = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(records), file)
    return file


def _cache_name(task: str, rows: int, min_images: int, max_images: int, seed: int) -> str:
    return f"synth-{task}-r{rows}-i{min_images}-{max_images}-s{seed}"


# ``<finished name>.<pid>.<mkdtemp's 8 random characters>``: what cached_synth_dataset writes before its rename
# (the pid: whoever kills the writer removes what it left, :func:`remove_temp_folders_of`; older versions wrote no pid)
_TEMP_FOLDER = re.compile(r"^synth-[a-z0-9-]+-r\d+-i\d+-\d+-s-?\d+(\.(?P<pid>\d+))?\.[a-z0-9_]{8}$")


def cached_synth_dataset(task: str, rows: int = 256, min_images: int = 0, max_images: int = 3, seed: int = 0) -> Path:
    """The folder of a synthetic dataset under ``COLLAGE_HOME``, written once (atomically) on first use."""
    folder = cache_dir("datasets") / _cache_name(task, rows, min_images, max_images, seed)
    if (folder / "train.jsonl").is_file():
        return folder
    tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.{os.getpid()}.", dir=folder.parent))
    try:
        write_synth(task, tmp, rows=rows, min_images=min_images, max_images=max_images, seed=seed)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished the same dataset first
            if not (folder / "train.jsonl").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def clean_stale_temp_folders(max_age_seconds: float = 3600, root: Path | None = None) -> int:
    """Remove the temporary folders a crashed :func:`cached_synth_dataset` left in the dataset cache (``root``,
    default ``COLLAGE_HOME/cache/datasets``); returns how many. Only folders named like its temporary folders
    and untouched for ``max_age_seconds`` go: a finished dataset never matches the name, and a folder another
    process is still writing has fresh files (its ``images/`` folder changes with every image)."""
    root = cache_dir("datasets") if root is None else root
    now, removed = time.time(), 0
    for entry in root.iterdir() if root.is_dir() else []:
        if not _TEMP_FOLDER.match(entry.name) or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            touched = max(p.stat().st_mtime for p in [entry, *entry.iterdir()])
        except OSError:  # renamed or removed meanwhile by its writer or another cleaner
            continue
        if now - touched >= max_age_seconds:
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed += 1
    return removed


def remove_temp_folders_of(pid: int, root: Path) -> int:
    """Remove the temporary folders process ``pid`` was writing under ``root`` (a dataset cache folder); for the
    process that killed it (the web app kills a dataset helper that ran past its time). Returns how many."""
    removed = 0
    for entry in root.iterdir() if root.is_dir() else []:
        match = _TEMP_FOLDER.match(entry.name)
        if match is None or match["pid"] != str(pid) or entry.is_symlink() or not entry.is_dir():
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed += not entry.exists()
    return removed
