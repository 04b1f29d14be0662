"""Datasets as users have them: TRL's formats (built locally with `datasets`), a Hub snapshot folder, column maps
and prompt templates, CSV, images converted as the processors convert them, and the bad inputs around them."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from collage.training.config import DatasetSettings, parse_config
from collage.training.data.loader import DatasetError, load_dataset
from collage.training.data.mapping import RowMapping, guess_columns, parse_columns
from collage.training.data.rows import RowError

API = "/api/v1"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220)}


def _png(colour: str, size: int = 28, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), COLOURS[colour]).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _mapped(settings: dict, row: dict):
    return RowMapping.of(DatasetSettings(source="x", **settings)).apply(0, row)


# ------------------------------------------------------------------------------------ column maps, templates


def test_columns_gather_image_columns_in_order_skipping_empty_ones_and_map_the_answer():
    row = {
        "question": "Which is red?",
        "image_1": "a.png",
        "image_2": None,
        "image_3": "c.png",
        "solution": ["1", "one"],
    }
    mapped = _mapped({"columns": {"prompt": "question", "images": ["image_1", "image_2", "image_3"],
                                  "answer": "solution"}}, row)  # fmt: skip
    assert mapped.image_refs == ["a.png", "c.png"]
    assert mapped.prompt == "Which is red?"
    # the answer reaches the rewards unchanged (a list of acceptable answers here); the image columns do not
    assert mapped.columns == {"question": "Which is red?", "solution": ["1", "one"], "answer": ["1", "one"]}


def test_a_template_places_the_images_and_a_system_prompt_comes_first():
    row = {"question": "How many?", "choices": 3, "img": ["a.png", "b.png"], "label": 2}
    settings = {"columns": {"images": "img", "answer": "label"}, "system_prompt": "Be brief.",
                "prompt_template": "Look: {images}\nQ: {question} ({choices} choices)"}  # fmt: skip
    mapped = _mapped(settings, row)
    assert mapped.prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "image"},
                                     {"type": "text", "text": "\nQ: How many? (3 choices)"}]},
    ]  # fmt: skip
    assert mapped.columns["answer"] == 2  # a number stays a number
    # without {images} the images come first
    plain = _mapped({"columns": {"images": "img"}, "prompt_template": "Q: {question}"}, row)
    assert plain.prompt[0]["content"][:2] == [{"type": "image"}, {"type": "image"}]


def test_trl_formats_without_a_mapping():
    # standard prompt-completion: the completion is the answer; one `image` column
    mapped = RowMapping().apply(0, {"prompt": "Colour?", "completion": "red", "image": "a.png"})
    assert mapped.image_refs == ["a.png"] and mapped.columns["answer"] == "red"
    # conversational prompt-completion, image parts with text None (as Arrow structs come back)
    conversation = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Colour?"}]}]
    completion = [{"role": "assistant", "content": [{"type": "text", "text": "green"}]}]
    mapped = RowMapping().apply(0, {"prompt": conversation, "completion": completion, "images": ["a.png"]})
    assert mapped.columns["answer"] == "green" and mapped.prompt == conversation


def test_missing_columns_are_named_with_the_key_and_the_rows_columns():
    row = {"question": "?", "image_1": "a.png"}
    with pytest.raises(
        RowError, match=r"no column 'image_2' \(dataset.columns.images\); the row's columns: 'question'"
    ):
        _mapped({"columns": {"prompt": "question", "images": ["image_1", "image_2"]}}, row)
    with pytest.raises(RowError, match=r"no column 'hint' \(dataset.prompt_template uses it\)"):
        _mapped({"prompt_template": "{question} {hint}"}, row)
    with pytest.raises(RowError, match=r"no 'prompt' column .*dataset.columns.prompt"):
        RowMapping().apply(0, row)
    mapping = RowMapping.of(DatasetSettings(source="x", columns={"prompt": "q", "answer": "solution"}))
    assert mapping.missing_columns(["q", "images"]) == [("dataset.columns.answer", "solution")]


def test_the_columns_flag_and_the_launch_forms_guess():
    assert parse_columns("prompt=question,images=image_1+image_2,answer=solution") == {
        "prompt": "question", "images": ["image_1", "image_2"], "answer": "solution"}  # fmt: skip
    for bad in ("prompt", "colour=x", "prompt=a,prompt=b"):
        with pytest.raises(ValueError):
            parse_columns(bad)
    assert guess_columns(["question", "image_2", "image_1", "image_10", "solution"]) == {
        "prompt": "question", "answer": "solution", "images": ["image_1", "image_2", "image_10"]}  # fmt: skip
    assert guess_columns(["prompt", "images", "answer"]) == {}  # TRL's names need no mapping
    assert guess_columns(["Query", "img", "ground_truth"]) == {
        "prompt": "Query",
        "images": "img",
        "answer": "ground_truth",
    }


# --------------------------------------------------------------------------------------------- conversions


def _processor_rgb(image: Image.Image) -> np.ndarray:
    from transformers.image_transforms import convert_to_rgb

    return np.asarray(convert_to_rgb(image, return_numpy=True))


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "P-transparent", "CMYK", "I;16", "1"])
def test_non_rgb_images_become_what_the_processor_makes_of_them(tmp_path, mode):
    pixels = np.random.default_rng(0).integers(0, 256, (12, 16, 4), dtype=np.uint8)
    rgba = Image.fromarray(pixels, "RGBA")
    if mode == "P-transparent":
        image = rgba.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
        image.info["transparency"] = 0
    elif mode == "I;16":
        image = Image.fromarray((pixels[..., 0].astype(np.uint16) * 200), "I;16")
    else:
        image = rgba.convert(mode)
    buf = io.BytesIO()
    image.save(buf, format="PNG" if mode != "CMYK" else "TIFF")
    name = "img.png" if mode != "CMYK" else "img.tif"
    (tmp_path / name).write_bytes(buf.getvalue())
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "?", "images": [name]}) + "\n")
    (sample,) = load_dataset(str(tmp_path)).load_all()
    seen = sample.images[0]
    assert seen.mode == "RGB"
    expected = _processor_rgb(Image.open(tmp_path / name))
    assert np.array_equal(np.asarray(seen), expected), mode


def test_exif_orientation_is_applied(tmp_path):
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (0, 0, 10, 20))  # blue on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to view"
    image.save(tmp_path / "photo.jpg", exif=exif.tobytes(), quality=95)
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "?", "images": ["photo.jpg"]}) + "\n")
    (sample,) = load_dataset(str(tmp_path)).load_all()
    upright = sample.images[0]
    assert upright.size == (20, 40)
    top = np.asarray(upright)[2, 10]
    assert top[2] > 200 and top[0] < 60, "the blue left edge is at the top once turned upright"


# ------------------------------------------------------------------------------------------------- formats


def _trl_datasets(tmp_path: Path):
    """TRL's zen-image / zen-multi-image structures, built locally with `datasets` and `Image` features."""
    import datasets

    pictures = {c: Image.open(io.BytesIO(_png(c))) for c in COLOURS}
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
            records = [{"question": f"{config} {split} {i}", "image": {"bytes": _png(colour), "path": None},
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
    assert {s["images"][0]["sha256"] for s in samples} == {_sha(_png("blue"))}


def test_a_csv_with_image_path_columns(tmp_path):
    for colour in COLOURS:
        (tmp_path / f"{colour}.png").write_bytes(_png(colour))
    (tmp_path / "train.csv").write_text(
        "question,image_1,image_2,solution\nfirst?,red.png,green.png,red\nsecond?,blue.png,,blue\n"
    )
    mapping = RowMapping.of(DatasetSettings(source="x", columns={"prompt": "question",
                                                                 "images": ["image_1", "image_2"], "answer": "solution"}))  # fmt: skip
    first, second = load_dataset(str(tmp_path), mapping=mapping).load_all()
    assert first.num_images == 2 and second.num_images == 1 and second.columns["answer"] == "blue"
    assert np.asarray(second.images[0])[0, 0].tolist() == list(COLOURS["blue"])


# ------------------------------------------------------------------------------------ bad rows and the CLI


def _mixed_dataset(folder: Path, corrupt: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for colour in COLOURS:
        (folder / f"{colour}.png").write_bytes(_png(colour, mode="RGBA" if colour == "green" else "RGB"))
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    rows = [
        {"question": f"q{i}", "image_1": f"{c}.png", "solution": c} for i, c in enumerate(["red", "green", "blue"] * 2)
    ]
    if corrupt:
        rows[3]["image_1"] = "corrupt.png"
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_a_corrupt_image_among_good_ones_names_its_row_and_the_others_train(tmp_path):
    folder = _mixed_dataset(tmp_path / "data")
    samples = _train_two_steps(folder, tmp_path / "out", columns={"prompt": "question", "images": "image_1",
                                                                  "answer": "solution"})  # fmt: skip
    assert 3 not in {s["dataset_row"] for s in samples}
    events = [json.loads(line) for line in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    warning = next(e["message"] for e in events if "rows skipped" in e.get("message", ""))
    assert "1 of 6 rows skipped" in warning and "row 3: image 0" in warning and "corrupt.png" in warning


def test_the_cli_checks_with_a_mapping_samples_and_writes_a_fixed_copy(tmp_path, capsys):
    from collage.app.cli import main

    folder = _mixed_dataset(tmp_path / "data")
    with (folder / "train.jsonl").open("a") as fh:
        fh.write('{"question": "cut\n')
    assert main(["data", "check", str(folder)]) == 1  # no prompt column without a mapping: every row named
    assert "row 0: no 'prompt' column" in capsys.readouterr().out
    flags = ["--columns", "prompt=question,images=image_1,answer=solution"]
    assert main(["data", "check", str(folder), *flags]) == 1
    out = capsys.readouterr().out
    assert "row 3: image 0" in out and "row 6: train.jsonl line 7 is not valid JSON" in out
    assert "2 image(s): RGBA to RGB" in out and "7 rows, 2 bad" in out
    assert main(["data", "check", str(folder), *flags, "--sample", "2"]) == 0
    assert "2 rows, 0 bad" in capsys.readouterr().out
    fixed = tmp_path / "fixed"
    assert main(["data", "check", str(folder), *flags, "--fix", str(fixed)]) == 0
    assert "wrote 5 rows" in capsys.readouterr().out
    assert [json.loads(line)["row"] for line in (fixed / "bad_rows.jsonl").read_text().splitlines()] == [3, 6]
    again = load_dataset(str(fixed)).load_all()  # the copy needs no mapping, its images are RGB PNGs
    assert len(again) == 5 and again[1].columns["answer"] == "green" and again[1].images[0].mode == "RGB"
    assert main(["data", "check", str(fixed)]) == 0
    assert main(["data", "check", str(folder), "--columns", "colour=x"]) == 2
    assert "'colour' is not one of prompt, images, answer, system" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the API


def _config(source: Path, **dataset) -> dict:
    return {"model": {"path": "tiny:qwen2-vl"}, "dataset": {"source": str(source), **dataset},
            "rewards": [{"name": "accuracy"}], "resources": {"gpus": 0}}  # fmt: skip


def test_preview_renders_mapped_prompts_and_guesses_the_mapping(api):
    client, _, _, app = api
    folder = _mixed_dataset(Path(app.state.settings.home) / "data", corrupt=False)
    plain = client.get(f"{API}/datasets/preview", params={"source": str(folder), "rows": 2}).json()
    assert plain["column_names"] == ["question", "image_1", "solution"]
    assert plain["guess"] == {"prompt": "question", "images": "image_1", "answer": "solution"}
    assert plain["rows"][0]["error"].startswith("no 'prompt' column")
    mapped = client.get(f"{API}/datasets/preview", params={
        "source": str(folder), "rows": 2, "columns": "images=image_1,answer=solution",
        "prompt_template": "{images}Question: {question}"}).json()  # fmt: skip
    first = mapped["rows"][0]
    assert first["error"] is None and len(first["images"]) == 1
    assert first["prompt"] == [{"role": "user", "content": [{"type": "image"},
                                                            {"type": "text", "text": "Question: q0"}]}]  # fmt: skip
    bad = client.get(f"{API}/datasets/preview", params={"source": str(folder), "columns": "prompt"})
    assert bad.status_code == 422 and bad.json()["detail"].startswith("columns: 'prompt': write KEY=COLUMN")


def test_submit_refuses_missing_columns_and_datasets_without_a_usable_row_before_creating_a_run(api):
    client, _, dispatcher, app = api
    home = Path(app.state.settings.home)
    folder = _mixed_dataset(home / "data", corrupt=False)
    before = client.get(f"{API}/runs").json()["items"]
    response = client.post(f"{API}/runs", json=_config(folder, columns={"prompt": "query", "images": "image_1"}))
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail[0]["path"] == "dataset.columns.prompt"
    assert "no column 'query'" in detail[0]["message"] and "'question'" in detail[0]["message"]
    response = client.post(f"{API}/runs", json=_config(folder, columns={"images": "image_1"},
                                                       prompt_template="{question} {hint}"))  # fmt: skip
    assert response.status_code == 422 and response.json()["detail"][0]["path"] == "dataset.prompt_template"
    broken = home / "broken"
    broken.mkdir()
    (broken / "train.jsonl").write_text('{"prompt": "a", "images": ["gone.png"]}\n{"prompt": \n')
    response = client.post(f"{API}/runs", json=_config(broken))
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["path"] == "dataset.source"
    assert "none of its rows is usable" in response.json()["detail"][0]["message"]
    assert client.get(f"{API}/runs").json()["items"] == before and not dispatcher.submitted
    good = client.post(f"{API}/runs", json=_config(folder, columns={"prompt": "question", "images": "image_1",
                                                                    "answer": "solution"}))  # fmt: skip
    assert good.status_code == 201, good.text
    stored = client.get(f"{API}/runs/{good.json()['id']}").json()["config"]["dataset"]
    assert stored["columns"] == {"prompt": "question", "images": "image_1", "answer": "solution", "system": None}
