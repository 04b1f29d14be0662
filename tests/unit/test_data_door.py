"""The data door (issue 17) in the loader on real files: image paths inside dataset rows stay under the operator's data
roots (home-relative and Hub-style paths too), images open only in raster formats (PostScript and decompression
bombs are row errors), Hub-style datasets never decode images themselves, and previews and limited loads are
bounded in work and in output."""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from collage.training.data.check import check_dataset, dataset_fingerprint
from collage.training.data.display import bounded
from collage.training.data.errors import DatasetError, RowError
from collage.training.data.loader import load_dataset
from collage.training.infra.home import cache_dir
from collage.training.infra.images import RASTER_FORMATS, decode_raster
from tests.support.hostile_data import (
    POSTSCRIPT,
    bomb_png,
    escaping_rows,
    hostile_png,
    nested,
    write_rows,
)


def test_image_paths_outside_the_roots_are_refused_alike_whether_they_exist_or_not(tmp_path, outside_images):
    rows, existing = escaping_rows(tmp_path, outside_images)
    dataset = load_dataset(str(tmp_path / "data"), data_roots=[tmp_path])
    results = list(dataset.samples())
    assert not isinstance(results[0], RowError) and results[0].images[0].size == (16, 16)
    errors = results[1:]
    assert all(isinstance(e, RowError) for e in errors), errors
    messages = {e.message for e in errors}
    assert len(messages) == 1, messages  # existing, missing, link, dangling link, ..: one text
    (message,) = messages
    assert message.startswith("image 0 is outside the folders datasets may be read from")
    assert "COLLAGE_DATA_ROOTS" in message and str(outside_images) not in message
    # unconfined (the operator's own CLI without COLLAGE_DATA_ROOTS), the same rows read as before
    unconfined = list(load_dataset(str(tmp_path / "data")).samples())
    assert [isinstance(r, RowError) for r in unconfined[1 : 1 + len(existing)]] == [False] * len(existing)


def test_home_relative_and_hub_style_relative_paths_are_confined_too(tmp_path, outside_images, monkeypatch):
    monkeypatch.setenv("HOME", str(outside_images))
    write_rows(tmp_path / "train.jsonl", [{"prompt": "tilde", "images": ["~/file.png"]}])
    (error,) = load_dataset(str(tmp_path), data_roots=[tmp_path]).samples()
    assert isinstance(error, RowError) and "outside the folders" in error.message
    # rows without a folder of their own (a hub dataset): a relative path has nothing to be relative to
    from collage.training.data.rows import RawRow

    row = RawRow(0, {"prompt": "x", "images": ["file.png"]}, None, (tmp_path.resolve(),))
    with pytest.raises(RowError, match="outside the folders"):
        row.to_sample()


def test_the_check_cache_never_looks_at_outside_paths_and_knows_the_roots(tmp_path, outside_images, monkeypatch):
    from collage.training.data import check

    monkeypatch.setenv("COLLAGE_HOME", str(tmp_path / "home"))
    escaping_rows(tmp_path, outside_images)
    stated: list[Path] = []
    real = check._stat
    monkeypatch.setattr(check, "_stat", lambda path, content: stated.append(Path(path)) or real(path, content))
    confined = load_dataset(str(tmp_path / "data"), data_roots=[tmp_path])
    assert dataset_fingerprint(confined, None, None) is not None
    looked_outside = [p for p in stated if not p.resolve().is_relative_to(tmp_path.resolve())]
    assert looked_outside == [] and stated  # the data file and ok.png only
    # the report of an unconfined check is not reused for a confined one
    loose = check_dataset(str(tmp_path / "data"))
    strict = check_dataset(str(tmp_path / "data"), data_roots=[tmp_path])
    assert len(strict.errors) > len(loose.errors)
    assert all("outside the folders" in e.message for e in strict.errors)


