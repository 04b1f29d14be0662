"""Rows read on demand: a dataset split as a sequence whose rows are read when asked for, never all at once.

A 1,000,000-row parquet file with inline image bytes holds far more than memory; the trainer needs only the few
rows of each generation batch, in its seeded order. So a split is a :class:`RowSeq`:

- :class:`ParquetRows`: parquet files (one, or the shards of a split), read a row group at a time, with a small
  cache bounded in bytes. A row group too big for that cache is streamed in small batches up to the row asked for.
- :class:`JsonlRows`: a JSONL file, indexed once by the byte offset of each line (16 bytes a row), each line read
  and parsed when asked for; a malformed line is a bad row naming its file and line, as before.
- :class:`ArrowRows`: a ``datasets`` ``Dataset`` (``save_to_disk`` or the Hub), memory-mapped arrow, sliced a row
  at a time (never decoded by ``datasets``: see :mod:`training.data.loader`).
- :class:`ChainRows`: several sequences one after another (a split in shards of different kinds).
- :class:`ExcludingView`: another sequence without some of its rows (the training rows once held-out and bad rows
  are taken out), costing 8 bytes per row taken out;
- :class:`RowView`: some rows of another sequence (a check's sample, the evaluated held-out rows), by position.

Every row keeps its index in the split (:attr:`RawRow.row`), whatever view it is reached through. What stays in
memory per row is an integer or two (offsets, positions), never the row.
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from .rows import RawRow

Roots = tuple[Path, ...] | None

# decoded row groups kept for the next rows: a generation batch draws rows at random, and neighbouring rows of a
# group are often drawn by the next batches or read in order by a check
GROUP_CACHE_BYTES = 32 << 20
STREAM_BATCH = 64  # rows per batch when a row group is too big to hold: streamed up to the row asked for
OPEN_FILES = 8  # parquet files kept open (their parsed footers), the most recently read


class RowSeq(Sequence[RawRow]):
    """A split's rows by position. ``mapping`` (a :class:`~training.data.mapping.RowMapping`, set by the loader)
    is given to every row read."""

    mapping: Any = None

    def __len__(self) -> int:
        raise NotImplementedError

    def _get(self, i: int) -> RawRow:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> RawRow: ...

    @overload
    def __getitem__(self, i: slice) -> list[RawRow]: ...

    def __getitem__(self, i: int | slice) -> RawRow | list[RawRow]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        k = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= k < n:
            raise IndexError(f"row {i} of {n}")
        raw = self._get(k)
        if raw.mapping is None:
            raw.mapping = self.mapping
        return raw

    def __iter__(self) -> Iterator[RawRow]:
        for k in range(len(self)):
            yield self[k]

    def row_ids(self) -> np.ndarray:
        """The split index of every row, in order (a base sequence: 0..n-1 after its offset)."""
        raise NotImplementedError

    def positions_of(self, ids: np.ndarray) -> np.ndarray:
        """The positions of the rows whose split index is in ``ids`` (sorted, unique); ids not here are left out.
        This generic one reads every index (a base sequence or an exclusion view knows them without)."""
        every = self.row_ids()
        at = np.searchsorted(every, ids)
        found = (at < len(every)) & (every[np.minimum(at, len(every) - 1)] == ids) if len(every) else at < 0
        return at[found]


class _Contiguous(RowSeq):
    """A base sequence: its rows are split indices ``offset`` .. ``offset + len - 1``."""

    offset = 0

    def row_ids(self) -> np.ndarray:
        return np.arange(self.offset, self.offset + len(self), dtype=np.int64)

    def positions_of(self, ids: np.ndarray) -> np.ndarray:
        at = ids - self.offset
        return at[(at >= 0) & (at < len(self))]


def row_ids(rows: Sequence[RawRow]) -> np.ndarray:
    """The split index of every row of ``rows`` without reading a lazy sequence's rows."""
    if isinstance(rows, RowSeq):
        return rows.row_ids()
    return np.fromiter((raw.row for raw in rows), dtype=np.int64, count=len(rows))


