"""`collage data check` against a tiny model's processor, in-process: rows whose image tokens alone exceed
max_prompt_length are named, image tokens per row are counted, and the CLI's output, summary line and exit codes."""

from __future__ import annotations

from collage.app.cli.main import main
from collage.training.data.check import check_dataset
from tests.support.datasets import (
    BAD_ROWS,
)


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
    for row, needle in BAD_ROWS.items():
        assert any(line.startswith(f"row {row}: ") and needle in line for line in out), (row, out)
    assert out[-1].startswith("12 rows, 7 bad, images/row min 0 / mean 1.00 / max 2")
    assert "1 image(s): L to RGB (as the model's processor does)" in out

    assert main(["data", "check", str(count_red_dir), "--model", "tiny:llava", "--max-prompt-length", "256"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("12 rows, 0 bad, images/row min 0")
    assert "image tokens/row min 0" in summary and "for tiny:llava" in summary

    assert main(["data", "check", str(bad_dataset / "nope.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
