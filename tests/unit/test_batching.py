"""Prompt truncation on token ids alone: ``truncate_text_only`` drops the oldest text and never an image token, and
``image_span_mask`` counts tile-row separators inside an image span, not next to text."""

from __future__ import annotations

import pytest

from collage.training.batching.encoding import (
    PromptTooLongError,
    image_span_mask,
    truncate_text_only,
)


def test_truncate_text_only_is_pure():
    ids = [1, 2, 9, 9, 3, 9, 4, 5]
    keep = [t == 9 for t in ids]
    kept, dropped = truncate_text_only(ids, keep, 6, row=0)
    assert kept == [9, 9, 3, 9, 4, 5] and dropped == 2
    assert truncate_text_only(ids, keep, 8, row=0) == (ids, 0)
    with pytest.raises(PromptTooLongError, match="row 3"):
        truncate_text_only(ids, keep, 2, row=3)


def test_image_spans_include_tile_row_separators_but_not_neighbouring_text():
    # 7 = an image span token, 0 = "\n": inside a span (between tiles) it belongs to the image; next to text, not
    ids = [5, 0, 7, 7, 0, 7, 0, 0, 7, 0, 6, 7, 0, 5]
    assert image_span_mask(ids, {7}, {0}) == [
        False, False, True, True, True, True, True, True, True, False, False, True, False, False,
    ]  # fmt: skip
    # truncation keeps the separators inside the span and drops the oldest text first
    kept, dropped = truncate_text_only(ids, image_span_mask(ids, {7}, {0}), 9, row=0)
    assert kept == [7, 7, 0, 7, 0, 0, 7, 7, 5] and dropped == 5