def test_synthetic_datasets_stay_readable_under_any_roots(tmp_path, monkeypatch):
    monkeypatch.setenv("COLLAGE_HOME", str(tmp_path / "home"))
    elsewhere = tmp_path / "datasets"
    elsewhere.mkdir()
    dataset = load_dataset("synth:count-red", data_roots=[elsewhere], rows=6, min_images=1, max_images=2)
    assert len(dataset.load_all()) == 6


def _saved_with_image_feature(folder: Path, records: dict) -> Path:
    """A save_to_disk folder whose ``images`` column is a list of ``datasets.Image`` with the given ``{bytes,
    path}`` values stored as they are (``save_to_disk`` would embed a path's bytes on the author's machine; an
    attacker writes the files directly, as here)."""
    import datasets

    struct = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}
    plain = datasets.Features({"prompt": datasets.Value("string"), "images": datasets.List(struct)})
    datasets.Dataset.from_dict(records, features=plain).save_to_disk(str(folder))
    info = json.loads((folder / "dataset_info.json").read_text())
    images = datasets.Features({"prompt": datasets.Value("string"), "images": datasets.List(datasets.Image())})
    info["features"] = images.to_dict()
    (folder / "dataset_info.json").write_text(json.dumps(info))
    assert isinstance(datasets.load_from_disk(str(folder)).features["images"].feature, datasets.Image)
    return folder


def test_hub_style_datasets_never_decode_images_themselves(tmp_path, outside_images):
    """A save_to_disk dataset with an Image feature: ``datasets`` would open the stored path (any path, any
    format); Collage reads the column undecoded and opens it confined and raster-only."""
    (tmp_path / "x.eps").write_bytes(POSTSCRIPT)  # inside the root; the row names it relative to the saved folder
    records = {
        "prompt": ["inline", "outside", "missing outside", "postscript bytes", "postscript path"],
        "images": [
            [{"bytes": hostile_png(), "path": None}],
            [{"bytes": None, "path": str(outside_images / "file.png")}],
            [{"bytes": None, "path": str(outside_images / "nope.png")}],
            [{"bytes": POSTSCRIPT, "path": "y.eps"}],
            [{"bytes": None, "path": "../x.eps"}],
        ],
    }
    saved = _saved_with_image_feature(tmp_path / "saved", records)
    inline, out, missing, ps_bytes, ps_path = load_dataset(str(saved), data_roots=[tmp_path]).samples()
    assert not isinstance(inline, RowError) and inline.images[0].size == (16, 16)
    assert isinstance(out, RowError) and isinstance(missing, RowError)
    assert out.message == missing.message and "outside the folders" in out.message
    for error in (ps_bytes, ps_path):
        assert isinstance(error, RowError) and "not a PNG, JPEG, WebP, GIF, BMP or TIFF image" in error.message


def _raster(fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image = Image.new("RGB", (12, 10), (10, 120, 240))
    if fmt == "MPO":
        image.save(buf, "MPO", save_all=True, append_images=[Image.new("RGB", (12, 10))])
    else:
        image.save(buf, fmt, **options)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF"])
def test_raster_formats_open(fmt):
    image = decode_raster(_raster(fmt))
    assert image.format == fmt and image.size == (12, 10)
    assert fmt in RASTER_FORMATS or fmt == "MPO"  # MPO comes through the JPEG decoder


@pytest.mark.parametrize("name", ["x.eps", "y.png"])
def test_postscript_is_refused_in_process(tmp_path, name):
    (tmp_path / name).write_bytes(POSTSCRIPT)
    write_rows(tmp_path / "train.jsonl", [{"prompt": "ps", "images": [name]}])
    (error,) = load_dataset(str(tmp_path)).samples()
    assert isinstance(error, RowError)
    assert error.message == (
        f"image 0 ({tmp_path / name}) is unreadable: not a PNG, JPEG, WebP, GIF, BMP or TIFF image "
        "(Collage opens only these raster formats)"
    )


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow's own, before Collage's refusal
def test_decompression_bombs_are_a_row_error(tmp_path, monkeypatch):
    (tmp_path / "bomb.png").write_bytes(bomb_png())  # 10^10 pixels announced: Pillow's DecompressionBombError
    (tmp_path / "big.png").write_bytes(hostile_png(size=(60, 60)))  # over a lowered limit, under twice it: a warning
    rows = [{"prompt": "bomb", "images": ["bomb.png"]}, {"prompt": "big", "images": ["big.png"]}]
    write_rows(tmp_path / "train.jsonl", rows)
    bomb, _ = load_dataset(str(tmp_path)).samples()
    assert isinstance(bomb, RowError) and "image 0 (" in bomb.message and "too large to decode" in bomb.message
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)
    _, big = load_dataset(str(tmp_path)).samples()
    assert isinstance(big, RowError) and "is 60x60 pixels, more than the 2000 Collage decodes" in big.message


