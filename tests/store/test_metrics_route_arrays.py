"""``GET /runs/{id}/metrics`` after its rewrite for long runs (issue 21): the store reads the rollups as arrays,
downsamples them vectorised and writes the JSON straight from them. Every answer must equal, point for point, what
the plain definition gives (the reference below, the route's algorithm written out over the raw points), on SQLite
and on PostgreSQL; new points must show at once."""

from __future__ import annotations

import json
import math
import random

from sqlalchemy import insert
from sqlmodel import Session

from collage.app.store import rollups
from collage.app.store.tables import Metric
from tests.support import API
from tests.support.api import config

WIDTHS = (16, 256)  # app/store/rollups.py


def _fold(best: dict, slot, step: int, value: float) -> None:
    """Keep the min and max point of a slot, the earliest step on ties."""
    entry = best.setdefault(slot, [step, value, step, value])
    if value < entry[1] or (value == entry[1] and step < entry[0]):
        entry[0], entry[1] = step, value
    if value > entry[3] or (value == entry[3] and step < entry[2]):
        entry[2], entry[3] = step, value


def _in_step_order(best: dict) -> list[list]:
    out: list[list] = []
    for slot in sorted(best):
        s1, v1, s2, v2 = best[slot]
        if s1 == s2:
            out.append([s1, v1])
        else:
            out.extend([[s1, v1], [s2, v2]] if s1 < s2 else [[s2, v2], [s1, v1]])
    return out


