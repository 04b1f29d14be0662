"""The samples API of the rollouts page (issue 13), on SQLite and PostgreSQL through the in-process app: sorts and
filters by each reward function with keyset paging, the dataset row and group filters, unknown names and bad values
as 422s naming the parameter, and dataset columns in the rows and in every export format."""

from __future__ import annotations

import csv
import io
import json

from PIL import Image

from collage.training.callbacks import COLUMN_TEXT_MAX
from tests.support.rollouts import all_pages, fill_rollouts, rollout_config

API = "/api/v1"


def _png(colour, size=(20, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _position(item):
    return item["step"], item["group"], item["index"]


def test_sort_and_filter_by_each_reward_function_with_keyset_pages(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=rollout_config()).json()["id"]
    expected = fill_rollouts(app, run)
    assert len(expected) == 48
    for name in ("accuracy", "numeric"):
        for prefix in ("", "-"):
            got = all_pages(client, run, sort=f"{prefix}reward.{name}", limit=5)  # many ties: pages split them
            assert len(got) == 48 and len({s["id"] for s in got}) == 48, (name, prefix)
            values = [-1e300 if s["rewards"][name] is None else s["rewards"][name] for s in got]
            assert values == sorted(values, reverse=prefix == "-"), (name, prefix)
            ids = [s["id"] for s in got]  # ties are broken by id, in the sort's direction
            pairs = list(zip(values, ids, strict=True))
            assert pairs == sorted(pairs, reverse=prefix == "-")
            if prefix == "-":
                assert got[-1]["rewards"][name] is None  # unscorable rows sort lowest
    # the reward_name filter bounds one function's value; rows it could not score never match
    cases = [
        ({"reward_name": "accuracy", "min_reward": 0.5}, lambda e: e["accuracy"] is not None and e["accuracy"] >= 0.5),
        ({"reward_name": "accuracy", "max_reward": 0.25}, lambda e: e["accuracy"] is not None and e["accuracy"] <= 0.25),
        ({"reward_name": "numeric", "min_reward": -0.2, "max_reward": 0.4},
         lambda e: e["numeric"] is not None and -0.2 <= e["numeric"] <= 0.4),
        ({"min_reward": 0.5}, lambda e: e["reward"] is not None and e["reward"] >= 0.5),  # the total, as before
        ({"dataset_row": 12}, lambda e: e["dataset_row"] == 12),
        ({"step": 2, "group": 3}, lambda e: e["step"] == 2 and e["group"] == 3),
        ({"dataset_row": 11, "reward_name": "numeric", "max_reward": 0.0},
         lambda e: e["dataset_row"] == 11 and e["numeric"] is not None and e["numeric"] <= 0),
    ]  # fmt: skip
    for params, keep in cases:
        got = all_pages(client, run, limit=4, sort="-reward.numeric", **params)
        want = sorted(_position(e) for e in expected if keep(e))
        assert want and sorted(map(_position, got)) == want, params
    # a cursor belongs to its sort: another reward function's sort refuses it
    first = client.get(f"{API}/runs/{run}/samples", params={"sort": "reward.accuracy", "limit": 3}).json()
    other = client.get(f"{API}/runs/{run}/samples", params={"sort": "reward.numeric", "cursor": first["next_cursor"]})
    assert other.status_code == 400 and "sorted by reward.accuracy" in other.json()["detail"]


def test_unknown_reward_names_are_422_naming_the_parameter(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=rollout_config()).json()["id"]
    fill_rollouts(app, run, steps=1)
    bad = client.get(f"{API}/runs/{run}/samples", params={"sort": "-reward.speed"})
    assert bad.status_code == 422
    [error] = bad.json()["detail"]
    assert error["path"] == "query.sort" and "'speed'" in error["message"] and "accuracy, numeric" in error["message"]
    bad = client.get(f"{API}/runs/{run}/samples", params={"reward_name": "nope", "min_reward": 1})
    assert bad.status_code == 422 and bad.json()["detail"][0]["path"] == "query.reward_name"
    bad = client.get(f"{API}/runs/{run}/samples", params={"min_reward": "high"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["path"] == "query.min_reward"
    for params in ({"dataset_row": -1}, {"group": "x"}, {"sort": "reward."}, {"sort": "reward.a\x01"}):
        bad = client.get(f"{API}/runs/{run}/samples", params=params)
        assert bad.status_code == 422, params
        assert bad.json()["detail"][0]["path"] == "query." + next(iter(params)), params


def test_columns_in_rows_and_every_export_format(api):
    import pyarrow.parquet as pq

    client, _, _, app = api
    run = client.post(API + "/runs", json=rollout_config()).json()["id"]
    fill_rollouts(app, run, steps=1, groups=4, gens=2)
    rows = client.get(f"{API}/runs/{run}/samples", params={"group": 3, "limit": 10}).json()["items"]
    assert len(rows) == 2
    assert rows[0]["columns"] == {"answer": "3", "task": "count-red", "difficulty": 1.5, "hard": True,
                                  "note": "x" * COLUMN_TEXT_MAX + "…"}  # fmt: skip
    jsonl = client.get(f"{API}/runs/{run}/export", params={"what": "samples", "format": "jsonl"})
    records = [json.loads(line) for line in jsonl.text.splitlines()]
    assert len(records) == 8 and records[0]["columns"]["answer"] == "0" and records[0]["columns"]["hard"] is False
    table = list(csv.DictReader(io.StringIO(client.get(f"{API}/runs/{run}/export?what=samples&format=csv").text)))
    assert json.loads(table[-1]["columns"])["answer"] == "3"
    parquet = client.get(f"{API}/runs/{run}/export", params={"what": "samples", "format": "parquet"})
    frame = pq.read_table(io.BytesIO(parquet.content)).to_pylist()
    assert [json.loads(r["columns"])["answer"] for r in frame] == [str(g) for g in range(4) for _ in range(2)]