def test_a_synth_preview_generates_only_its_rows_with_the_datasets_content(tmp_path, monkeypatch):
    from collage.app.datasets.process import preview_rows

    monkeypatch.setenv("COLLAGE_HOME", str(tmp_path / "home"))
    options = {"rows": 40, "min_images": 0, "max_images": 4, "seed": 5}
    shown = load_dataset("synth:same-shape", limit=6, **options)
    assert len(shown) == 6 and shown.total == 40
    assert not any(cache_dir("datasets").iterdir()), "a preview writes no dataset"
    full = load_dataset("synth:same-shape", **options)
    for mine, theirs in zip(shown.rows, full.rows[:6], strict=True):
        assert {k: v for k, v in mine.data.items() if k != "images"} == {
            k: v for k, v in theirs.data.items() if k != "images"
        }
        assert [hashlib.sha256(b).hexdigest() for b in mine.data["images"]] == [
            Path(name).stem for name in theirs.data["images"]
        ]
    assert preview_rows(shown, 6, tmp_path / "a") == preview_rows(full, 6, tmp_path / "b")


def test_a_limited_load_parses_only_its_rows_and_counts_the_rest(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = [json.dumps({"prompt": f"p{k}"}) for k in range(7)]
    (tmp_path / "j").mkdir()
    # blank lines are no rows; the last line has no newline; a bad line after the shown rows is only counted
    (tmp_path / "j" / "train.jsonl").write_text("\n".join(lines[:3]) + "\n\n  \n{not json\n" + "\n".join(lines[3:]))
    shown = load_dataset(str(tmp_path / "j"), limit=2)
    assert [r.data["prompt"] for r in shown.rows] == ["p0", "p1"] and shown.total == 8
    assert load_dataset(str(tmp_path / "j"), limit=3).total == 8
    pq.write_table(pa.Table.from_pylist([{"prompt": f"q{k}"} for k in range(2500)]), tmp_path / "t.parquet")
    parquet = load_dataset(str(tmp_path / "t.parquet"), limit=4)
    assert [r.data["prompt"] for r in parquet.rows] == ["q0", "q1", "q2", "q3"] and parquet.total == 2500
    assert (
        len(load_dataset(str(tmp_path / "t.parquet"))) == 2500
        and load_dataset(str(tmp_path / "t.parquet")).total is None
    )


def test_a_row_nested_past_the_json_readers_limit_is_a_clear_error(tmp_path):
    from collage.training.data.errors import RowError

    (tmp_path / "train.jsonl").write_text('{"prompt": "x", "deep": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    (item,) = load_dataset(str(tmp_path)).samples()
    assert isinstance(item, RowError) and str(item) == "row 0: train.jsonl line 1 is nested too deeply to read"


def test_bounded_values_are_json_and_small():
    value = {"k" * 10: list(range(1000)), "b": b"\x00" * 99, "s": "y" * 10_000, "n": [{"a": nested(50)}] * 200}
    shown = bounded(value)
    text = json.dumps(shown, allow_nan=False)
    assert len(text) < 40_000
    assert shown["b"] == "<99 bytes>" and shown["k" * 10][-1] == "… (950 more items)"
    assert re.search(r"… \(\d+ more characters\)$", shown["s"])
    assert bounded({"a": [1, "x", None, True, 2.5]}) == {"a": [1, "x", None, True, 2.5]}


# ------------------------------------------------------------------------ files inside a dataset folder


def _secret(folder: Path) -> Path:
    """An outside file a link inside the root points at (the real attack read /etc/passwd through a preview)."""
    folder.mkdir(parents=True, exist_ok=True)
    secret = folder / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    return secret


@pytest.mark.parametrize("name", ["train.jsonl", "train.csv", "only.jsonl"])
def test_a_split_file_linked_outside_the_roots_is_refused_naming_it(tmp_path, name):
    root, secret = tmp_path / "root", _secret(tmp_path / "outside")
    (root / "data").mkdir(parents=True)
    (root / "data" / name).symlink_to(secret)  # only.jsonl: the only data file, the fallback when no train.* exists
    with pytest.raises(DatasetError, match=rf"{name}: leads outside the folders it may be read from"):
        load_dataset(str(root / "data"), data_roots=[root], limit=5)
    with pytest.raises(DatasetError, match="leads outside"):
        load_dataset(str(root / "data" / name), data_roots=[root])  # the file itself, named as the source
    # a link that stays inside the roots is read as it always was; unconfined (the operator's own CLI), any link is
    (root / "inside.jsonl").write_text(json.dumps({"prompt": "inside"}) + "\n")
    (root / "data" / name).unlink()
    (root / "data" / "train.jsonl").symlink_to(root / "inside.jsonl")
    assert [
        s.prompt[0]["content"][0]["text"] for s in load_dataset(str(root / "data"), data_roots=[root]).samples()
    ] == ["inside"]


def test_a_split_that_is_a_fifo_is_refused_instead_of_blocking(tmp_path):
    import os

    (tmp_path / "data").mkdir()
    os.mkfifo(tmp_path / "data" / "train.jsonl")
    with pytest.raises(DatasetError, match="train.jsonl: is not a regular file"):
        load_dataset(str(tmp_path / "data"), data_roots=[tmp_path])


def _saved(folder: Path, splits: bool) -> Path:
    import datasets

    data = datasets.Dataset.from_dict({"prompt": ["a", "b"]})
    (datasets.DatasetDict({"train": data}) if splits else data).save_to_disk(str(folder))
    return folder


@pytest.mark.parametrize("splits", [False, True], ids=["dataset", "dataset_dict"])
def test_a_saved_dataset_whose_state_names_a_file_outside_is_refused(tmp_path, splits):
    """``state.json``'s ``_data_files`` honoured ``../``: rows from outside were trained into a rollout table other
    members can read. A name with a folder in it is refused before ``datasets`` opens anything."""
    root = tmp_path / "root"
    saved = _saved(root / "saved", splits)
    outside = _saved(tmp_path / "outside" / "other", False)
    split = saved / "train" if splits else saved
    state = json.loads((split / "state.json").read_text())
    escape = Path("..", *([".."] if splits else []), "..", "outside", "other") / state["_data_files"][0]["filename"]
    assert (split / escape).resolve().is_file() and (split / escape).resolve().is_relative_to(outside)
    state["_data_files"][0]["filename"] = str(escape)
    (split / "state.json").write_text(json.dumps(state))
    with pytest.raises(DatasetError, match="_data_files must be plain file names in its folder"):
        load_dataset(str(saved), data_roots=[root])


def test_a_saved_datasets_arrow_file_linked_outside_is_refused(tmp_path):
    root = tmp_path / "root"
    saved = _saved(root / "saved", False)
    outside = _saved(tmp_path / "outside" / "other", False)
    arrow = next(saved.glob("*.arrow"))
    arrow.unlink()
    arrow.symlink_to(next(outside.glob("*.arrow")))
    with pytest.raises(DatasetError, match=rf"{arrow.name}: leads outside"):
        load_dataset(str(saved), data_roots=[root])
    assert len(load_dataset(str(saved)).rows) == 2  # unconfined (the operator's own CLI): as datasets reads it
