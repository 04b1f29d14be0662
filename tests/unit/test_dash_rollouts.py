"""A rollout row's dataset columns (issue 13): ``scalar_columns`` keeps scalars (numpy ones as Python values), cuts
long text, and drops lists, mappings and non-finite numbers."""

from __future__ import annotations

import math

from collage.training.callbacks import COLUMN_TEXT_MAX, scalar_columns

LONG = "x" * (COLUMN_TEXT_MAX + 50)


def test_scalar_columns_keep_scalars_cut_long_text_and_drop_the_rest():
    import numpy as np

    got = scalar_columns(
        {"answer": "3", "n": 2, "ok": True, "score": 0.5, "bad": math.nan, "none": None, "tags": ["a"],
         "meta": {"k": 1}, "long": LONG, "np_int": np.int64(7), "np_float": np.float32(0.25), "prompt": "p"}
    )  # fmt: skip
    assert got == {"answer": "3", "n": 2, "ok": True, "score": 0.5, "bad": None, "none": None,
                   "long": "x" * COLUMN_TEXT_MAX + "…", "np_int": 7, "np_float": 0.25}  # fmt: skip
    assert type(got["np_int"]) is int and type(got["ok"]) is bool
