"""Large datasets read on demand, on real files: a parquet split a row group at a time (shards of a split as one
sequence, held-out and bad rows out as views by position), and a JSONL split by line offsets, a bad line staying a
bad row."""

from __future__ import annotations

from collage.training.data.heldout import training_rows
from collage.training.data.loader import load_dataset
from collage.training.data.rowsource import JsonlRows, ParquetRows
from tests.support.datasets import write_parquet


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