def positions_of(rows: Sequence[RawRow], ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The positions in ``rows`` of the rows whose split index is in ``ids`` (those present), ascending."""
    wanted = np.unique(np.asarray(ids, dtype=np.int64))
    if isinstance(rows, RowSeq):
        return rows.positions_of(wanted)
    where = {raw.row: p for p, raw in enumerate(rows)}
    return np.asarray(sorted(where[r] for r in wanted.tolist() if r in where), dtype=np.int64)


class ExcludingView(RowSeq):
    """``base`` without the rows at positions ``excluded``: what it keeps costs 8 bytes per excluded row, not per
    row (the training rows of a million-row split without its held-out and bad rows)."""

    def __init__(self, base: Sequence[RawRow], excluded: Sequence[int] | np.ndarray):
        self.base = base
        self.excluded = np.unique(np.asarray(excluded, dtype=np.int64))
        # the kept rows before each excluded one: position p of the view is base position p + (excluded before it)
        self._kept_before = self.excluded - np.arange(len(self.excluded), dtype=np.int64)
        self.mapping = getattr(base, "mapping", None)

    def __len__(self) -> int:
        return len(self.base) - len(self.excluded)

    def base_position(self, p: int) -> int:
        return p + int(np.searchsorted(self._kept_before, p, side="right"))

    def _get(self, i: int) -> RawRow:
        return self.base[self.base_position(i)]

    def row_ids(self) -> np.ndarray:
        keep = np.ones(len(self.base), dtype=bool)
        keep[self.excluded] = False
        return row_ids(self.base)[keep]

    def positions_of(self, ids: np.ndarray) -> np.ndarray:
        at = positions_of(self.base, ids)
        at = at[~np.isin(at, self.excluded)]
        return at - np.searchsorted(self.excluded, at)


class RowView(RowSeq):
    """The rows of ``base`` at ``positions`` (positions into ``base``, in this order)."""

    def __init__(self, base: Sequence[RawRow], positions: Sequence[int] | np.ndarray):
        self.base = base
        self.positions = np.asarray(positions, dtype=np.int64)
        self.mapping = getattr(base, "mapping", None)

    def __len__(self) -> int:
        return len(self.positions)

    def _get(self, i: int) -> RawRow:
        return self.base[int(self.positions[i])]

    def row_ids(self) -> np.ndarray:
        if isinstance(self.base, _Contiguous):
            return self.base.offset + self.positions
        return row_ids(self.base)[self.positions]


class ChainRows(_Contiguous):
    """Several sequences one after another; each one's rows already carry their index in the whole split (the
    first part's start at 0)."""

    def __init__(self, parts: Sequence[Sequence[RawRow]]):
        self.parts = [p for p in parts if len(p)]
        self.starts = [0]
        for part in self.parts:
            self.starts.append(self.starts[-1] + len(part))

    def __len__(self) -> int:
        return self.starts[-1]

    def _get(self, i: int) -> RawRow:
        k = bisect.bisect_right(self.starts, i) - 1
        raw = self.parts[k][i - self.starts[k]]
        return raw

    def __iter__(self) -> Iterator[RawRow]:
        for part in self.parts:
            for raw in part:
                if raw.mapping is None:
                    raw.mapping = self.mapping
                yield raw


class ParquetRows(_Contiguous):
    """The rows of parquet ``files`` (the shards of one split, in order), the first at split index ``offset``.
    Only each file's metadata is read up front."""

    def __init__(self, files: Sequence[Path], roots: Roots, offset: int = 0):
        import pyarrow.parquet as pq

        self.files = list(files)
        self.roots = roots
        self.offset = offset
        starts = [0]
        self._groups: list[tuple[int, int, int]] = []  # (file, row group, uncompressed bytes)
        self._open: OrderedDict[tuple[int, bool], Any] = OrderedDict()  # (file, streamed) -> ParquetFile
        for f, file in enumerate(self.files):
            opened = pq.ParquetFile(file)
            if f < OPEN_FILES:  # the first files' footers, parsed already, kept for their first reads
                self._open[(f, False)] = opened
            meta = opened.metadata
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                if group.num_rows:
                    self._groups.append((f, g, group.total_byte_size))
                    starts.append(starts[-1] + group.num_rows)
        self._starts = np.asarray(starts, dtype=np.int64)
        self._cache: OrderedDict[int, Any] = OrderedDict()  # group -> pyarrow Table
        self._cached_bytes = 0
        self.group_reads = 0  # row groups read from disk (a test and the benchmark look at it)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _file(self, f: int, streamed: bool = False) -> Any:
        """File ``f`` opened for whole row groups (``streamed``: for batches read in order, buffered page by page,
        never a whole column chunk at once). Kept open: a file's footer can be megabytes (a million rows in 2,000
        groups, with statistics: 8 MB, 40 ms to parse), read once, not once per row."""
        import pyarrow.parquet as pq

        key = (f, streamed)
        opened = self._open.get(key)
        if opened is None:
            metadata = self._open[(f, not streamed)].metadata if (f, not streamed) in self._open else None
            options: dict[str, Any] = {"buffer_size": 1 << 20, "pre_buffer": False} if streamed else {}
            opened = pq.ParquetFile(self.files[f], metadata=metadata, **options)
            self._open[key] = opened
            while len(self._open) > OPEN_FILES:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(key)
        return opened

    def _get(self, i: int) -> RawRow:
        g = int(np.searchsorted(self._starts, i, side="right")) - 1
        k = i - int(self._starts[g])
        f, group, size = self._groups[g]
        table = self._cache.get(g)
        if table is not None:
            self._cache.move_to_end(g)
        elif size > GROUP_CACHE_BYTES:  # too big to hold: stream batches up to the row
            record = self._streamed(f, group, k)
            return RawRow(self.offset + i, record, self.files[f].parent, self.roots, self.mapping)
        else:
            table = self._file(f).read_row_group(group)
            self.group_reads += 1
            self._cache[g] = table
            self._cached_bytes += table.nbytes
            while self._cached_bytes > GROUP_CACHE_BYTES and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.nbytes
        record = table.slice(k, 1).to_pylist()[0]
        return RawRow(self.offset + i, record, self.files[f].parent, self.roots, self.mapping)

    def _streamed(self, f: int, group: int, k: int) -> dict[str, Any]:
        self.group_reads += 1
        seen = 0
        for batch in self._file(f, streamed=True).iter_batches(batch_size=STREAM_BATCH, row_groups=[group]):
            if k < seen + batch.num_rows:
                return batch.slice(k - seen, 1).to_pylist()[0]
            seen += batch.num_rows
        raise IndexError(f"row {k} of row group {group} of {self.files[f]}")

    def __iter__(self) -> Iterator[RawRow]:
        """Every row in order, a batch at a time (what a full check reads): memory bounded by one batch."""
        index = self.offset
        for f in range(len(self.files)):
            for batch in self._file(f, streamed=True).iter_batches(batch_size=256):
                for record in batch.to_pylist():
                    yield RawRow(index, record, self.files[f].parent, self.roots, self.mapping)
                    index += 1


class JsonlRows(_Contiguous):
    """The rows of a JSONL file, the first at split index ``offset``: blank lines are not rows, and a line that is
    not a JSON object is a bad row naming the file and line."""

    def __init__(self, file: Path, roots: Roots, offset: int = 0):
        self.file = file
        self.roots = roots
        self.offset = offset
        offsets, lines = [], []
        position = 0
        with file.open("rb") as fh:
            for line_no, raw in enumerate(fh, start=1):
                if raw.strip():
                    offsets.append(position)
                    lines.append(line_no)
                position += len(raw)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._lines = np.asarray(lines, dtype=np.int64)
        self._fh: Any = None

    def __len__(self) -> int:
        return len(self._offsets)

    def _get(self, i: int) -> RawRow:
        if self._fh is None or self._fh.closed:
            self._fh = self.file.open("rb")
        self._fh.seek(int(self._offsets[i]))
        return parse_jsonl_line(self._fh.readline(), self.file, int(self._lines[i]), self.offset + i, self.roots)

    def __iter__(self) -> Iterator[RawRow]:
        with self.file.open("rb") as fh:
            k = 0
            for raw in fh:
                if raw.strip():
                    row = parse_jsonl_line(raw, self.file, int(self._lines[k]), self.offset + k, self.roots)
                    row.mapping = self.mapping
                    yield row
                    k += 1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fh": None}


def parse_jsonl_line(raw: bytes, file: Path, line_no: int, index: int, roots: Roots) -> RawRow:
    """One JSONL line as a row; a line that cannot be read is a bad row naming its file and line."""
    where = f"{file.name} line {line_no}"
    problem = None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        problem = f"{where} is not UTF-8 text"
    except json.JSONDecodeError as exc:
        problem = f"{where} is not valid JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:
        problem = f"{where} is nested too deeply to read"
    else:
        if not isinstance(data, dict):
            problem = f"{where} is a JSON {type(data).__name__}, not an object"
    if problem is not None:
        return RawRow(index, {}, file.parent, roots, problem=problem)
    return RawRow(index, data, file.parent, roots)


class ArrowRows(_Contiguous):
    """The rows of a ``datasets.Dataset`` in its arrow format (memory-mapped; ``datasets`` never decodes a column:
    an ``Image`` feature stays ``{bytes, path}``, opened later by Collage, confined and raster-only)."""

    def __init__(self, dataset: Any, base_dir: Path | None, roots: Roots):
        self.table = dataset.with_format("arrow")
        self.base_dir = base_dir
        self.roots = roots

    def __len__(self) -> int:
        return len(self.table)

    def _get(self, i: int) -> RawRow:
        record = self.table[i : i + 1].to_pylist()[0]
        return RawRow(i, record, self.base_dir, self.roots, self.mapping)

    def __iter__(self) -> Iterator[RawRow]:
        for start in range(0, len(self), 1024):
            for k, record in enumerate(self.table[start : start + 1024].to_pylist()):
                yield RawRow(start + k, record, self.base_dir, self.roots, self.mapping)
