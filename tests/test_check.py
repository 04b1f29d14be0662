"""`collage data check`: every failure kind named by row, the summary line, and the exit code."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from PIL import Image

from collage.app.cli import main
from collage.training.data.check import check_dataset
from collage.training.data.rows import RawRow, RowError


def _png(mode="RGB", size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def bad_dataset(tmp_path):
    (tmp_path / "ok.png").write_bytes(_png())
    (tmp_path / "gray.png").write_bytes(_png("L"))
    (tmp_path / "rgba.png").write_bytes(_png("RGBA"))
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


EXPECTED = {
    1: "prompt has 2 image placeholder(s) but the row has 1 image(s)",
    2: "image 0 file not found",
    3: "unreadable",
    6: "zero size",
    7: "prompt is not conversational",
    8: "role 'robot'",
    10: "train.jsonl line 11 is not valid JSON",
}


def test_each_failure_kind_is_named_by_row(bad_dataset):
    report = check_dataset(str(bad_dataset))
    assert not report.ok
    by_row = {e.row: e.message for e in report.errors}
    assert sorted(by_row) == sorted(EXPECTED)
    for row, needle in EXPECTED.items():
        assert needle in by_row[row], (row, by_row[row])
    assert report.images_per_row == [2, 1, 2, 0, 0]
    assert report.conversions == {"L to RGB": 1, "RGBA to RGB": 1}
    assert "object at 0x" not in " ".join(by_row.values())


def test_zero_size_image_object_is_refused():
    """Images can also arrive decoded (a save_to_disk or hub dataset): zero-size ones are refused too."""
    row = RawRow(3, {"prompt": "x", "images": [Image.new("RGB", (0, 4))]})
    with pytest.raises(RowError, match=r"row 3: image 0 has zero size \(0x4\)"):
        row.to_sample()


def test_image_tokens_over_max_prompt_length_for_the_model(count_red_dir, tiny_model_dir):
    model = str(tiny_model_dir("qwen2-vl"))
    report = check_dataset(str(count_red_dir), model=model, max_prompt_length=12)
    over = {e.row for e in report.errors}
    assert over, "rows with three images cannot fit 12 tokens"
    for err in report.errors:
        assert "images alone take" in err.message and "max_prompt_length=12" in err.message
    assert len(over) + len(report.image_tokens_per_row) == report.rows

    fine = check_dataset(str(count_red_dir), model=model, max_prompt_length=4096)
    assert fine.ok and fine.truncated_rows == 0
    assert len(fine.image_tokens_per_row) == fine.rows
    # qwen2-vl tiny: 4 image tokens + 2 markers per 56x56 image
    assert fine.image_tokens_per_row == [6 * n for n in fine.images_per_row]


def test_cli_exit_codes_and_output(bad_dataset, count_red_dir, capsys):
    assert main(["data", "check", str(bad_dataset)]) == 1
    out = capsys.readouterr().out.splitlines()
    for row, needle in EXPECTED.items():
        assert any(line.startswith(f"row {row}: ") and needle in line for line in out), (row, out)
    assert out[-1].startswith("12 rows, 7 bad, images/row min 0 / mean 1.00 / max 2")
    assert "1 image(s): L to RGB (as the model's processor does)" in out

    assert main(["data", "check", str(count_red_dir), "--model", "tiny:llava", "--max-prompt-length", "256"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("12 rows, 0 bad, images/row min 0")
    assert "image tokens/row min 0" in summary and "for tiny:llava" in summary

    assert main(["data", "check", str(bad_dataset / "nope.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_json_report(bad_dataset, capsys):
    assert main(["data", "check", str(bad_dataset), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and len(report["errors"]) == 7
    assert report["images_per_row"] == {"min": 0, "mean": 1, "max": 2}


def test_console_script_builds_synthesises_and_checks(tmp_path):
    """The installed `collage` entry point, end to end, as a user runs it."""
    exe = [sys.executable, "-m", "collage.app.cli"]
    run = lambda *a: subprocess.run([*exe, *a], capture_output=True, text=True, timeout=300)  # noqa: E731
    built = run("models", "build-tiny", "qwen2-vl", "--out", str(tmp_path / "m"))
    assert built.returncode == 0, built.stderr
    made = run(
        "data",
        "synth",
        "odd-one-out",
        "--rows",
        "6",
        "--min-images",
        "3",
        "--max-images",
        "4",
        "--out",
        str(tmp_path / "d"),
    )
    assert made.returncode == 0, made.stderr
    checked = run("data", "check", str(tmp_path / "d"), "--model", str(tmp_path / "m"), "--max-prompt-length", "128")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.startswith("6 rows, 0 bad, images/row min 3")
    again = run("models", "build-tiny", "qwen2-vl", "--out", str(tmp_path / "m"))
    assert again.returncode == 2 and "not empty" in again.stderr