def reference(points: dict[int, float | None], from_step, to_step, max_points: int) -> list[list]:
    """What the route answers for one key, from the run's raw points: every point in range when the range spans
    at most ``max_points`` steps; otherwise the min and max points of the buckets of the coarsest rollup that
    still resolves ``(max_points - 1) // 2`` output buckets, folded into those, and the last point."""
    lo_limit = -1 if from_step is None else from_step
    hi_limit = math.inf if to_step is None else to_step
    inside = {s: v for s, v in points.items() if lo_limit <= s <= hi_limit}
    if not inside:
        return []
    lo, hi = min(inside), max(inside)
    if hi - lo + 1 <= max_points:
        return [[s, inside[s]] for s in sorted(inside)]
    wanted = max(1, (max_points - 1) // 2)
    width = max((w for w in WIDTHS if w <= (hi - lo + 1) / wanted), default=WIDTHS[0])
    buckets: dict = {}
    for step, value in points.items():  # the rollups: every point of the run with a value
        if value is not None:
            _fold(buckets, step // width, step, value)
    best: dict = {}
    for bucket, (s1, v1, s2, v2) in buckets.items():
        if lo // width <= bucket <= hi // width:
            for step, value in ((s1, v1), (s2, v2)):
                if lo <= step <= hi:
                    _fold(best, (step - lo) * wanted // (hi - lo + 1), step, value)
    out = _in_step_order(best)
    if not out or out[-1][0] != hi:
        out.append([hi, inside[hi]])
    return out


def _series(rng: random.Random, steps: int, start: int = 1) -> dict[int, float | None]:
    """A noisy metric with gaps, repeated values (ties), signed zeros, spikes and a few missing values."""
    points: dict[int, float | None] = {}
    level = 0.0
    for step in range(start, start + steps):
        if rng.random() < 0.1:
            continue  # not logged at this step
        level += rng.gauss(0, 1)
        value: float | None = round(level, 1) if rng.random() < 0.3 else level
        if rng.random() < 0.01:
            value = rng.choice((None, 0.0, -0.0, 50.0, -50.0))
        points[step] = value
    return points


def _load(app, run_id: str, series: dict[str, dict[int, float | None]]) -> None:
    """Bulk-write points and build their rollups (what the writer keeps point by point)."""
    rows = [{"run_id": run_id, "key": k, "step": s, "value": v} for k, pts in series.items() for s, v in pts.items()]
    with Session(app.state.engine) as session:
        for start in range(0, len(rows), 5000):
            session.execute(insert(Metric), rows[start : start + 5000])
        rollups.rebuild(session, run_id)
        session.commit()


def _get(client, run_id: str, **params) -> dict[str, list[list]]:
    response = client.get(f"{API}/runs/{run_id}/metrics", params=params)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    body = json.loads(response.content)
    for points in body.values():  # [int, float or null] pairs, as the response model says
        assert all(type(s) is int and (v is None or type(v) is float) for s, v in points)
    return body


def test_every_answer_equals_the_reference(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    rng = random.Random(21)
    series = {"loss": _series(rng, 6000), "reward": _series(rng, 1500, start=40), "short": _series(rng, 30)}
    series["spiky"] = {s: (1e6 if s == 2999 else -1e6 if s == 3001 else 0.5) for s in range(1, 4001)}  # ties
    series["gone"] = {s: None for s in range(1, 3000)}  # logged, never a value (NaN or inf in training)
    _load(app, run, series)
    cases = [{}, {"max_points": 3}, {"max_points": 21}, {"max_points": 500}, {"max_points": 1000},
             {"max_points": 5999}, {"max_points": 6000}, {"max_points": 100000}, {"from_step": 1000, "max_points": 50},
             {"to_step": 2500, "max_points": 301}, {"from_step": 2900, "to_step": 3100, "max_points": 11},
             {"from_step": 7000}, {"from_step": 5995, "max_points": 3}]  # fmt: skip
    for params in cases:
        got = _get(client, run, **params)
        assert list(got) == sorted(series), params  # no keys named: every key the run logged, in order
        for key, points in series.items():
            want = reference(points, params.get("from_step"), params.get("to_step"), params.get("max_points", 2000))
            assert got[key] == want, (key, params)
            assert len(got[key]) <= params.get("max_points", 2000)
    spiky = _get(client, run, keys="spiky", max_points=21)["spiky"]
    assert [2999, 1e6] in spiky and [3001, -1e6] in spiky  # spikes survive
    assert _get(client, run, keys="gone", max_points=21) == {"gone": [[2999, None]]}  # only the last point


def test_named_keys_in_the_order_asked_and_unknown_ones_empty(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    _load(app, run, {"b": {s: float(s) for s in range(1, 5001)}, "a": {1: 1.0, 2: None}})
    got = _get(client, run, keys=["b,nope", "a", "b"], max_points=100)
    assert list(got) == ["b", "nope", "a"]
    assert got["nope"] == [] and got["a"] == [[1, 1.0], [2, None]]
    assert got["b"] == reference({s: float(s) for s in range(1, 5001)}, None, None, 100)


def test_every_key_of_a_run_with_hundreds_of_them(api):
    """More names than one statement of the range reads takes (500): all of them, each with its points."""
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    names = [f"rewards/fn_{i:03d}/mean" for i in range(620)]
    for step in (1, 2):
        app.state.writer.append_metrics(run, step, {name: i * 0.5 + step for i, name in enumerate(names)})
    got = _get(client, run)
    assert list(got) == sorted(names)
    assert all(got[name] == [[1, i * 0.5 + 1], [2, i * 0.5 + 2]] for i, name in enumerate(names))


def test_new_points_show_at_once(api):
    """A live run: each write is in the next answer, downsampled or not (no cache may hold an older one)."""
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    writer = app.state.writer
    rng = random.Random(5)
    truth: dict[int, float | None] = {}
    for step in range(1, 301):
        truth[step] = rng.uniform(-1, 1)
        writer.append_metrics(run, step, {"loss": truth[step]})
        if step in (1, 2, 40, 41, 120, 299, 300):
            for max_points in (41, 2000):
                assert _get(client, run, keys="loss", max_points=max_points)["loss"] == reference(
                    truth, None, None, max_points
                )
    writer.append_metrics(run, 150, {"loss": 99.0})  # a rewrite: the new maximum, at once
    truth[150] = 99.0
    assert [150, 99.0] in _get(client, run, keys="loss", max_points=41)["loss"]
    writer.append_metrics(run, 301, {"loss": float("nan")})  # the last point, even without a value
    truth[301] = None
    for max_points in (41, 2000):
        assert _get(client, run, keys="loss", max_points=max_points)["loss"] == reference(truth, None, None, max_points)
    assert _get(client, run, keys="loss", max_points=41)["loss"][-1] == [301, None]


def test_the_answer_is_compact_json_of_ints_and_floats(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    app.state.writer.append_metrics(run, 1, {"loss": 2, "kl": float("inf")})
    app.state.writer.append_metrics(run, 2, {"loss": 0.1})
    response = client.get(f"{API}/runs/{run}/metrics")
    assert response.content == b'{"kl":[[1,null]],"loss":[[1,2.0],[2,0.1]]}'
    schema = app.openapi()["paths"]["/api/v1/runs/{run_id}/metrics"]["get"]["responses"]["200"]
    assert "additionalProperties" in schema["content"]["application/json"]["schema"]  # still documented
    assert client.get(f"{API}/runs/nope/metrics").status_code == 404


def test_vectorised_merge_equals_folding_point_by_point():
    rng = random.Random(0)
    for _ in range(300):
        keys = [f"k{i}" for i in range(rng.randint(1, 4))]
        width = rng.choice(WIDTHS)
        rows, spans = [], []
        for key in keys:
            first = rng.randint(0, 2000)
            points = _series(rng, rng.choice((10, 300, 5000)), start=first)
            buckets: dict = {}
            for step, value in points.items():
                if value is not None:
                    _fold(buckets, step // width, step, value)
            rows += [(key, *entry) for entry in buckets.values()]
            last = max(points, default=first)
            lo = rng.randint(first, first + 20)
            spans.append((lo, max(lo, rng.randint(last - 20, last + 3))))
        rng.shuffle(rows)
        wanted = rng.choice((1, 2, 9, 249, 999))
        index = {key: i for i, key in enumerate(keys)}
        points = rollups._points([index[r[0]] for r in rows], *([r[i] for r in rows] for i in range(1, 5)))
        got = rollups._merge(*points, keys, spans, wanted)
        for key, (lo, hi) in zip(keys, spans, strict=True):
            best: dict = {}
            for row in rows:
                if row[0] == key:
                    for step, value in ((row[1], row[2]), (row[3], row[4])):
                        if lo <= step <= hi:
                            _fold(best, (step - lo) * wanted // (hi - lo + 1), step, value)
            assert rollups.as_points(got[key]) == _in_step_order(best)
