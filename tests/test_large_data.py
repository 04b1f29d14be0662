"""Large datasets: a split is read on demand (parquet a row group at a time, JSONL by line offsets), the data side's
memory does not grow with the row count, and a sample check draws the same rows as a full one, checking the
others when a batch draws them (bench/large_dataset.py measures a million rows)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from collage.training.callbacks import Callback
from collage.training.config import parse_config
from collage.training.data.heldout import training_rows
from collage.training.data.loader import load_dataset
from collage.training.data.rowsource import JsonlRows, ParquetRows
from collage.training.trainer import TrainingError

RED, GREY = (220, 30, 30), (200, 200, 200)


def _scene(reds: int, seed: int, size: int = 28) -> bytes:
    """A PNG with ``reds`` red squares on grey (and a little noise, so images differ)."""
    rng = np.random.default_rng(seed)
    pixels = np.full((size, size, 3), GREY, dtype=np.uint8) + rng.integers(0, 8, (size, size, 3), dtype=np.uint8)
    for k in range(reds):
        x = 2 + 8 * k
        pixels[4:10, x : x + 6] = RED
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def write_parquet(path: Path, rows: int, group: int = 50, bad: tuple[int, ...] = (), noise_bytes: int = 0) -> Path:
    """``rows`` rows of one or two inline images each (the count-red task), in row groups of ``group``; the rows
    in ``bad`` carry bytes that are not an image. ``noise_bytes``: extra incompressible bytes in a side column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pool = [_scene(1 + k % 3, k) for k in range(12)]
    rng = np.random.default_rng(0)
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    writer = None
    for lo in range(0, rows, group):
        hi = min(rows, lo + group)
        images, prompts, answers, noise = [], [], [], []
        for i in range(lo, hi):
            n = 1 + i % 2
            picks = [pool[(i * 7 + k) % len(pool)] for k in range(n)]
            if i in bad:
                picks[0] = b"\x89PNG\r\n\x1a\n not an image"
            images.append([{"bytes": b, "path": None} for b in picks])
            prompts.append(f"Row {i}: how many red squares are there in all?")
            answers.append(str(sum(1 + ((i * 7 + k) % len(pool)) % 3 for k in range(n))))
            noise.append(rng.bytes(noise_bytes) if noise_bytes else b"")
        table = pa.table(
            {
                "prompt": pa.array(prompts),
                "images": pa.array(images, type=pa.list_(image)),
                "answer": pa.array(answers),
                "noise": pa.array(noise, type=pa.binary()),
            }
        )
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema, use_dictionary=False, compression="none")
        writer.write_table(table, row_group_size=group)
    assert writer is not None
    writer.close()
    return path


def test_a_parquet_split_is_read_a_row_group_at_a_time(tmp_path):
    import pyarrow.parquet as pq

    file = write_parquet(tmp_path / "train.parquet", 1000, group=50)
    dataset = load_dataset(str(file))
    rows = dataset.rows
    assert isinstance(rows, ParquetRows) and len(dataset) == 1000 and rows.group_reads == 0  # metadata only
    whole = pq.read_table(file).to_pylist()
    assert rows[737].data == whole[737] and rows[737].row == 737 and rows.group_reads == 1
    assert rows[749].data == whole[749] and rows[-1].data == whole[999] and rows.group_reads == 2  # 737, 749: one
    assert [raw.data for raw in rows] == whole  # in order, a batch at a time
    assert [raw.row for raw in rows[10:13]] == [10, 11, 12]
    sample = rows[737].to_sample()
    assert sample.num_images == 2 and sample.prompt[0]["content"][-1]["text"].startswith("Row 737:")
    # held-out and bad rows out: a view by position, rows keep their split index
    kept = training_rows(dataset, [0, 5, 999])
    assert len(kept) == 997 and [raw.row for raw in kept.rows[:6]] == [1, 2, 3, 4, 6, 7]
    assert kept.rows[-1].row == 998 and kept.rows[4].data == whole[6]
    again = training_rows(kept, [5, 6, 500])  # 5 is out already: a view of a view, by split index
    assert len(again) == 995 and [raw.row for raw in again.rows[:5]] == [1, 2, 3, 4, 7]
    assert [raw.row for raw in again.rows] == [r for r in range(1000) if r not in (0, 5, 6, 500, 999)]
    assert again.rows.row_ids().tolist() == [raw.row for raw in again.rows]
    # the first rows of a preview: read without touching the rest
    first = load_dataset(str(file), limit=3)
    assert [raw.data for raw in first.rows] == whole[:3] and first.total == 1000


