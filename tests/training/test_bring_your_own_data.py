"""Datasets as users have them, trained on for two steps with a tiny model in-process: TRL's formats with image
features (built locally with `datasets`), a Hub snapshot folder by config and split, and a corrupt image that
names its row while the others train; every trained row carries its own images."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from collage.training.config import DatasetSettings, parse_config
from collage.training.data.errors import DatasetError
from collage.training.data.loader import load_dataset
from collage.training.data.mapping import RowMapping
from tests.support.datasets import COLOURS, colour_png, mixed_dataset


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _trl_datasets(tmp_path: Path):
    """TRL's zen-image / zen-multi-image structures, built locally with `datasets` and `Image` features."""
    import datasets

    pictures = {c: Image.open(io.BytesIO(colour_png(c))) for c in COLOURS}
    standard = datasets.Dataset.from_dict(
        {
            "prompt": [f"What colour is this? ({c})" for c in COLOURS],
            "image": [pictures[c] for c in COLOURS],
            "completion": list(COLOURS),
        },  # fmt: skip
        features=datasets.Features(
            {"prompt": datasets.Value("string"), "image": datasets.Image(), "completion": datasets.Value("string")}
        ),  # fmt: skip
    )
    turn = lambda n: [{"role": "user", "content": [{"type": "image", "text": None}] * n  # noqa: E731
                       + [{"type": "text", "text": "Which colours?"}]}]  # fmt: skip
    pairs = [("red", "green"), ("blue", "red"), ("green", "blue")]
    conversational = datasets.Dataset.from_dict(
        {"prompt": [turn(2) for _ in pairs], "images": [[pictures[a], pictures[b]] for a, b in pairs],
         "completion": [[{"role": "assistant", "content": [{"type": "text", "text": f"{a} {b}"}]}] for a, b in pairs]},
        features=datasets.Features({
            "prompt": [{"role": datasets.Value("string"),
                        "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
            "images": datasets.Sequence(datasets.Image()),
            "completion": [{"role": datasets.Value("string"),
                            "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
        }),
    )  # fmt: skip
    out = {}
    for name, ds in (("standard", standard), ("conversational", conversational)):
        folder = tmp_path / name
        datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(folder))
        out[name] = (folder, ds)
    return out


def _train_two_steps(source: Path, out: Path, **dataset):
    from collage.training.output import OutputFolder
    from collage.training.trainer import Trainer

    config = parse_config({
        "model": {"path": "tiny:qwen2-vl", "dtype": "float32"},
        "dataset": {"source": str(source), **dataset},
        "rewards": [{"name": "accuracy"}],
        "train": {"max_steps": 2, "per_device_train_batch_size": 2, "num_generations": 2, "max_completion_length": 3},
        "logging": {"samples_every": 1},
        "resources": {"gpus": 0},
    })  # fmt: skip
    result = Trainer(config, out, [OutputFolder(out)]).train()
    assert result.status == "succeeded", result
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def _image_hashes_by_row(ds) -> dict[int, list[str]]:
    column = "images" if "images" in ds.column_names else "image"
    hashes = {}
    for index, record in enumerate(ds.with_format("arrow")[:].to_pylist()):
        refs = record[column] if column == "images" else [record[column]]
        hashes[index] = [_sha(ref["bytes"]) for ref in refs]
    return hashes


@pytest.mark.parametrize("name", ["standard", "conversational"])
def test_trl_formats_with_image_features_check_and_train_with_the_right_images(tmp_path, name):
    from collage.training.data.check import check_dataset

    folder, ds = _trl_datasets(tmp_path)[name]
    report = check_dataset(str(folder), use_cache=False)
    assert report.ok and report.rows == 3, report.errors
    assert check_dataset(str(folder), split="test", use_cache=False).rows == 1
    samples = _train_two_steps(folder, tmp_path / "out")
    expected = _image_hashes_by_row(ds)
    assert samples and {s["step"] for s in samples} == {1, 2}
    for sample in samples:
        assert [im["sha256"] for im in sample["images"]] == expected[sample["dataset_row"]], sample["dataset_row"]
        # the completion became the answer the accuracy reward compares with
        assert sample["columns"]["answer"] == list(COLOURS)[sample["dataset_row"]] if name == "standard" else True


def test_a_hub_snapshot_folder_by_config_and_split(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    snapshot = tmp_path / "snapshot"
    for config, colour in (("reds", "red"), ("blues", "blue")):
        for split, rows in (("train", 3), ("test", 1)):
            folder = snapshot / "data" / config
            folder.mkdir(parents=True, exist_ok=True)
            records = [{"question": f"{config} {split} {i}", "image": {"bytes": colour_png(colour), "path": None},
                        "answer": colour} for i in range(rows)]  # fmt: skip
            pq.write_table(pa.Table.from_pylist(records), folder / f"{split}-00000-of-00001.parquet")
    (snapshot / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: reds\n  data_files:\n  - split: train\n    path: data/reds/train-*\n"
        "  - split: test\n    path: data/reds/test-*\n  default: true\n"
        "- config_name: blues\n  data_files:\n  - split: train\n    path: data/blues/train-*\n---\n# A card\n"
    )
    columns = RowMapping.of(DatasetSettings(source="x", columns={"prompt": "question"}))
    reds = load_dataset(str(snapshot), mapping=columns).load_all()
    assert [s.columns["question"] for s in reds] == ["reds train 0", "reds train 1", "reds train 2"]
    assert np.asarray(reds[0].images[0])[0, 0].tolist() == list(COLOURS["red"])
    blues = load_dataset(str(snapshot), config_name="blues", mapping=columns).load_all()
    assert len(blues) == 3 and blues[0].columns["answer"] == "blue"
    assert len(load_dataset(str(snapshot), split="test", mapping=columns)) == 1
    with pytest.raises(DatasetError, match=r"no configuration 'greens' .*configurations: reds, blues"):
        load_dataset(str(snapshot), config_name="greens")
    with pytest.raises(DatasetError, match=r"configuration 'blues' has no split 'test' \(splits: train\)"):
        load_dataset(str(snapshot), config_name="blues", split="test")
    samples = _train_two_steps(snapshot, tmp_path / "out", columns={"prompt": "question"}, config_name="blues")
    assert {s["images"][0]["sha256"] for s in samples} == {_sha(colour_png("blue"))}


def test_a_corrupt_image_among_good_ones_names_its_row_and_the_others_train(tmp_path):
    folder = mixed_dataset(tmp_path / "data")
    samples = _train_two_steps(folder, tmp_path / "out", columns={"prompt": "question", "images": "image_1",
                                                                  "answer": "solution"})  # fmt: skip
    assert 3 not in {s["dataset_row"] for s in samples}
    events = [json.loads(line) for line in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    warning = next(e["message"] for e in events if "rows skipped" in e.get("message", ""))
    assert "1 of 6 rows skipped" in warning and "row 3: image 0" in warning and "corrupt.png" in warning
