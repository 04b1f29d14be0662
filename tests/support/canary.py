"""The canary of the equality tests: proof that the model sees the pixels the test compares.

An equality test (a row inside a shuffled batch = the row alone, cached features = features from pixels, a shared
prompt = the row-by-row forward) passes just as well when the model never looks at its images: a tiny Gemma 3 whose
projection from vision to text space was all zeros passed every one of them. So each such test also repaints one
image of one row and checks that this row's log-probs move by a clear margin while no other row's move at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from PIL import ImageOps

from collage.training.data.rows import Sample

# a hundred times the equality tests' tolerance, and below what a seeing model shows: repainting one image of a row
# moves that row's log-probs by 4e-3 or more on every tiny family (the least on a one-token completion), 1e-1 typically
CANARY_MARGIN = 1e-3
TOL = 1e-5


def repaint(sample: Sample, image: int = -1) -> Sample:
    """``sample`` with image ``image`` replaced by its colour negative: the same size (so the same image tokens,
    tiles and patch grid), other pixels."""
    images = list(sample.images)
    images[image] = ImageOps.invert(images[image].convert("RGB"))
    return dataclasses.replace(sample, images=images)


def most_images(samples: list[Sample]) -> int:
    """The index of the row with the most images (the first of them): the one to repaint."""
    return max(range(len(samples)), key=lambda i: (samples[i].num_images, -i))


def assert_only_rows_move(
    before: torch.Tensor, after: torch.Tensor, mask: torch.Tensor, moved: Iterable[int], what: str
) -> None:
    """``before``/``after``: ``(B, C)`` log-probs (or any per-token values) of the same rows before and after the
    pixels of the rows ``moved`` changed; ``mask``: the tokens that count."""
    moved = set(moved)
    diff = ((after.float() - before.float()) * mask.float()).abs().amax(dim=1).tolist()
    for row, d in enumerate(diff):
        if row in moved:
            assert d > CANARY_MARGIN, f"{what}: row {row}'s pixels changed but its log-probs moved by {d:.2e} only"
        else:
            assert d <= TOL, f"{what}: row {row} moved by {d:.2e} when another row's pixels changed"
