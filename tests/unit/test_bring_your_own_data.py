"""Datasets as users have them, read in-process: column maps and prompt templates, TRL's formats without a mapping,
missing columns named, CSV with image path columns, images converted as the processors convert them (modes, EXIF
orientation), and `collage data check` called in-process with a mapping, a sample and a fixed copy."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from collage.training.config import DatasetSettings
from collage.training.data.errors import RowError
from collage.training.data.loader import load_dataset
from collage.training.data.mapping import RowMapping, guess_columns, parse_columns
from tests.support.datasets import COLOURS, colour_png, mixed_dataset


def _mapped(settings: dict, row: dict):
    return RowMapping.of(DatasetSettings(source="x", **settings)).apply(0, row)


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


def _processor_rgb(image: Image.Image) -> np.ndarray:
    from transformers.image_transforms import convert_to_rgb

    return np.asarray(convert_to_rgb(image, return_numpy=True))


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "P-transparent", "CMYK", "I;16", "1"])
def test_non_rgb_images_become_what_the_processor_makes_of_them(tmp_path, mode):
    pixels = np.random.default_rng(0).integers(0, 256, (12, 16, 4), dtype=np.uint8)
    rgba = Image.fromarray(pixels)  # (H, W, 4) uint8: RGBA (Pillow 13 takes no mode argument)
    assert rgba.mode == "RGBA"
    if mode == "P-transparent":
        image = rgba.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
        image.info["transparency"] = 0
    elif mode == "I;16":
        # 16-bit grey from bytes: what Image.fromarray(array, "I;16") made before Pillow 13 dropped its mode
        wide = (pixels[..., 0].astype("<u2") * 200).tobytes()
        image = Image.frombytes("I;16", (16, 12), wide)
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


def test_a_csv_with_image_path_columns(tmp_path):
    for colour in COLOURS:
        (tmp_path / f"{colour}.png").write_bytes(colour_png(colour))
    (tmp_path / "train.csv").write_text(
        "question,image_1,image_2,solution\nfirst?,red.png,green.png,red\nsecond?,blue.png,,blue\n"
    )
    mapping = RowMapping.of(DatasetSettings(source="x", columns={"prompt": "question",
                                                                 "images": ["image_1", "image_2"], "answer": "solution"}))  # fmt: skip
    first, second = load_dataset(str(tmp_path), mapping=mapping).load_all()
    assert first.num_images == 2 and second.num_images == 1 and second.columns["answer"] == "blue"
    assert np.asarray(second.images[0])[0, 0].tolist() == list(COLOURS["blue"])


def test_the_cli_checks_with_a_mapping_samples_and_writes_a_fixed_copy(tmp_path, capsys):
    from collage.app.cli.main import main

    folder = mixed_dataset(tmp_path / "data")
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
