"""Which training rows each generation batch takes: a seeded permutation of the rows per epoch, the same on every
process, each process taking its own slice; after a sample check (``dataset.check``), a drawn row the check did not
cover is checked when drawn, and a bad one is replaced by a row from a seeded stream."""

from __future__ import annotations

import random
from typing import Literal

import torch

from .batching.encoding import PromptEncoder
from .data.errors import RowError
from .data.loader import LoadedDataset
from .data.rows import RawRow, Sample
from .training_error import TrainingError

MAX_REDRAWS = 100  # a drawn row that fails its check is replaced; this many bad in a row stops the run


class DrawCheck:
    """The check of ``collage data check`` on drawn rows that the set-up's sample check did not cover.

    ``checked``: rows a batch may draw without checking them again (grows as drawn rows pass). ``bad``: rows known
    to be bad (skipped by the set-up's check, or found bad when drawn). ``bad_rows``: ``dataset.bad_rows``, whether a
    bad drawn row is skipped (and reported by :meth:`take_warnings`) or fails the run.
    """

    def __init__(
        self,
        encoder: PromptEncoder,
        checked: set[int],
        bad: set[int],
        bad_rows: Literal["skip", "fail"],
        source: str,
    ):
        self.encoder = encoder
        self.checked = checked
        self.bad = bad
        self.bad_rows = bad_rows
        self.source = source
        self._warnings: list[str] = []

    def sample(self, raw: RawRow) -> Sample | None:
        """``raw``'s sample, or None when the row is bad (known, or found now)."""
        if raw.row in self.checked:
            return raw.to_sample()
        if raw.row in self.bad:
            return None
        from .data.check import checked_sample

        try:
            sample, _ = checked_sample(raw, self.encoder)
        except RowError as err:
            self._bad_row_drawn(err)
            return None
        self.checked.add(raw.row)
        return sample

    def _bad_row_drawn(self, err: RowError) -> None:
        if self.bad_rows == "fail":
            raise TrainingError(
                f"dataset {self.source}: a drawn row fails `collage data check` (dataset.bad_rows: fail): {err}"
            )
        self.bad.add(err.row)
        self._warnings.append(
            f"dataset {self.source}: skipped when drawn (dataset.bad_rows: skip), another row taken instead: {err}"
        )

    def take_warnings(self) -> list[str]:
        """The bad rows drawn since the last call, as warning messages (this process's only)."""
        warnings, self._warnings = self._warnings, []
        return warnings


class DataOrder:
    """This process's prompts for each generation batch, in the run's seeded data order.

    ``position``: the prompts consumed from the (infinite, seeded) data order, all processes together; a
    checkpoint keeps it, so a resumed run draws what the uninterrupted run would have drawn. ``check``: the draw-time
    check after a sample check; None when the set-up checked every row.
    """

    def __init__(
        self,
        dataset: LoadedDataset,
        seed: int,
        prompts_per_process: int,
        world: int,
        rank: int,
        check: DrawCheck | None,
    ):
        self.dataset = dataset
        self.seed = seed
        self.prompts_per_process = prompts_per_process
        self.world = world
        self.rank = rank
        self.check = check
        self.position = 0
        # (epoch, that epoch's permutation of row indices)
        self._perm: tuple[int, torch.Tensor] = (-1, torch.zeros(0, dtype=torch.long))

    def next_prompts(self) -> list[Sample]:
        """This process's prompts for the next generation batch; the order is a seeded permutation per epoch,
        identical on every process, and each process takes its own slice."""
        per_process = self.prompts_per_process
        total = per_process * self.world
        n = len(self.dataset)
        indices = []
        for pos in range(self.position, self.position + total):
            epoch, offset = divmod(pos, n)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            if self._perm[0] != epoch:
                self._perm = (epoch, torch.randperm(n, generator=g))  # a tensor: 8 bytes a row, not a list
            indices.append(int(self._perm[1][offset]))
        start, self.position = self.position, self.position + total
        mine = indices[self.rank * per_process : (self.rank + 1) * per_process]
        return [self._drawn(i, start, slot) for slot, i in enumerate(mine)]

    def _drawn(self, index: int, start: int, slot: int) -> Sample:
        """The sample of drawn row ``index``. After a sample check, a row the check did not cover is checked now:
        a bad one fails the run (``dataset.bad_rows: fail``) or is replaced by a row drawn from a stream seeded by
        ``train.seed``, the batch's position, the process and the slot, so every process keeps its place in the
        shared order and a resume draws the same replacements."""
        raw = self.dataset.rows[index]
        if self.check is None:
            return raw.to_sample()
        for attempt in range(1, MAX_REDRAWS + 1):
            sample = self.check.sample(raw)
            if sample is not None:
                return sample
            seed = f"redraw:{self.seed}:{start}:{self.rank}:{slot}:{attempt}"
            raw = self.dataset.rows[random.Random(seed).randrange(len(self.dataset))]
        raise TrainingError(
            f"dataset {self.dataset.source}: {MAX_REDRAWS} rows drawn in a row fail `collage data check` "
            f"({len(self.check.bad)} bad rows found so far); run `collage data check` on it"
        )

    def take_draw_warnings(self) -> list[str]:
        """The bad rows this process drew since the last call (none without a draw-time check)."""
        return [] if self.check is None else self.check.take_warnings()
