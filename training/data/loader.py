"""Load a dataset split from any supported source into :class:`RawRow` objects.

Sources, in the order they are tried:

- ``synth:<task>``: a synthetic task, written to disk under ``COLLAGE_HOME`` once and read back through the
  same JSONL path as user data (see :mod:`training.data.synth`);
- a local ``.jsonl`` / ``.parquet`` file, or a folder holding ``<split>.jsonl`` / ``<split>.parquet`` (or
  ``<split>-*.parquet`` shards); image paths are relative to the file's folder;
- a ``datasets`` ``save_to_disk`` folder (a ``Dataset`` or a ``DatasetDict`` with that split);
- anything else is treated as a hub dataset id and handed to ``datasets.load_dataset`` (needs internet).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CollageError
from .rows import RawRow, RowError, Sample


class DatasetError(CollageError, ValueError):
    """The dataset cannot be used; ``errors`` lists every bad row when that is the reason."""

    def __init__(self, message: str, errors: list[RowError] | None = None):
        self.errors = errors or []
        if self.errors:
            shown = "\n".join(f"  {e}" for e in self.errors[:20])
            more = f"\n  ... and {len(self.errors) - 20} more" if len(self.errors) > 20 else ""
            message = f"{message}\n{shown}{more}"
        super().__init__(message)


@dataclass
class LoadedDataset:
    source: str
    split: str
    rows: list[RawRow]
    # the local files the rows were read from (for the ``data check`` cache's fingerprint); None: not local
    files: list[Path] | None = field(default=None)

    def __len__(self) -> int:
        return len(self.rows)

    def samples(self) -> Iterator[Sample | RowError]:
        """Every row as a :class:`Sample`, or the :class:`RowError` that makes it unusable."""
        for raw in self.rows:
            try:
                yield raw.to_sample()
            except RowError as err:
                yield err

    def load_all(self) -> list[Sample]:
        """All rows as samples; raises :class:`DatasetError` listing every bad row (nothing is skipped)."""
        good: list[Sample] = []
        bad: list[RowError] = []
        for item in self.samples():
            if isinstance(item, RowError):
                bad.append(item)
            else:
                good.append(item)
        if bad:
            raise DatasetError(f"{self.source}: {len(bad)} of {len(self.rows)} rows are unusable", bad)
        return good


def load_dataset(source: str, split: str = "train", **synth_options: Any) -> LoadedDataset:
    if source.startswith("synth:"):
        from .synth import cached_synth_dataset

        return load_dataset(str(cached_synth_dataset(source.removeprefix("synth:"), **synth_options)), split)
    path = Path(source).expanduser()
    if path.is_file():
        return LoadedDataset(source, split, _read_file(path), [path])
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            saved = sorted(p for p in path.rglob("*") if p.is_file())
            return LoadedDataset(source, split, _read_saved(path, split), saved)
        files = _split_files(path, split)
        rows: list[RawRow] = []
        for file in files:
            rows.extend(_read_file(file, offset=len(rows)))
        return LoadedDataset(source, split, rows, files)
    if source.startswith((".", "/", "~")) or path.suffix in (".jsonl", ".parquet", ".json"):
        raise DatasetError(f"dataset source {source!r} does not exist")
    return LoadedDataset(source, split, _read_hub(source, split))


def _split_files(folder: Path, split: str) -> list[Path]:
    """The file(s) of ``split`` in a folder: ``<split>.jsonl``, ``<split>.parquet``, its shards, or the only one."""
    if Path(split).name != split or split in (".", ".."):  # <split>.jsonl must stay inside the folder
        raise DatasetError(f"split {split!r} is a name like train, not a path")
    candidates = [folder / f"{split}.jsonl", folder / f"{split}.parquet"]
    for file in candidates:
        if file.is_file():
            return [file]
    shards = sorted(folder.glob(f"{split}-*.parquet"))
    if shards:
        return shards
    data_files = sorted([*folder.glob("*.jsonl"), *folder.glob("*.parquet")])
    if len(data_files) == 1:
        return data_files
    found = ", ".join(p.name for p in data_files) or "no .jsonl or .parquet file"
    raise DatasetError(f"{folder}: no {split}.jsonl or {split}.parquet for split {split!r} (found: {found})")


def _read_file(file: Path, offset: int = 0) -> list[RawRow]:
    if file.suffix == ".jsonl" or file.suffix == ".json":
        return _read_jsonl(file, offset)
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(file)
        return [RawRow(offset + i, row, file.parent) for i, row in enumerate(table.to_pylist())]
    raise DatasetError(f"{file}: unsupported file type {file.suffix!r}; use .jsonl or .parquet")


def _read_jsonl(file: Path, offset: int) -> list[RawRow]:
    rows: list[RawRow] = []
    with file.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            index = offset + len(rows)
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{file}:{line_no}: row {index} is not valid JSON ({exc.msg})") from None
            if not isinstance(data, dict):
                raise DatasetError(f"{file}:{line_no}: row {index} is not a JSON object")
            rows.append(RawRow(index, data, file.parent))
    return rows


def _read_saved(folder: Path, split: str) -> list[RawRow]:
    import datasets

    loaded = datasets.load_from_disk(str(folder))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"{folder}: no split {split!r} (splits: {', '.join(loaded)})")
        loaded = loaded[split]
    return [RawRow(i, dict(row), folder) for i, row in enumerate(loaded)]


def _read_hub(source: str, split: str) -> list[RawRow]:
    import datasets

    try:
        loaded = datasets.load_dataset(source, split=split)
    except Exception as exc:  # the hub client raises many types; the user needs the source and the reason
        raise DatasetError(f"dataset {source!r} is neither a local path nor a loadable hub dataset: {exc}") from exc
    return [RawRow(i, dict(row), None) for i, row in enumerate(loaded)]
