"""Property tests: split / re-join / slice of pixel tensors, for every layout, random image counts and sizes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collage.training.batching.layouts import join_pixels, select_pixels, slice_pixels, split_pixels
from collage.training.models.families import BATCH_PADDED, GRID, IMAGE_INDEXED

counts = st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=6)


def _grid_sample(n: int, seed: int):
    """One sample's grid pixels: every image a distinct (t, h, w) and rows filled with unique values."""
    if n == 0:
        return {}
    g = torch.Generator().manual_seed(seed)
    grids = torch.stack(
        [
            torch.tensor(
                [1, 2 * int(torch.randint(1, 4, (1,), generator=g)), 2 * int(torch.randint(1, 4, (1,), generator=g))]
            )
            for _ in range(n)
        ]
    )
    rows = int(grids.prod(-1).sum())
    return {"pixel_values": torch.randn(rows, 6, generator=g), "image_grid_thw": grids}


def _indexed_sample(n: int, seed: int, patches: bool):
    if n == 0:
        return {}
    g = torch.Generator().manual_seed(seed)
    if patches:  # anyres (LLaVA-NeXT/OneVision): a different patch count per image, the processor zero-pads a
        # sample's images to its largest count and the join pads across samples
        per_image = [int(torch.randint(1, 5, (1,), generator=g)) for _ in range(n)]
        values = torch.zeros(n, max(per_image), 3, 4, 4)
        for i, p in enumerate(per_image):
            values[i, :p] = torch.randn(p, 3, 4, 4, generator=g)
        return {"pixel_values": values, "image_sizes": torch.randint(1, 50, (n, 2), generator=g)}
    return {"pixel_values": torch.randn(n, 3, 4, 4, generator=g)}


def _padded_sample(n: int, seed: int):
    """Idefics3/SmolVLM with image splitting: each image is 1..5 tiles (crops + a global view), so a sample
    holds more entries than images; a tile's mask covers only its valid area (never empty)."""
    if n == 0:
        return {}
    g = torch.Generator().manual_seed(seed)
    tiles = sum(int(torch.randint(1, 6, (1,), generator=g)) for _ in range(n))
    mask = torch.zeros(tiles, 4, 4, dtype=torch.bool)
    for t in range(tiles):
        h, w = (int(torch.randint(1, 5, (1,), generator=g)) for _ in range(2))
        mask[t, :h, :w] = True
    return {"pixel_values": torch.randn(tiles, 3, 4, 4, generator=g), "pixel_attention_mask": mask}


def _make(layout: str, nums: list[int], patches: bool = False):
    if layout == GRID:
        return [_grid_sample(n, i) for i, n in enumerate(nums)]
    if layout == IMAGE_INDEXED:
        return [_indexed_sample(n, i, patches) for i, n in enumerate(nums)]
    return [_padded_sample(n, i) for i, n in enumerate(nums)]


def _equal(a: dict, b: dict, layout: str, patches: bool = False) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if layout == IMAGE_INDEXED and patches and k == "pixel_values":
            # joined tensors are zero-padded on the patch axis; the real patches must be unchanged
            y = y[:, : x.shape[1]]
            if x.shape != y.shape:
                return False
        if not torch.equal(x, y):
            return False
    return True


@settings(max_examples=60, deadline=None)
@given(nums=counts, layout=st.sampled_from([GRID, IMAGE_INDEXED, BATCH_PADDED]))
def test_join_then_split_gives_back_each_sample(nums, layout):
    per_sample = _make(layout, nums)
    joined = join_pixels(layout, per_sample)
    if sum(nums) == 0:
        assert joined == {}  # a batch without images gets no pixel inputs at all
    parts = split_pixels(layout, joined, nums)
    assert len(parts) == len(nums)
    for original, part, n in zip(per_sample, parts, nums, strict=True):
        assert (part == {}) == (n == 0)
        assert _equal(original, part, layout)


@settings(max_examples=40, deadline=None)
@given(nums=counts)
def test_image_indexed_with_varying_patch_counts(nums):
    per_sample = _make(IMAGE_INDEXED, nums, patches=True)
    joined = join_pixels(IMAGE_INDEXED, per_sample)
    for original, part in zip(per_sample, split_pixels(IMAGE_INDEXED, joined, nums), strict=True):
        assert _equal(original, part, IMAGE_INDEXED, patches=True)


