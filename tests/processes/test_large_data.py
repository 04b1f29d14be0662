"""Large datasets: the data side's memory, measured in a process of its own, does not grow with the row count
(bench/large_dataset.py measures a million rows), and the preview shows 200 rows while a check of a big split
samples it, through the API on SQLite and PostgreSQL and the real dataset helper process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.datasets import write_parquet
from tests.support.waiting import scaled

_DATA_SIDE = textwrap.dedent(
    """
    import json, os, sys
    from collage.training.config import DatasetSettings
    from collage.training.data import rowsource
    from collage.training.data.heldout import load_heldout, training_rows
    from collage.training.data.loader import load_dataset
    import torch

    def peak_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    rowsource.GROUP_CACHE_BYTES = 4 << 20
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the peak so far (imports) is forgotten: what follows is measured alone
    before = peak_kib()
    split = load_dataset(sys.argv[1])
    if os.environ.get("EAGER"):
        split.rows = list(split.rows)  # what reading the split whole costs (for comparison, by hand)
    settings = DatasetSettings(source=sys.argv[1], eval_fraction=0.1)
    held = load_heldout(settings, split, max_rows=16)
    train = training_rows(split, held.held_rows)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    for i in order[:300].tolist():
        train.rows[i].to_sample()
    for raw in held.rows:
        raw.to_sample()
    print(json.dumps({"rows": len(split), "grown_kib": peak_kib() - before}))
    """
)


def _data_side_growth(file: Path, env: dict[str, str] | None = None) -> int:
    out = subprocess.run([sys.executable, "-c", _DATA_SIDE, str(file)], capture_output=True, text=True, timeout=scaled(600),
                         env={**os.environ, **(env or {})})  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["grown_kib"]


def test_the_data_sides_memory_does_not_grow_with_the_row_count(tmp_path):
    """Ten times the rows (each with 8 KiB of bytes that cannot be compressed: 330 MB on disk) and the data side
    stays within a few MiB of the small split's: reading the split whole would grow by the file's size."""
    small = write_parquet(tmp_path / "small.parquet", 4_000, group=100, noise_bytes=8192)
    large = write_parquet(tmp_path / "large.parquet", 40_000, group=100, noise_bytes=8192)
    assert large.stat().st_size > 300e6
    growth_small, growth_large = _data_side_growth(small), _data_side_growth(large)
    # a few integers per row (positions, the held-out list) and the bounded row-group cache; not the rows
    assert growth_large - growth_small < 24 * 1024, (growth_small, growth_large)


def test_preview_shows_200_rows_and_a_check_of_a_big_split_samples_it(api):
    from collage.training.config import CHECK_SAMPLE_ROWS
    from collage.training.data.check import check_sample

    client, _, _, app = api
    folder = Path(app.state.settings.home) / "data"
    folder.mkdir()
    rows = CHECK_SAMPLE_ROWS + 400
    bad = next(r for r in check_sample(rows, CHECK_SAMPLE_ROWS, 0) if r >= 200)  # not previewed
    write_parquet(folder / "train.parquet", rows, group=100, bad=(bad,))
    preview = client.get("/api/v1/datasets/preview", params={"source": str(folder), "rows": 200})
    assert preview.status_code == 200, preview.text
    body = preview.json()
    assert len(body["rows"]) == 200 and body["total_rows"] == rows and body["note"] is None
    assert [r["row"] for r in body["rows"]] == list(range(200)) and all(r["images"] for r in body["rows"])
    assert client.get("/api/v1/datasets/preview", params={"source": str(folder), "rows": 201}).status_code == 422
    sampled = client.post("/api/v1/datasets/check", json={"source": str(folder), "check": "sample"}).json()
    assert sampled["rows"] == CHECK_SAMPLE_ROWS and sampled["sample_of"] == rows
    assert [e["row"] for e in sampled["errors"]] == [bad] and "a seeded sample" in sampled["summary"]
    whole = client.post("/api/v1/datasets/check", json={"source": str(folder)}).json()  # auto: small enough
    assert whole["rows"] == rows and whole["sample_of"] is None and [e["row"] for e in whole["errors"]] == [bad]