def test_shards_of_a_split_are_one_sequence(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_parquet(folder / "train-00000-of-00002.parquet", 30, group=7)
    write_parquet(folder / "train-00001-of-00002.parquet", 20, group=7)
    dataset = load_dataset(str(folder))
    assert len(dataset) == 50 and [raw.row for raw in dataset.rows][-3:] == [47, 48, 49]
    assert dataset.rows[35].data["prompt"].startswith("Row 5:") and dataset.rows[35].row == 35


def test_a_jsonl_split_is_read_by_line_offsets_and_a_bad_line_stays_a_bad_row(tmp_path):
    file = tmp_path / "train.jsonl"
    lines = ['{"prompt": "a", "answer": "1"}', "", '{"prompt": "b"', "[1, 2]", '{"prompt": "c", "answer": "3"}', ""]
    file.write_text("\n".join(lines) + "\n")
    dataset = load_dataset(str(file))
    assert isinstance(dataset.rows, JsonlRows) and len(dataset) == 4
    assert dataset.rows[3].data == {"prompt": "c", "answer": "3"} and dataset.rows[3].row == 3
    assert "train.jsonl line 3 is not valid JSON" in dataset.rows[1].problem
    assert "line 4 is a JSON list" in dataset.rows[2].problem
    eager = load_dataset(str(file), limit=10)
    assert [(r.row, r.data, r.problem) for r in dataset.rows] == [(r.row, r.data, r.problem) for r in eager.rows]


# ------------------------------------------------------------------------------------------- memory

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
    out = subprocess.run([sys.executable, "-c", _DATA_SIDE, str(file)], capture_output=True, text=True, timeout=600,
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


# -------------------------------------------------------------------------------- sample check, drawing


class Events(Callback):
    def __init__(self, stop_after: int | None = None):
        self.events: list[tuple[str, str]] = []
        self.rows: list[tuple[int, int]] = []  # (step, dataset row) of each training rollout
        self.steps = 0
        self.stop_after = stop_after

    def on_event(self, level, message):
        self.events.append((level, message))

    def on_metrics(self, step, metrics):
        self.steps = step

    def on_samples(self, step, rows):
        self.rows.extend((step, r.row) for r in rows if r.split == "train")

    def should_stop(self):
        return self.stop_after is not None and self.steps >= self.stop_after


def _train(source: Path, out: Path, resume: bool = False, stop_after: int | None = None, train=None, **dataset):
    from collage.training.output import OutputFolder
    from collage.training.trainer import Trainer

    config = parse_config({
        "model": {"path": "tiny:qwen2-vl", "dtype": "float32"},
        "dataset": {"source": str(source), **dataset},
        "rewards": [{"name": "accuracy"}],
        "train": {"max_steps": 3, "per_device_train_batch_size": 6, "num_generations": 2, "max_completion_length": 2,
                  "save_steps": 1, **(train or {})},
        "logging": {"samples_every": 1},
        "resources": {"gpus": 0},
    })  # fmt: skip
    recorder = Events(stop_after)
    result = Trainer(config, out, [OutputFolder(out), recorder], resume=resume).train()
    return result, recorder


def _first_drawn(n: int, seed: int = 0) -> list[int]:
    """The rows the first generation batch draws from an ``n``-row split (the trainer's epoch permutation)."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003)).tolist()[:3]


def test_a_sample_check_draws_what_a_full_check_draws_and_checks_the_rest_when_drawn(tmp_path, monkeypatch):
    from collage.training import trainer
    from collage.training.data.check import check_sample

    monkeypatch.setattr(trainer, "CHECK_SAMPLE_ROWS", 8)
    clean = write_parquet(tmp_path / "clean.parquet", 60, group=10)
    full, full_events = _train(clean, tmp_path / "full", check="full")
    sampled, sampled_events = _train(clean, tmp_path / "sampled", check="sample")
    assert full.status == sampled.status == "succeeded"
    assert full_events.rows == sampled_events.rows  # the same shuffle whichever check ran
    assert not [m for level, m in sampled_events.events if level == "warning"]

    # a corrupt row the sample does not cover, drawn by the first batch
    bad = next(r for r in _first_drawn(60) if r not in check_sample(60, 8, 0))
    dirty = write_parquet(tmp_path / "dirty.parquet", 60, group=10, bad=(bad,))
    result, events = _train(dirty, tmp_path / "dirty", check="sample")
    assert result.status == "succeeded"
    drawn = [row for _, row in events.rows]
    assert bad not in drawn and len(set(drawn)) >= 8
    warnings = [m for level, m in events.events if level == "warning" and "skipped when drawn" in m]
    assert len(warnings) == 1 and f"row {bad}: image 0" in warnings[0], events.events
    # the other rows of that batch are the clean run's: only the bad one was replaced
    first_clean = {row for step, row in full_events.rows if step == 1}
    first_dirty = {row for step, row in events.rows if step == 1}
    assert len(first_clean - first_dirty) == 1 and first_clean - first_dirty == {bad}

    # a resume draws the same replacement rows
    part = tmp_path / "part"
    stopped, _ = _train(dirty, part, stop_after=1, check="sample")
    resumed, resumed_events = _train(dirty, part, resume=True, check="sample")
    assert resumed.step == 3
    assert [r for r in resumed_events.rows if r[0] > 1] == [r for r in events.rows if r[0] > 1]

    # bad_rows: fail stops the run at the drawn row, naming it
    with pytest.raises(TrainingError) as failed:
        _train(dirty, tmp_path / "failed", check="sample", bad_rows="fail")
    assert f"row {bad}: image 0" in str(failed.value) and "bad_rows: fail" in str(failed.value)


def test_auto_checks_a_small_split_whole_and_a_big_one_by_sample(tmp_path, monkeypatch):
    from collage.training import trainer

    monkeypatch.setattr(trainer, "AUTO_FULL_CHECK_ROWS", 40)
    monkeypatch.setattr(trainer, "CHECK_SAMPLE_ROWS", 8)
    small = write_parquet(tmp_path / "small.parquet", 40, group=10, bad=(3,))
    result, events = _train(small, tmp_path / "small")
    assert result.status == "succeeded"
    assert any("1 of 40 rows skipped" in m for _, m in events.events), events.events
    big = write_parquet(tmp_path / "big.parquet", 41, group=10)
    result, events = _train(big, tmp_path / "big", eval_fraction=0.2)
    assert result.status == "succeeded"
    infos = " ".join(m for _, m in events.events)
    assert "rows skipped" not in infos


@pytest.mark.parametrize("check", ["full", "sample"])
def test_a_bad_held_out_row_fails_the_run_whichever_check(tmp_path, monkeypatch, check):
    from collage.training import trainer
    from collage.training.data.heldout import fraction_rows

    monkeypatch.setattr(trainer, "CHECK_SAMPLE_ROWS", 4)
    held = fraction_rows(50, 0.1, 0)
    dirty = write_parquet(tmp_path / "dirty.parquet", 50, group=10, bad=(held[1],))
    with pytest.raises(TrainingError) as failed:
        _train(dirty, tmp_path / "out", check=check, eval_fraction=0.1, train={"eval_on_start": True})
    assert "dataset.eval_fraction: held-out rows fail" in str(failed.value) and str(held[1]) in str(failed.value)


# ------------------------------------------------------------------------------------------ the web side


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
