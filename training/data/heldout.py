"""Held-out rows for evaluation during training (``dataset.eval_split``, ``eval_source``, ``eval_fraction``).

- ``eval_split``: another split of the training source (``test`` of a ``DatasetDict``, ``test.jsonl`` beside
  ``train.jsonl``, a hub split). For a synthetic source (``synth:<task>``) the same task generated from another
  seed, derived from ``dataset.seed`` and the split's name.
- ``eval_source`` (with ``eval_split`` as its split, default ``train``): another dataset, read and confined like
  the training source; a synthetic one is generated from a derived seed too, never the training seed.
- ``eval_fraction``: a deterministic slice of the training split, chosen by ``dataset.seed`` alone (the same rows
  for every run of that dataset and seed, whatever ``train.seed``), removed from the rows the trainer samples
  from: it is never trained on.

``eval_max_rows`` keeps the first rows of the held-out set. Synthetic held-out rows whose content equals a
training row's (a text-only sum can come out of both seeds) are left out, so evaluation never scores a row the
policy trained on.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import DatasetSettings
from .errors import DatasetError
from .loader import LoadedDataset, load_dataset
from .rows import RawRow
from .rowsource import ExcludingView, RowView, positions_of, row_ids


@dataclass
class HeldOut:
    """The rows an evaluation scores: ``positions`` into ``loaded`` (the dataset they were read from, which the
    data check covers whole, so its cached report is found again), in order."""

    loaded: LoadedDataset  # eval_fraction: the whole training split
    positions: list[int]
    key: str  # the config key that named them, for messages ("dataset.eval_split", ...)
    description: str  # what they are, in the user's terms
    # eval_fraction: every row of the training split held out (the evaluated ones are the first of them); else None
    held_rows: list[int] | None = None
    dropped: list[int] = field(default_factory=list)  # synthetic rows left out: equal to a training row

    @property
    def rows(self) -> RowView:
        """The evaluated rows, each read when asked for."""
        return RowView(self.loaded.rows, self.positions)

    @property
    def row_ids(self) -> list[int]:
        """The split index of each evaluated row, without reading the rows."""
        return [int(r) for r in row_ids(self.loaded.rows)[self.positions]] if self.positions else []

    def __len__(self) -> int:
        return len(self.positions)


def fraction_rows(n: int, fraction: float, seed: int) -> list[int]:
    """The rows of an ``n``-row split that ``eval_fraction`` holds out: ``round(fraction * n)`` of them (at least one),
    drawn by a generator seeded with ``dataset.seed`` alone, in ascending order."""
    k = min(n, max(1, round(fraction * n)))
    return sorted(random.Random(f"eval_fraction:{seed}").sample(range(n), k))


def synth_eval_seed(seed: int, split: str) -> int:
    """The seed a synthetic task's held-out split ``split`` is generated from: derived from ``dataset.seed`` and the
    split's name, so it differs from the training seed and between splits, and is the same on every machine."""
    digest = hashlib.sha256(f"collage-eval:{seed}:{split}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def content_key(row: RawRow) -> str:
    """A row's content as written (prompt, image references, answer and every other column): two rows of Collage's
    synthetic datasets with the same key are the same row, since their image files are named by content hash."""
    return json.dumps(row.data, sort_keys=True, default=repr)


def training_rows(dataset: LoadedDataset, held: Sequence[int]) -> LoadedDataset:
    """``dataset`` without the rows ``held`` (by row index): what the trainer samples from. Rows keep their index
    in the split, so rollout rows and the held-out list name the same rows."""
    rows = ExcludingView(dataset.rows, positions_of(dataset.rows, held))  # a million-row split stays on disk
    return LoadedDataset(dataset.source, dataset.split, rows, dataset.files, dataset.roots, dataset.total,
                         dataset.mapping)  # fmt: skip


def load_heldout(
    settings: DatasetSettings,
    train: LoadedDataset,
    max_rows: int | None = None,
    data_roots: Sequence[Path] | None = None,
) -> HeldOut | None:
    """The held-out rows ``settings`` name (None when they name none); :class:`DatasetError` when they cannot be read.
    ``train`` is the whole training split (before ``eval_fraction`` removes anything)."""
    if settings.eval_fraction is not None:
        held = fraction_rows(len(train), settings.eval_fraction, settings.seed)
        picked = held[:max_rows] if max_rows is not None else held
        what = (
            f"{len(held)} of the {len(train)} rows of {train.source} split {train.split!r} "
            f"(eval_fraction {settings.eval_fraction}, chosen by dataset.seed {settings.seed})"
        )
        return HeldOut(train, picked, "dataset.eval_fraction", what, held_rows=held)
    if settings.eval_source is not None:
        source, split, key = settings.eval_source, settings.eval_split or "train", "dataset.eval_source"
    elif settings.eval_split is not None:
        source, split, key = settings.source, settings.eval_split, "dataset.eval_split"
    else:
        return None
    if source.startswith("synth:"):
        return _synthetic(settings, source, split, key, train, max_rows)
    from .mapping import RowMapping

    same_source = settings.eval_source is None
    dataset = load_dataset(source, split, data_roots=data_roots, limit=max_rows, mapping=RowMapping.of(settings),
                           config_name=settings.config_name if same_source else None)  # fmt: skip
    if len(dataset) == 0:
        raise DatasetError(f"{source} split {split!r} has no rows")
    return HeldOut(dataset, list(range(len(dataset))), key, f"{len(dataset)} rows of {source} split {split!r}")


def _synthetic(
    settings: DatasetSettings, source: str, split: str, key: str, train: LoadedDataset, max_rows: int | None
) -> HeldOut:
    seed = synth_eval_seed(settings.seed, split)
    rows = min(settings.rows, max_rows) if max_rows is not None else settings.rows
    options: dict[str, Any] = dict(rows=rows, min_images=settings.min_images, max_images=settings.max_images, seed=seed)
    from .mapping import RowMapping

    generated = load_dataset(source, split, mapping=RowMapping.of(settings), **options)
    seen = {content_key(raw) for raw in train.rows}
    kept = [p for p, raw in enumerate(generated.rows) if content_key(raw) not in seen]
    dropped = [raw.row for raw in generated.rows if content_key(raw) in seen]
    if not kept:
        raise DatasetError(f"{source} split {split!r}: every one of its {len(generated)} rows is also a training row")
    what = f"{len(kept)} rows of {source} generated from seed {seed} (split {split!r} of dataset.seed {settings.seed})"
    return HeldOut(generated, kept, key, what, dropped=dropped)
