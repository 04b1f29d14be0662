"""The JSON of ``GET /runs/{id}/metrics`` written straight from arrays (issue 21): ``series_json`` gives exactly what
orjson writes for the lists of points, non-finite values as null, and the rollups give the same points."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest

from collage.app.store import rollups
from collage.app.store.queries import series_json


@pytest.mark.parametrize("values", [
    [], [2.0], [None, 0.1, -0.0, 1e300, 5e-324, 1 / 3, 1e16, 123456789.0, -2.5e-7], [float("inf"), float("nan")],
])  # fmt: skip
def test_series_json_is_what_orjson_writes_for_the_lists(values):
    steps = np.arange(len(values), dtype=np.int64) * 7 + 2**31 - 100
    array = np.array(values, dtype=np.float64)
    want = [[int(s), None if v is None or not math.isfinite(v) else v] for s, v in zip(steps, values, strict=True)]
    assert series_json(steps, array) == orjson.dumps(want)
    assert rollups.as_points((steps, array)) == want
