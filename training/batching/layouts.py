"""Split, re-join and slice a batch's image tensors per sample, for every pixel layout.

These are pure functions over tensors. A *per-sample* pixel dict holds exactly that sample's images in the
family's own layout (``{}`` for a sample without images); a *batch* pixel dict is what the model's forward
takes. ``num_images[s]`` is the image count of sample ``s``.

- ``grid`` (Qwen-VL): ``pixel_values`` is ``(total_patch_rows, D)`` for the whole batch and ``image_grid_thw``
  is ``(total_images, 3)``; image ``i`` owns ``prod(image_grid_thw[i])`` consecutive rows, in batch order.
- ``image_indexed`` (LLaVA, LLaVA-NeXT, Gemma3): every tensor is ``(total_images, ...)``; trailing dimensions
  that differ between images (LLaVA-NeXT's patch count) are zero-padded on join.
- ``batch_padded`` (Idefics3, SmolVLM): ``pixel_values`` is ``(batch, max_tiles, 3, H, W)`` and
  ``pixel_attention_mask`` ``(batch, max_tiles, H, W)``. The second axis counts **tiles**, not images: with
  image splitting (the real processors' default) each image becomes several crops plus a global view, so a
  sample has at least as many entries as images. Padding tiles (to the batch's largest tile count) come last,
  all zero with an all-false mask; per sample we keep exactly its real tiles, counted from the mask.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from itertools import accumulate

import torch

from ..models.families import BATCH_PADDED, GRID, IMAGE_INDEXED

Pixels = dict[str, torch.Tensor]


def _cumsum(values: Sequence[int]) -> list[int]:
    return [0, *accumulate(values)]


def _check_counts(num_images: Sequence[int], total: int, what: str) -> None:
    if any(n < 0 for n in num_images):
        raise ValueError(f"negative image count in {list(num_images)}")
    if sum(num_images) != total:
        raise ValueError(f"{what} holds {total} images but the samples' image counts add up to {sum(num_images)}")


def grid_rows_per_image(image_grid_thw: torch.Tensor) -> list[int]:
    return image_grid_thw.prod(dim=-1).tolist()


def split_pixels(layout: str, pixels: Pixels, num_images: Sequence[int]) -> list[Pixels]:
    """One pixel dict per sample, in order; ``{}`` for samples with no images."""
    if sum(num_images) == 0:
        return [{} for _ in num_images]
    if layout == BATCH_PADDED:
        tiles = real_tiles(pixels)
        _check_padded(pixels, num_images, tiles)
        # per sample: its real tiles (every crop and global view of its images), without the batch axis and the
        # padding slots; never cut by the image count, which would drop tiles
        return [{k: v[s, :t] for k, v in pixels.items()} if t else {} for s, t in enumerate(tiles)]
    return [slice_pixels(layout, pixels, num_images, s, s + 1) for s in range(len(num_images))]


def real_tiles(pixels: Pixels) -> list[int]:
    """Per sample of a batch-padded pixel dict, how many leading entries are real tiles (padding tiles are
    all-false in ``pixel_attention_mask``, or all zero when a processor gives no mask)."""
    values = pixels["pixel_values"]
    mask = pixels.get("pixel_attention_mask")
    real = mask.flatten(2).any(dim=2) if mask is not None else values.flatten(2).ne(0).any(dim=2)
    counts = real.sum(dim=1).tolist()
    for s, n in enumerate(counts):
        if not bool(real[s, :n].all()):
            raise ValueError(f"sample {s}: padding tiles come before real ones in pixel_values")
    return counts


def _check_padded(pixels: Pixels, num_images: Sequence[int], tiles: Sequence[int]) -> None:
    values = pixels["pixel_values"]
    if values.shape[0] != len(num_images):
        raise ValueError(f"pixel_values has {values.shape[0]} samples but {len(num_images)} image counts")
    for s, (n, t) in enumerate(zip(num_images, tiles, strict=True)):
        if (n == 0) != (t == 0) or t < n:
            raise ValueError(f"sample {s} has {n} images but {t} real tiles in pixel_values")


def slice_pixels(layout: str, pixels: Pixels, num_images: Sequence[int], start: int, end: int) -> Pixels:
    """The pixel dict of the contiguous samples ``[start, end)``; ``{}`` when they have no images."""
    if not 0 <= start <= end <= len(num_images):
        raise IndexError(f"sample range [{start}, {end}) outside a batch of {len(num_images)}")
    if sum(num_images[start:end]) == 0:
        return {}
    cum_imgs = _cumsum(num_images)
    if layout == GRID:
        grid = pixels["image_grid_thw"]
        _check_counts(num_images, grid.shape[0], "image_grid_thw")
        cum_rows = _cumsum(grid_rows_per_image(grid))
        if cum_rows[-1] != pixels["pixel_values"].shape[0]:
            raise ValueError(
                f"pixel_values has {pixels['pixel_values'].shape[0]} rows but image_grid_thw implies {cum_rows[-1]}"
            )
        first, last = cum_imgs[start], cum_imgs[end]
        out = {k: v[first:last] for k, v in pixels.items() if k != "pixel_values"}
        out["pixel_values"] = pixels["pixel_values"][cum_rows[first] : cum_rows[last]]
        return out
    if layout == IMAGE_INDEXED:
        _check_counts(num_images, pixels["pixel_values"].shape[0], "pixel_values")
        first, last = cum_imgs[start], cum_imgs[end]
        return {k: v[first:last] for k, v in pixels.items()}
    if layout == BATCH_PADDED:
        return join_pixels(layout, split_pixels(layout, pixels, num_images)[start:end])
    raise ValueError(f"unknown pixel layout {layout!r}")


def _zero_pad(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` zero-padded at the end of every dimension up to ``shape`` (any dtype, bool masks included)."""
    if tuple(t.shape) == tuple(shape):
        return t
    out = t.new_zeros(tuple(shape))
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def _pad_to(t: torch.Tensor, trailing: Sequence[int]) -> torch.Tensor:
    """Zero-pad every dimension of ``t`` but the first up to ``trailing``."""
    return _zero_pad(t, [t.shape[0], *trailing])


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    trailing = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    return torch.cat([_pad_to(t, trailing) for t in tensors], dim=0)


