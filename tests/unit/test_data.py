"""Synthetic tasks and the loader for every on-disk format users have."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from collage.training.data.errors import DatasetError, RowError
from collage.training.data.loader import load_dataset
from collage.training.data.synth import COLORS, TASKS, SynthError, write_synth


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(folder.rglob("*")):
        if file.is_file():
            h.update(file.relative_to(folder).as_posix().encode())
            h.update(file.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("task", sorted(TASKS))
def test_synth_is_deterministic_for_a_seed(task, tmp_path):
    write_synth(task, tmp_path / "a", rows=10, min_images=0, max_images=4, seed=3)
    write_synth(task, tmp_path / "b", rows=10, min_images=0, max_images=4, seed=3)
    write_synth(task, tmp_path / "c", rows=10, min_images=0, max_images=4, seed=4)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert _digest(tmp_path / "a") != _digest(tmp_path / "c")


def _red_fraction(image: Image.Image) -> float:
    import numpy as np

    pixels = np.asarray(image).reshape(-1, 3)
    return float((pixels == np.array(COLORS["red"])).all(axis=1).mean())


def test_count_red_answers_are_right(tmp_path):
    write_synth("count-red", tmp_path, rows=30, min_images=1, max_images=4, seed=0)
    for sample in load_dataset(str(tmp_path)).load_all():
        reds = sum(1 for im in sample.images if _red_fraction(im) > 0.05)
        assert str(reds) == sample.columns["answer"]
        assert sample.columns["colors"].count("red") == reds


def test_odd_one_out_and_same_shape_answers_match_their_drawings(tmp_path):
    write_synth("odd-one-out", tmp_path / "o", rows=20, min_images=3, max_images=5, seed=0)
    for s in load_dataset(str(tmp_path / "o")).load_all():
        shapes = s.columns["shapes"]
        odd = int(s.columns["answer"]) - 1
        assert all(shape != shapes[odd] for i, shape in enumerate(shapes) if i != odd)
        assert len({shape for i, shape in enumerate(shapes) if i != odd}) == 1
    write_synth("same-shape", tmp_path / "s", rows=20, min_images=2, max_images=4, seed=0)
    for s in load_dataset(str(tmp_path / "s")).load_all():
        i, j = s.columns["pair"]
        same = s.columns["shapes"][i - 1] == s.columns["shapes"][j - 1]
        assert s.columns["answer"] == ("yes" if same else "no")


def test_min_images_zero_mixes_text_only_rows_and_placeholders_vary(tmp_path):
    write_synth("count-red", tmp_path, rows=60, min_images=0, max_images=3, seed=1)
    samples = load_dataset(str(tmp_path)).load_all()
    counts = {s.num_images for s in samples}
    assert counts == {0, 1, 2, 3}
    text_only = [s for s in samples if s.num_images == 0]
    assert all(s.columns["task"] == "arith" for s in text_only)
    first_part = {s.prompt[0]["content"][0]["type"] for s in samples if s.num_images}
    assert first_part == {"image", "text"}  # images sometimes lead, sometimes follow text


def test_synth_refuses_impossible_image_counts(tmp_path):
    with pytest.raises(SynthError, match="at least 3 images"):
        write_synth("odd-one-out", tmp_path, rows=5, min_images=0, max_images=2)
    with pytest.raises(SynthError, match="min_images"):
        write_synth("count-red", tmp_path, rows=5, min_images=3, max_images=2)


def test_identical_images_are_stored_once(tmp_path):
    write_synth("count-red", tmp_path, rows=40, min_images=1, max_images=3, seed=2)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    refs = {ref for row in rows for ref in row["images"]}
    assert len(list((tmp_path / "images").iterdir())) == len(refs)
    for ref in refs:
        assert Path(ref).stem == hashlib.sha256((tmp_path / ref).read_bytes()).hexdigest()


def test_parquet_and_save_to_disk_load_the_same_rows(tmp_path):
    write_synth("same-shape", tmp_path / "j", rows=8, min_images=0, max_images=3, seed=5)
    write_synth("same-shape", tmp_path / "p", rows=8, min_images=0, max_images=3, seed=5, fmt="parquet")
    from_jsonl = load_dataset(str(tmp_path / "j")).load_all()
    from_parquet = load_dataset(str(tmp_path / "p" / "train.parquet")).load_all()

    import datasets

    records = [json.loads(line) for line in (tmp_path / "j" / "train.jsonl").read_text().splitlines()]
    for r in records:
        r["images"] = [(tmp_path / "j" / ref).read_bytes() for ref in r["images"]]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "disk"))
    from_disk = load_dataset(str(tmp_path / "disk"), split="train").load_all()

    for a, b, c in zip(from_jsonl, from_parquet, from_disk, strict=True):
        assert a.prompt == b.prompt == c.prompt
        assert (
            [im.tobytes() for im in a.images] == [im.tobytes() for im in b.images] == [im.tobytes() for im in c.images]
        )
        assert a.columns["answer"] == b.columns["answer"] == c.columns["answer"]


def _png(color=(10, 200, 10), size=(20, 20), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color if mode == "RGB" else 128).save(buf, format="PNG")
    return buf.getvalue()


def test_plain_string_prompt_gets_one_placeholder_per_image_and_extra_columns_are_kept(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    (tmp_path / "b.png").write_bytes(_png((1, 2, 3)))
    rows = [
        {"prompt": "Which is darker?", "images": ["a.png", "b.png"], "answer": "2", "difficulty": 3},
        {"prompt": "Describe it.", "image": "a.png", "answer": "green"},  # legacy single-image column
        {"prompt": "No picture here.", "answer": "ok"},
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b, c = load_dataset(str(tmp_path)).load_all()
    assert a.prompt == [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which is darker?"}],
        }
    ]
    assert a.columns == {"answer": "2", "difficulty": 3}
    assert b.num_images == 1 and b.prompt[0]["content"][0] == {"type": "image"}
    assert c.num_images == 0 and c.prompt[0]["content"] == [{"type": "text", "text": "No picture here."}]


def test_a_bad_dataset_lists_every_bad_row_and_skips_none(tmp_path):
    (tmp_path / "ok.png").write_bytes(_png())
    rows = [
        {"prompt": "fine", "images": ["ok.png"]},
        {"prompt": [{"role": "user", "content": [{"type": "text", "text": "x"}]}], "images": ["ok.png"]},
        {"prompt": "missing", "images": ["nope.png"]},
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError) as info:
        load_dataset(str(tmp_path)).load_all()
    assert [e.row for e in info.value.errors] == [1, 2]
    assert "row 1: prompt has 0 image placeholder(s) but the row has 1 image(s)" in str(info.value)
    assert "row 2: image 0 file not found" in str(info.value)


def test_invalid_json_is_a_bad_row_naming_the_line_and_the_rest_is_read(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n[1, 2]\n\n{"prompt": "d"}\n')
    items = list(load_dataset(str(tmp_path)).samples())
    assert [type(i).__name__ for i in items] == ["Sample", "RowError", "RowError", "Sample"]
    assert str(items[1]).startswith("row 1: train.jsonl line 2 is not valid JSON")
    assert str(items[2]) == "row 2: train.jsonl line 3 is a JSON list, not an object"
    assert items[3].row == 3 and items[3].prompt[0]["content"][-1]["text"] == "d"


def test_missing_source_and_split_are_clear(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(str(tmp_path / "nothing.jsonl"))
    (tmp_path / "train.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "other.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(DatasetError, match="split 'test'"):
        load_dataset(str(tmp_path), split="test")


def test_synth_source_is_cached_and_loaded_through_the_same_loader(monkeypatch, tmp_path):
    from collage.training.data import synth

    monkeypatch.setenv("COLLAGE_HOME", str(tmp_path))
    generated = []
    real = synth.generate
    monkeypatch.setattr(synth, "generate", lambda *a, **k: generated.append(a) or real(*a, **k))
    first = load_dataset("synth:count-red", rows=5, min_images=0, max_images=2, seed=9)
    assert len(generated) == 1 and Path(first.source).is_dir() and Path(first.source).is_relative_to(tmp_path)
    second = load_dataset("synth:count-red", rows=5, min_images=0, max_images=2, seed=9)
    assert len(generated) == 1, "the second load reads the cached folder, it does not generate again"
    assert first.source == second.source
    assert [r.data for r in first.rows] == [r.data for r in second.rows]
    other = load_dataset("synth:count-red", rows=5, min_images=0, max_images=2, seed=10)
    assert len(generated) == 2 and other.source != first.source  # another seed is another dataset


def test_row_error_carries_the_row():
    err = RowError(4, "bad thing")
    assert err.row == 4 and str(err) == "row 4: bad thing"
