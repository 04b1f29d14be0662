"""Qwen3-VL, Gemma 3, LLaVA-OneVision, InternVL and SmolVLM without a model: each is a buildable tiny family found by
its model type (SmolVLM apart from Idefics3), and a tiled family's tiles travel in image slots through join, split,
select and slice."""

from __future__ import annotations

import pytest
import torch

from collage.training.batching.batch import _tiles_in_image_slots, model_pixels
from collage.training.models.families import IMAGE_INDEXED, TINY_FAMILIES, family_for_model_type

NEW_FAMILIES = ("qwen3-vl", "gemma3", "llava-onevision", "internvl", "smolvlm")


def test_every_new_family_is_buildable():
    assert set(NEW_FAMILIES) <= set(TINY_FAMILIES)
    assert family_for_model_type("smolvlm").name == "smolvlm"  # not idefics3, which shares the layout
    assert family_for_model_type("idefics3").name == "idefics3"


def test_tiles_are_dealt_into_image_slots_and_back():
    """A tiled family's per-sample tiles travel in image slots through join / split / select / slice."""
    from collage.training.batching.layouts import join_pixels, select_pixels, slice_pixels

    g = torch.Generator().manual_seed(0)
    counts = [(2, 7), (0, 0), (1, 1), (3, 3), (1, 5), (2, 2)]  # (images, tiles) per sample
    per_sample = [{"pixel_values": torch.randn(t, 3, 4, 4, generator=g)} if n else {} for n, t in counts]
    nums = [n for n, _ in counts]
    slots = [_tiles_in_image_slots(p, n) for p, n in zip(per_sample, nums, strict=True)]
    assert all(s["pixel_values"].shape[0] == n for s, n in zip(slots, nums, strict=True) if n)
    joined = join_pixels(IMAGE_INDEXED, slots)
    assert torch.equal(model_pixels(joined)["pixel_values"], torch.cat([p["pixel_values"] for p in per_sample if p]))
    order = [4, 0, 5, 1, 3, 2]
    shuffled = select_pixels(IMAGE_INDEXED, joined, nums, order)
    new_nums = [nums[i] for i in order]
    for lo, hi in ((0, 2), (2, 3), (3, 6)):
        want = [per_sample[i]["pixel_values"] for i in order[lo:hi] if per_sample[i]]
        got = model_pixels(slice_pixels(IMAGE_INDEXED, shuffled, new_nums, lo, hi))
        assert torch.equal(got["pixel_values"], torch.cat(want)) if want else got == {}
    with pytest.raises(ValueError, match="at least one tile"):
        _tiles_in_image_slots({"pixel_values": torch.zeros(1, 3, 4, 4)}, 2)