def join_pixels(layout: str, per_sample: Sequence[Pixels]) -> Pixels:
    """The batch pixel dict for these samples, in order; ``{}`` if none has an image (the model then gets no
    pixel inputs at all: an empty tensor crashes some vision towers)."""
    present = [p for p in per_sample if p]
    if not present:
        return {}
    keys = present[0].keys()
    if layout == GRID:
        return {k: torch.cat([p[k] for p in present], dim=0) for k in keys}
    if layout == IMAGE_INDEXED:
        return {k: _cat_padded([p[k] for p in present]) for k in keys}
    if layout == BATCH_PADDED:
        template = present[0]
        max_n = max(p["pixel_values"].shape[0] for p in present)
        spatial = [max(p["pixel_values"].shape[d] for p in present) for d in (2, 3)]
        out = {}
        for k in keys:
            rows = []
            for p in per_sample:
                # a sample without images gets only padding images (all zero, mask all false)
                t = p[k] if p else template[k][:0]
                trailing = list(t.shape[1:])
                trailing[-2:] = spatial
                t = _pad_to(t, trailing)
                rows.append(_zero_pad(t, [max_n, *t.shape[1:]]))
            out[k] = torch.stack(rows, dim=0)
        return out
    raise ValueError(f"unknown pixel layout {layout!r}")


def concat_sample_pixels(layout: str, parts: Sequence[Pixels]) -> Pixels:
    """One sample's pixel dict from several per-sample dicts of that same sample, images in order: a multi-turn
    rollout's own images followed by each tool turn's (every family's image axis is the first; trailing dimensions
    that differ, a batch-padded tile's height and width or LLaVA-OneVision's patch count, are zero-padded, which
    their masks and sizes already say how to read)."""
    present = [p for p in parts if p]
    if not present:
        return {}
    keys = present[0].keys()
    if layout == GRID:
        return {k: torch.cat([p[k] for p in present], dim=0) for k in keys}
    if layout in (IMAGE_INDEXED, BATCH_PADDED):
        return {k: _cat_padded([p[k] for p in present]) for k in keys}
    raise ValueError(f"unknown pixel layout {layout!r}")


def select_pixels(layout: str, pixels: Pixels, num_images: Sequence[int], order: Sequence[int]) -> Pixels:
    """Re-order (or sub-select) samples: the result's sample ``j`` is the input's sample ``order[j]``."""
    parts = split_pixels(layout, pixels, num_images)
    return join_pixels(layout, [parts[i] for i in order])


def pixel_key(pixels: Pixels, num_images: int) -> str | None:
    """A content hash of one sample's pixel inputs (every tensor's dtype, shape and bytes) and its image count
    (LLaVA-OneVision encodes a lone image differently from one among several); ``None`` without images."""
    if not pixels:
        return None
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str(num_images).encode())
    for name in sorted(pixels):
        tensor = pixels[name].detach().contiguous().cpu()
        digest.update(f"|{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