@settings(max_examples=60, deadline=None)
@given(nums=counts, layout=st.sampled_from([GRID, IMAGE_INDEXED, BATCH_PADDED]), data=st.data())
def test_slice_equals_join_of_the_slice(nums, layout, data):
    per_sample = _make(layout, nums)
    joined = join_pixels(layout, per_sample)
    start = data.draw(st.integers(0, len(nums)))
    end = data.draw(st.integers(start, len(nums)))
    got = slice_pixels(layout, joined, nums, start, end)
    want = join_pixels(layout, per_sample[start:end])
    if layout == BATCH_PADDED and want:
        # the slice keeps only as many tile slots as its own samples need: their largest tile count
        assert got["pixel_values"].shape[1] == max(p["pixel_values"].shape[0] for p in per_sample[start:end] if p)
    assert _equal(want, got, layout)


@settings(max_examples=60, deadline=None)
@given(nums=counts, layout=st.sampled_from([GRID, IMAGE_INDEXED, BATCH_PADDED]), data=st.data())
def test_shuffle_keeps_each_samples_pixels_with_it(nums, layout, data):
    per_sample = _make(layout, nums)
    joined = join_pixels(layout, per_sample)
    order = data.draw(st.permutations(range(len(nums))))
    shuffled = select_pixels(layout, joined, nums, order)
    new_nums = [nums[i] for i in order]
    for j, part in enumerate(split_pixels(layout, shuffled, new_nums)):
        assert _equal(per_sample[order[j]], part, layout)
    # and micro-batches cut from the shuffled batch still line up
    cut = data.draw(st.integers(0, len(nums)))
    for lo, hi in ((0, cut), (cut, len(nums))):
        assert _equal(
            join_pixels(layout, [per_sample[i] for i in order[lo:hi]]),
            slice_pixels(layout, shuffled, new_nums, lo, hi),
            layout,
        )


def test_worked_example_from_the_docs():
    """Samples A (grids (1,16,24), (1,4,4)) and B ((1,8,8)): A owns rows 0:400, B rows 400:464."""
    grid = torch.tensor([[1, 16, 24], [1, 4, 4], [1, 8, 8]])
    pixels = {"pixel_values": torch.arange(464).unsqueeze(1).float(), "image_grid_thw": grid}
    a, b = split_pixels(GRID, pixels, [2, 1])
    assert a["pixel_values"][:, 0].tolist() == list(range(400))
    assert b["pixel_values"][:, 0].tolist() == list(range(400, 464))
    assert a["image_grid_thw"].tolist() == [[1, 16, 24], [1, 4, 4]]
    assert b["image_grid_thw"].tolist() == [[1, 8, 8]]


def test_batch_padded_never_cuts_tiles_by_the_image_count():
    """The Idefics3 bug: 2 images split into 5 + 3 tiles must keep all 8 tiles, not the first 2."""
    a = {"pixel_values": torch.randn(8, 3, 4, 4), "pixel_attention_mask": torch.ones(8, 4, 4, dtype=torch.bool)}
    b = {"pixel_values": torch.randn(2, 3, 4, 4), "pixel_attention_mask": torch.ones(2, 4, 4, dtype=torch.bool)}
    joined = join_pixels(BATCH_PADDED, [a, {}, b])
    assert joined["pixel_values"].shape[:2] == (3, 8)
    parts = split_pixels(BATCH_PADDED, joined, [2, 0, 1])
    assert torch.equal(parts[0]["pixel_values"], a["pixel_values"]) and parts[1] == {}
    assert torch.equal(parts[2]["pixel_values"], b["pixel_values"])
    # a count that cannot be right (more images than real tiles) is an error, not a silent cut
    try:
        split_pixels(BATCH_PADDED, joined, [2, 0, 3])
    except ValueError as exc:
        assert "3 images but 2 real tiles" in str(exc)
    else:
        raise AssertionError("more images than tiles must raise")


def test_inconsistent_counts_are_errors():
    pixels = {"pixel_values": torch.zeros(3, 3, 4, 4)}
    try:
        split_pixels(IMAGE_INDEXED, pixels, [1, 1])
    except ValueError as exc:
        assert "3 images" in str(exc)
    else:
        raise AssertionError("a count mismatch must raise")
