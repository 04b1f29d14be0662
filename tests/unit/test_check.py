"""`collage data check` without a model: every failure kind named by row, a zero-size decoded image refused, and the
JSON report and exit code of the CLI called in-process."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from collage.app.cli.main import main
from collage.training.data.check import check_dataset
from collage.training.data.errors import RowError
from collage.training.data.rows import RawRow
from tests.support.datasets import (
    BAD_ROWS,
)


def test_each_failure_kind_is_named_by_row(bad_dataset):
    report = check_dataset(str(bad_dataset))
    assert not report.ok
    by_row = {e.row: e.message for e in report.errors}
    assert sorted(by_row) == sorted(BAD_ROWS)
    for row, needle in BAD_ROWS.items():
        assert needle in by_row[row], (row, by_row[row])
    assert report.images_per_row == [2, 1, 2, 0, 0]
    assert report.conversions == {"L to RGB": 1, "RGBA to RGB": 1}
    assert "object at 0x" not in " ".join(by_row.values())


def test_zero_size_image_object_is_refused():
    """Images can also arrive decoded (a save_to_disk or hub dataset): zero-size ones are refused too."""
    row = RawRow(3, {"prompt": "x", "images": [Image.new("RGB", (0, 4))]})
    with pytest.raises(RowError, match=r"row 3: image 0 has zero size \(0x4\)"):
        row.to_sample()


def test_cli_json_report(bad_dataset, capsys):
    assert main(["data", "check", str(bad_dataset), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and len(report["errors"]) == 7
    assert report["images_per_row"] == {"min": 0, "mean": 1, "max": 2}
