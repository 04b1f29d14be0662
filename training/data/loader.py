"""Load a dataset split from any supported source into :class:`RawRow` objects.

Sources, in the order they are tried:

- ``synth:<task>``: a synthetic task, written to disk under ``COLLAGE_HOME`` once and read back through the
  same JSONL path as user data (see :mod:`training.data.synth`); a preview (``limit``) generates only the rows it
  shows, in memory, with the content the written dataset has at those rows;
- a local ``.jsonl`` / ``.parquet`` / ``.csv`` file, or a folder holding ``<split>.jsonl`` / ``<split>.parquet`` /
  ``<split>.csv`` (or ``<split>-*.parquet`` shards); image paths are relative to the file's folder;
- a local snapshot of a Hub dataset repository: ``data/<split>-*.parquet`` (or the files the ``configs:`` of its
  ``README.md`` name for ``config_name`` and the split);
- a ``datasets`` ``save_to_disk`` folder (a ``Dataset`` or a ``DatasetDict`` with that split);
- anything else is treated as a hub dataset id and handed to ``datasets.load_dataset`` (needs internet).

Image paths inside rows are confined to ``data_roots`` (the operator's ``COLLAGE_DATA_ROOTS``; None: unconfined,
the operator's own CLI only) when an image is opened (:mod:`training.images`), and so is every file the loader
opens in a dataset folder (:mod:`training.confine`): the split's files, the only-data-file fallback, a snapshot's
card and data files, a ``save_to_disk`` folder's ``dataset_dict.json`` and each split's ``state.json``,
``dataset_info.json`` and arrow files (``state.json`` names them: a name with a folder in it, ``../`` included, is
refused); a file that leads outside the roots (a symbolic link), or is not a regular file, refuses the dataset
naming the file. A row that cannot even be parsed
(a malformed JSONL line) is a bad row with its file and line, like any other: the rest are still read. Rows from ``datasets`` are read in
its arrow format, so that ``datasets`` never decodes a column itself: an ``Image`` feature would open whatever
path the data names, in any format Pillow knows; Collage opens it instead, confined and raster-only.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from collage.training.infra.images import resolve_roots

from ..confine import file_problem
from .errors import DatasetError, RowError
from .rows import RawRow, Sample
from .rowsource import ArrowRows, ChainRows, JsonlRows, ParquetRows, RowSeq, parse_jsonl_line

Roots = tuple[Path, ...] | None


@dataclass
class LoadedDataset:
    source: str
    split: str
    # a whole split is read on demand (:mod:`training.data.rowsource`): a row is read when asked for, never all
    # of them at once; a preview's first rows (``limit``) and a CSV split are plain lists
    rows: Sequence[RawRow]
    # the local files the rows were read from (for the ``data check`` cache's fingerprint); None: not local
    files: list[Path] | None = field(default=None)
    # the resolved folders image paths are confined to (None: unconfined), part of the check's fingerprint
    roots: Roots = None
    # rows in the split when only the first ones were read (``limit``); None: ``rows`` is the whole split
    total: int | None = None
    mapping: Any = None  # the RowMapping every row is read with (None: TRL's column names)

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


def load_dataset(
    source: str,
    split: str = "train",
    *,
    data_roots: Sequence[Path | str] | None = None,
    limit: int | None = None,
    mapping: Any = None,
    config_name: str | None = None,
    **synth_options: Any,
) -> LoadedDataset:
    """The rows of ``split``. ``data_roots``: the folders every image path of a row must lie under (None:
    unconfined). ``limit``: read only the first rows (a preview); ``total`` then says how many the split has.
    ``mapping``: a :class:`~training.data.mapping.RowMapping` (the config's columns, template, system prompt).
    ``config_name``: the configuration of a Hub dataset (its snapshot's ``README.md`` ``configs:``)."""
    loaded = _load(source, split, data_roots, limit, config_name, synth_options)
    if mapping is not None:
        loaded.mapping = mapping
        if isinstance(loaded.rows, RowSeq):
            loaded.rows.mapping = mapping  # given to each row as it is read
        else:
            for raw in loaded.rows:
                raw.mapping = mapping
    return loaded


def _load(
    source: str,
    split: str,
    data_roots: Sequence[Path | str] | None,
    limit: int | None,
    config_name: str | None,
    synth_options: dict[str, Any],
) -> LoadedDataset:
    if source.startswith("synth:"):
        from .synth import cached_synth_dataset, synth_rows

        task = source.removeprefix("synth:")
        if limit is not None:
            made, count = synth_rows(task, limit, **synth_options)
            return LoadedDataset(source, split, made, total=count)
        folder = cached_synth_dataset(task, **synth_options)
        # Collage wrote it itself under COLLAGE_HOME/cache: its own folder is the root its rows need, whatever
        # COLLAGE_DATA_ROOTS says
        return _load(str(folder), split, [folder], None, None, {})
    roots = resolve_roots(data_roots)
    path = Path(source).expanduser()
    rows: Sequence[RawRow]
    if path.is_file():
        path = _confined(path, roots)
        if limit is None:
            whole = _whole_file(path, roots, 0)
            return _loaded(source, split, whole, [path], roots, len(whole), limit)
        rows, total = _read_file(path, roots, limit)
        return _loaded(source, split, rows, [path], roots, total, limit)
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            saved = _saved_files(path, roots)
            rows, total = _read_saved(path, split, roots, limit)
            return _loaded(source, split, rows, saved, roots, total, limit)
        from .snapshot import SnapshotError, snapshot_files

        if (path / "README.md").exists():
            _confined(path / "README.md", roots)  # the card a snapshot's configurations are read from
        try:
            found = snapshot_files(path, split, config_name) or _split_files(path, split)
        except SnapshotError as exc:
            raise DatasetError(str(exc)) from exc
        files = [_confined(file, roots) for file in found]
        if limit is None:
            rows = _whole_split(files, roots)
            return _loaded(source, split, rows, files, roots, len(rows), limit)
        first: list[RawRow] = []
        total = 0
        for file in files:
            more, count = _read_file(file, roots, limit - len(first), offset=len(first))
            first.extend(more)
            total += count
        return _loaded(source, split, first, files, roots, total, limit)
    if source.startswith((".", "/", "~")) or path.suffix in (".jsonl", ".parquet", ".json", ".csv"):
        raise DatasetError(f"dataset source {source!r} does not exist")
    rows, total = _read_hub(source, split, roots, limit, config_name)
    return _loaded(source, split, rows, None, roots, total, limit)


def split_problem(
    source: str, split: str, *, data_roots: Sequence[Path | str] | None = None, config_name: str | None = None
) -> str | None:
    """Why ``split`` of the local ``source`` cannot be read, or None: decided from the folder's layout alone (its
    file names, a ``save_to_disk`` folder's ``dataset_dict.json``, a snapshot's card), no row is read. Cheap enough
    for a submit: a run whose ``dataset.eval_split`` names no file is refused there, not on the worker. A single
    file has every split; synthetic and hub sources are not probed (a hub id needs the network)."""
    path = Path(source).expanduser()
    if source.startswith("synth:") or not path.is_dir():
        return None
    name = split.split("[", 1)[0]  # validation[:100]: the split is validation
    roots = resolve_roots(data_roots)
    try:
        if (path / "dataset_dict.json").exists():
            listed = _json_file(_confined(path / "dataset_dict.json", roots)).get("splits", [])
            if isinstance(listed, list) and name not in listed:
                return f"{source} has no split {name!r} (splits: {', '.join(map(str, listed)) or 'none'})"
            return None
        if (path / "state.json").exists():
            return None  # one saved Dataset: every split name reads it
        from .snapshot import SnapshotError, snapshot_files

        if (path / "README.md").exists():
            _confined(path / "README.md", roots)
        try:
            snapshot_files(path, name, config_name) or _split_files(path, name)
        except SnapshotError as exc:
            return str(exc)
    except DatasetError as exc:
        return str(exc)
    return None


def _confined(file: Path, roots: Roots) -> Path:
    """``file``, once it is known to resolve under the roots to a regular file; :class:`DatasetError` naming it when
    it leads outside them or is not a regular file. (It stays named as the folder names it: the images its rows
    name are relative to the folder it is in, a link's folder included.)"""
    _, problem = file_problem(file, roots)
    if problem is not None:
        raise DatasetError(f"{file}: {problem}")
    return file


def _saved_files(folder: Path, roots: Roots) -> list[Path]:
    """Every file ``datasets.load_from_disk`` reads in a ``save_to_disk`` folder, each confined: the splits'
    ``state.json`` and ``dataset_info.json``, and the data files ``state.json`` names (plain names: a path in one,
    ``../`` included, would be opened outside the folder)."""
    splits = [folder]
    if (folder / "dataset_dict.json").exists():
        listed = _json_file(_confined(folder / "dataset_dict.json", roots)).get("splits", [])
        if not isinstance(listed, list) or not all(isinstance(n, str) and _plain_name(n) for n in listed):
            raise DatasetError(f"{folder / 'dataset_dict.json'}: its splits must be plain folder names: {listed!r}")
        splits = [folder / name for name in listed]
    files = []
    for split in splits:
        state_file = _confined(split / "state.json", roots)
        files.append(state_file)
        if (split / "dataset_info.json").exists():
            files.append(_confined(split / "dataset_info.json", roots))
        entries = _json_file(state_file).get("_data_files", [])
        names = [e.get("filename") for e in entries if isinstance(e, dict)] if isinstance(entries, list) else None
        plain = [n for n in names or [] if isinstance(n, str) and _plain_name(n)]
        if names is None or len(plain) != len(names):
            raise DatasetError(
                f"{split / 'state.json'}: its _data_files must be plain file names in its folder: {entries!r}"
            )
        files.extend(_confined(split / name, roots) for name in plain)
    return files


def _plain_name(name: str) -> bool:
    return bool(name) and Path(name).name == name and name not in (".", "..") and "\\" not in name


def _json_file(file: Path) -> dict[str, Any]:
    import json

    try:
        loaded = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DatasetError(f"{file}: not a readable JSON file ({exc})") from exc
    if not isinstance(loaded, dict):
        raise DatasetError(f"{file}: not a JSON object")
    return loaded


def _whole_split(files: list[Path], roots: Roots) -> Sequence[RawRow]:
    """Every row of a split's files, read on demand: parquet shards as one sequence (one row-group cache)."""
    if all(file.suffix == ".parquet" for file in files):
        return ParquetRows(files, roots)
    parts: list[Sequence[RawRow]] = []
    offset = 0
    for file in files:
        part = _whole_file(file, roots, offset)
        parts.append(part)
        offset += len(part)
    return parts[0] if len(parts) == 1 else ChainRows(parts)


def _whole_file(file: Path, roots: Roots, offset: int) -> Sequence[RawRow]:
    if file.suffix in (".jsonl", ".json"):
        return JsonlRows(file, roots, offset)
    if file.suffix == ".parquet":
        return ParquetRows([file], roots, offset)
    return _read_file(file, roots, None, offset)[0]  # CSV: paths, not bytes; read whole (quoted cells span lines)


def _loaded(
    source: str,
    split: str,
    rows: Sequence[RawRow],
    files: list[Path] | None,
    roots: Roots,
    total: int,
    limit: int | None,
) -> LoadedDataset:
    return LoadedDataset(source, split, rows, files, roots, total if limit is not None else None)


def _split_files(folder: Path, split: str) -> list[Path]:
    """The file(s) of ``split`` in a folder: ``<split>.jsonl``, ``<split>.parquet``, its shards, or the only one."""
    if Path(split).name != split or split in (".", ".."):  # <split>.jsonl must stay inside the folder
        raise DatasetError(f"split {split!r} is a name like train, not a path")
    candidates = [folder / f"{split}.jsonl", folder / f"{split}.parquet", folder / f"{split}.csv"]
    for file in candidates:
        if file.is_file():
            return [file]
    shards = sorted(folder.glob(f"{split}-*.parquet"))
    if shards:
        return shards
    data_files = sorted([*folder.glob("*.jsonl"), *folder.glob("*.parquet"), *folder.glob("*.csv")])
    if len(data_files) == 1:
        return data_files
    found = ", ".join(p.name for p in data_files) or "no .jsonl, .parquet or .csv file"
    raise DatasetError(
        f"{folder}: no {split}.jsonl, {split}.parquet or {split}.csv for split {split!r} (found: {found})"
    )


def _read_file(file: Path, roots: Roots, limit: int | None, offset: int = 0) -> tuple[list[RawRow], int]:
    """The rows of one data file (the first ``limit``, or all) and how many it holds."""
    if file.suffix == ".jsonl" or file.suffix == ".json":
        return _read_jsonl(file, offset, roots, limit)
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        # buffered, not pre-buffered: the first rows of a file whose row group is huge are read page by page
        parquet = pq.ParquetFile(file, buffer_size=1 << 20, pre_buffer=False)
        total = parquet.metadata.num_rows
        records: list[dict[str, Any]] = []
        wanted = total if limit is None else min(limit, total)
        if wanted > 0:
            for batch in parquet.iter_batches(batch_size=min(wanted, 1024)):
                records.extend(batch.to_pylist()[: wanted - len(records)])
                if len(records) >= wanted:
                    break
        return [RawRow(offset + i, row, file.parent, roots) for i, row in enumerate(records)], total
    if file.suffix == ".csv":
        return _read_csv(file, offset, roots, limit)
    raise DatasetError(f"{file}: unsupported file type {file.suffix!r}; use .jsonl, .parquet or .csv")


def _read_csv(file: Path, offset: int, roots: Roots, limit: int | None) -> tuple[list[RawRow], int]:
    """A CSV with a header row: each cell a string (an image column holds a path relative to the file's folder);
    an empty cell is None (an ``image_3`` left empty on a two-image row is skipped by the column mapping)."""
    rows: list[RawRow] = []
    total = 0
    try:
        with file.open(encoding="utf-8", newline="") as fh:
            reader = csv.DictReader(fh)
            for record in reader:
                total += 1
                if limit is not None and len(rows) >= limit:
                    continue  # counted, not kept
                index = offset + len(rows)
                if None in record:  # more cells than the header has columns
                    extra, columns = len(record[None]), len(reader.fieldnames or [])
                    problem = (
                        f"{file.name} line {reader.line_num}: {extra} cell(s) more than the header's {columns} columns"
                    )
                    rows.append(RawRow(index, {}, file.parent, roots, problem=problem))
                    continue
                data = {k: (v if v != "" else None) for k, v in record.items()}
                rows.append(RawRow(index, data, file.parent, roots))
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{file}: not UTF-8 text") from exc
    except csv.Error as exc:
        raise DatasetError(f"{file}: not a CSV file ({exc})") from exc
    return rows, total


def _read_jsonl(file: Path, offset: int, roots: Roots, limit: int | None) -> tuple[list[RawRow], int]:
    rows: list[RawRow] = []
    with file.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if limit is not None and len(rows) >= limit:
                return rows, len(rows) + (1 if raw.strip() else 0) + _count_rows(fh)
            if not raw.strip():
                continue
            rows.append(parse_jsonl_line(raw, file, line_no, offset + len(rows), roots))
    return rows, len(rows)


def _count_rows(fh: IO[bytes]) -> int:
    """The non-blank lines left in ``fh``, read in chunks (a preview counts the rows it does not parse)."""
    count, blank = 0, True
    while chunk := fh.read(1 << 20):
        parts = chunk.split(b"\n")
        for k, part in enumerate(parts):
            if blank and part.strip():
                blank = False
            if k < len(parts) - 1:  # a newline ends the line
                count += not blank
                blank = True
    return count + (not blank)


def _dataset_rows(loaded: Any, base_dir: Path | None, roots: Roots, limit: int | None) -> tuple[Sequence[RawRow], int]:
    """The rows of a ``datasets.Dataset`` as plain values, read in its arrow format: ``datasets`` never decodes a
    column (an ``Image`` feature stays ``{bytes, path}``, opened later by Collage, confined and raster-only)."""
    rows = ArrowRows(loaded, base_dir, roots)
    if limit is None:
        return rows, len(rows)
    return rows[: min(limit, len(rows))], len(rows)


def _read_saved(folder: Path, split: str, roots: Roots, limit: int | None) -> tuple[Sequence[RawRow], int]:
    import datasets

    loaded = datasets.load_from_disk(str(folder))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"{folder}: no split {split!r} (splits: {', '.join(loaded)})")
        loaded = loaded[split]
    return _dataset_rows(loaded, folder, roots, limit)


def _read_hub(
    source: str, split: str, roots: Roots, limit: int | None, config_name: str | None
) -> tuple[Sequence[RawRow], int]:
    import datasets

    try:
        loaded = datasets.load_dataset(source, config_name, split=split)
    except Exception as exc:  # the hub client raises many types; the user needs the source and the reason
        raise DatasetError(f"dataset {source!r} is neither a local path nor a loadable hub dataset: {exc}") from exc
    return _dataset_rows(loaded, None, roots, limit)
