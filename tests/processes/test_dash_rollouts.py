"""A rollout row's dataset columns (issue 13) on their way out of the trainer: into the output folder's
samples.jsonl and into the worker's store callback rows, and a row pickled before rows had columns still
serialises."""

from __future__ import annotations

import json

from PIL import Image

from collage.training.callbacks import COLUMN_TEXT_MAX, RolloutImage, RolloutRow

LONG = "x" * (COLUMN_TEXT_MAX + 50)


def _row(**changes) -> RolloutRow:
    image = RolloutImage(None, None, 20, 20, image=Image.new("RGB", (20, 20), (200, 0, 0)))
    values = dict(step=1, group=0, index=0, prompt="p", completion="c", images=[image], rewards={"accuracy": 1.0},
                  reward=1.0, advantage=0.5, completion_length=3, truncated=False, row=4,
                  columns={"answer": "2", "task": "count-red", "images_meta": [1, 2], "long": LONG})  # fmt: skip
    values.update(changes)
    return RolloutRow(**values)


def test_rollout_rows_carry_columns_to_the_output_folder_and_the_store_callback(tmp_path):
    from collage.training.output import OutputFolder
    from collage.worker.store_callback import _sample_in

    row = _row()
    assert row.columns == {"answer": "2", "task": "count-red", "long": "x" * COLUMN_TEXT_MAX + "…"}
    folder = OutputFolder(tmp_path)
    folder.images.mkdir(parents=True)  # (on_start needs a whole run config: the rows are written directly)
    folder._write_samples([row])
    record = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    assert record["columns"] == row.columns and record["dataset_row"] == 4
    sample = _sample_in(row)
    assert sample.columns == row.columns and sample.dataset_row == 4
    # a row pickled by an older version (a checkpoint's generation buffer) has no columns: it still serialises
    state = dict(row.__dict__)
    del state["columns"]
    old = RolloutRow.__new__(RolloutRow)
    old.__setstate__(state)
    assert old.to_json()["columns"] == {}
