"""The REST API and the store, through httpx against the real app on SQLite and on PostgreSQL."""

from __future__ import annotations

import csv
import io
import json
import math
import random
import socket

import pytest
from PIL import Image
from sqlalchemy import event, select
from sqlmodel import Session

from collage.app.store.writer import ImageIn, SampleIn
from tests.support import API
from tests.support.api import config, count_rows, png


def test_every_route_but_health_needs_a_token(api):
    client, _, _, app = api
    routes = [
        ("GET", "/runs"), ("POST", "/runs"), ("GET", "/runs/x"), ("POST", "/runs/x/cancel"), ("POST", "/runs/x/resume"),
        ("POST", "/runs/x/clone"), ("DELETE", "/runs/x"), ("GET", "/runs/x/metrics"), ("GET", "/runs/x/samples"),
        ("GET", "/runs/x/events"), ("GET", "/runs/x/stream"), ("GET", "/runs/x/export"), ("GET", "/images/" + "a" * 64),
        ("POST", "/datasets/check"), ("GET", "/datasets/preview"), ("GET", "/rewards"), ("GET", "/models"),
        ("GET", "/tokens"), ("POST", "/tokens"), ("DELETE", "/tokens/x"), ("POST", "/tokens/x/link"), ("GET", "/audit"),
        ("PATCH", "/runs/x"), ("GET", "/runs/x/histogram"), ("GET", "/workers"), ("GET", "/runs/x/samples/count"),
        ("GET", "/runs/x/checkpoints"), ("GET", "/runs/x/checkpoints/{step}/download"), ("POST", "/runs/x/exports"),
        ("GET", "/exports/{job_id}"), ("GET", "/exports/{job_id}/download"), ("POST", "/exports/{job_id}/cancel"),
        ("GET", "/runs/x/exports"), ("GET", "/exports"),  # listings of exports (defect 7)
    ]  # fmt: skip
    routes += [("POST", "/images"), ("GET", "/uploads"), ("POST", "/generate"), ("GET", "/generate/{job_id}"),
               ("POST", "/generate/{job_id}/cancel")]  # the playground (issue 18)  # fmt: skip
    routes += [("POST", "/plan")]  # the memory plan before launch (issue 29)
    documented = {(m, p.replace("{run_id}", "x").replace("{sha256}", "a" * 64).replace("{name}", "x")) for p, item in
                  app.openapi()["paths"].items() for m in item if p != f"{API}/health" for m in [m.upper()]}  # fmt: skip
    assert {(m, API + p) for m, p in routes} == documented, "every contract route exists, and only those"
    for method, path in routes:
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
            response = client.request(method, API + path, headers=headers)
            assert response.status_code == 401, (method, path, headers, response.status_code)
            assert response.json()["detail"]
    assert client.get(API + "/health", headers={"Authorization": ""}).status_code == 200


def test_tokens_are_stored_hashed(api):
    client, token, _, app = api
    from collage.app.store.tables import ApiToken

    with Session(app.state.engine) as session:
        stored = session.scalars(select(ApiToken)).all()
    assert stored and all(token not in (t.token_hash, t.prefix) and len(t.token_hash) == 64 for t in stored)


def test_create_run_stores_it_queued_and_dispatches(api):
    client, _, dispatcher, app = api
    response = client.post(API + "/runs", json=config(resources={"gpus": 0, "queue": "gpu-a"}))
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["status"] == "queued" and body["url"] == f"{API}/runs/{body['id']}"
    assert dispatcher.submitted == [(body["id"], "gpu-a")]
    run = client.get(body["url"]).json()
    assert run["status"] == "queued" and run["progress"] == {"step": 0, "max_steps": 5}
    assert run["config"]["train"]["loss_type"] == "dapo"  # resolved with defaults
    assert run["tags"] == ["demo"] and run["attempt"] == 1
    assert [e["message"] for e in client.get(body["url"] + "/events").json()["items"]] == ["queued"]
    # no live worker takes queue gpu-a: the run says so while it waits (live, never a warning frozen at submit)
    assert run["queue_position"] == 1 and run["queue_workers"] == 0 and run["warning_count"] == 0
    from collage.worker.registry import Registration

    Registration(app.state.engine, "w-gpu-a", ["gpu-a"], []).beat()
    assert client.get(body["url"]).json()["queue_workers"] == 1  # a worker that starts later: the note goes
    default = client.post(API + "/runs", json=config()).json()
    assert client.get(default["url"]).json()["queue_workers"] == 0


def test_a_bad_config_lists_every_bad_field_and_writes_nothing(api):
    client, _, dispatcher, app = api
    from collage.app.store.tables import Run

    bad = config(
        algorithm="ppo",
        train={"max_steps": "many", "loss_type": "x", "learning_rate": -1},
        model={"path": "tiny:qwen2-vl", "lora": {"r": 0}},
        extra_key=1,
    )
    response = client.post(API + "/runs", json=bad)
    assert response.status_code == 422
    paths = {e["path"] for e in response.json()["detail"]}
    assert {
        "algorithm",
        "train.max_steps",
        "train.loss_type",
        "train.learning_rate",
        "model.lora.r",
        "extra_key",
    } <= paths
    semantic = config(
        model={"path": "tiny:gpt9"},
        dataset={"source": "synth:nope"},
        rewards=[{"name": "accuracy"}, {"name": "not a reward"}],
    )
    response = client.post(API + "/runs", json=semantic)
    assert response.status_code == 422
    errors = {e["path"]: e["message"] for e in response.json()["detail"]}
    assert set(errors) == {"model.path", "dataset.source", "rewards[1].name"}
    assert "unknown tiny family" in errors["model.path"] and "unknown synthetic task" in errors["dataset.source"]
    missing = config(model={"path": "/nowhere/model"}, dataset={"source": "./missing.jsonl"})
    assert {e["path"] for e in client.post(API + "/runs", json=missing).json()["detail"]} == {
        "model.path",
        "dataset.source",
    }
    assert count_rows(app, Run) == 0 and dispatcher.submitted == []


@pytest.mark.parametrize(
    "body,content_type,needle",
    [
        (b'{"name": "x", ', "application/json", "malformed JSON"),
        (b"[1, 2]", "application/json", "valid dictionary"),
        (b"name: x", "text/yaml", "application/json"),
    ],
)
def test_malformed_bodies_are_422_and_write_nothing(api, body, content_type, needle):
    client, _, dispatcher, app = api
    from collage.app.store.tables import Run

    response = client.post(API + "/runs", content=body, headers={"Content-Type": content_type})
    assert response.status_code == 422, response.text
    assert needle in json.dumps(response.json())
    assert count_rows(app, Run) == 0 and dispatcher.submitted == []


def test_oversized_bodies_are_refused(api):
    client, _, dispatcher, app = api
    from collage.app.store.tables import Run

    huge = config(name="x" * 10, tags=["t" * 100] * 20_000)
    response = client.post(API + "/runs", json=huge)
    assert response.status_code == 413 and "larger than" in response.json()["detail"]
    # sent in chunks, without Content-Length: the limit is found while FastAPI parses the JSON, still a 413
    body = json.dumps(huge).encode()
    chunked = client.post(API + "/runs", content=iter([body[i : i + 65536] for i in range(0, len(body), 65536)]),
                          headers={"Content-Type": "application/json"})  # fmt: skip
    assert chunked.status_code == 413 and "larger than" in chunked.json()["detail"], chunked.text
    assert count_rows(app, Run) == 0 and dispatcher.submitted == []


def test_a_broker_failure_leaves_no_dangling_queued_run(api):
    client, _, dispatcher, _ = api
    dispatcher.fail_with = ConnectionError("broker down")
    response = client.post(API + "/runs", json=config())
    assert response.status_code == 503 and "could not be queued" in response.json()["detail"]
    runs = client.get(API + "/runs").json()["items"]
    assert len(runs) == 1 and runs[0]["status"] == "failed" and "broker down" in runs[0]["error"]


def test_list_filters_and_cursor_pagination(api):
    client, _, _, app = api
    ids = []
    for i in range(7):
        c = config(name=f"run-{i}", tags=["even"] if i % 2 == 0 else ["odd"], algorithm="rloo" if i == 3 else "grpo")
        if i == 3:
            c["train"] = {"max_steps": 5}
        ids.append(client.post(API + "/runs", json=c).json()["id"])
    app.state.writer.transition(ids[1], ["queued"], "running")
    seen, cursor = [], None
    while True:
        page = client.get(API + "/runs", params={"limit": 3, **({"cursor": cursor} if cursor else {})}).json()
        seen += [r["id"] for r in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids[::-1]  # newest first, each once
    assert [r["id"] for r in client.get(API + "/runs", params={"tag": "odd"}).json()["items"]] == [
        ids[5],
        ids[3],
        ids[1],
    ]
    assert [r["id"] for r in client.get(API + "/runs", params={"status": "running"}).json()["items"]] == [ids[1]]
    assert [r["id"] for r in client.get(API + "/runs", params={"algorithm": "rloo"}).json()["items"]] == [ids[3]]
    assert [r["id"] for r in client.get(API + "/runs", params={"q": "run-4"}).json()["items"]] == [ids[4]]
    assert client.get(API + "/runs", params={"cursor": "garbage!"}).status_code == 400


def test_unknown_run_ids_are_404(api):
    client, _, _, _ = api
    for method, path in [("GET", ""), ("POST", "/cancel"), ("POST", "/resume"), ("POST", "/clone"), ("DELETE", ""),
                         ("GET", "/metrics"), ("GET", "/samples"), ("GET", "/events"), ("GET", "/export"),
                         ("GET", "/stream")]:  # fmt: skip
        response = client.request(method, f"{API}/runs/nope{path}")
        assert response.status_code == 404, (method, path)
        assert "no run with id 'nope'" in response.json()["detail"]
    assert client.get(f"{API}/runs/{'x' * 200}").status_code == 404


def test_cancel_resume_clone_delete(api):
    client, _, dispatcher, app = api
    writer = app.state.writer
    queued = client.post(API + "/runs", json=config()).json()["id"]
    assert client.post(f"{API}/runs/{queued}/cancel").json()["status"] == "cancelled"
    assert client.post(f"{API}/runs/{queued}/cancel").status_code == 409

    running = client.post(API + "/runs", json=config()).json()["id"]
    from collage.worker.supervisor import claim

    assert claim(writer, running, "w1") is not None  # as a worker takes it
    assert client.post(f"{API}/runs/{running}/cancel").json()["status"] == "cancelling"
    assert dispatcher.cancelled == [running]
    assert client.delete(f"{API}/runs/{running}").status_code == 409

    assert writer.transition(running, ["cancelling"], "failed", error="worker lost")
    resumed = client.post(f"{API}/runs/{running}/resume").json()
    assert resumed["status"] == "queued" and resumed["attempt"] == 2 and resumed["error"] is None
    assert dispatcher.submitted[-1] == (running, "default")
    assert client.post(f"{API}/runs/{running}/resume").status_code == 409

    clone = client.post(f"{API}/runs/{queued}/clone", json={"overrides": {"train.max_steps": 9, "tags": ["b"]}})
    assert clone.status_code == 201
    cloned = client.get(clone.json()["url"]).json()
    assert cloned["parent_id"] == queued and cloned["progress"]["max_steps"] == 9 and cloned["tags"] == ["b"]
    assert cloned["name"] == "api-test-clone"
    bad = client.post(f"{API}/runs/{queued}/clone", json={"overrides": {"train": {"loss_type": "x"}}})
    assert bad.status_code == 422 and bad.json()["detail"][0]["path"] == "train.loss_type"
    # the same rule as `--set`: a mapping merges, a null mapping on the way is created
    merged = client.post(
        f"{API}/runs/{queued}/clone", json={"overrides": {"train": {"learning_rate": 0.001}, "model.lora": {"r": 4}}}
    )
    merged_config = client.get(merged.json()["url"]).json()["config"]
    assert merged_config["train"]["learning_rate"] == 0.001 and merged_config["train"]["max_steps"] == 5
    assert merged_config["model"]["lora"]["r"] == 4 and merged_config["model"]["lora"]["alpha"] == 16
    through = client.post(f"{API}/runs/{queued}/clone", json={"overrides": {"train.max_steps.x": 1}})
    assert through.status_code == 422
    assert through.json()["detail"] == [{"path": "train.max_steps.x", "message": "train.max_steps is not a mapping"}]

    assert client.delete(f"{API}/runs/{queued}").status_code == 204
    assert client.get(f"{API}/runs/{queued}").status_code == 404
    assert client.get(clone.json()["url"]).json()["parent_id"] is None


def test_metric_writes_are_idempotent(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    w = app.state.writer
    w.append_metrics(run, 1, {"reward": 0.1, "loss": 2.0})
    w.append_metrics(run, 1, {"reward": 0.1, "loss": 2.0})
    w.append_metrics(run, 1, {"reward": 0.3})  # a re-write of step 1 replaces, never duplicates
    w.append_metrics(run, 2, {"reward": float("nan")})
    from collage.app.store.tables import Metric

    assert count_rows(app, Metric) == 3
    got = client.get(f"{API}/runs/{run}/metrics").json()
    assert got == {"loss": [[1, 2.0]], "reward": [[1, 0.3], [2, None]]}
    assert client.get(f"{API}/runs/{run}/metrics", params={"keys": "loss,reward", "from_step": 2}).json() == {
        "loss": [],
        "reward": [[2, None]],
    }


def test_downsampling_keeps_the_shape_and_the_last_point(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    values = {s: math.sin(s / 50) for s in range(1, 2001)}
    values[777] = 50.0  # a spike must survive
    values[1313] = -50.0
    for s, v in values.items():
        app.state.writer.append_metrics(run, s, {"reward": v})
    points = client.get(f"{API}/runs/{run}/metrics", params={"keys": "reward", "max_points": 101}).json()["reward"]
    assert len(points) <= 101
    steps = [p[0] for p in points]
    assert steps == sorted(steps) and steps[-1] == 2000
    assert [777, 50.0] in points and [1313, -50.0] in points
    assert all(values[s] == v for s, v in points)  # real points, not averages


def _fill(app, run_id, steps=4, groups=3, gens=4, seed=0):
    """Rows with known rewards, advantages, images; one zero-variance group per step."""
    rng = random.Random(seed)
    colours = [(200, 0, 0), (0, 200, 0), (0, 0, 200), (100, 100, 0)]
    expected = []
    for step in range(1, steps + 1):
        rows = []
        for g in range(groups):
            n_images = g % 4
            rewards = [1.0] * gens if g == 0 else [round(rng.random(), 3) for _ in range(gens)]
            if g == 2:
                rewards[0] = None  # unscorable
            scored = [r for r in rewards if r is not None]
            mean = sum(scored) / len(scored)
            std = (sum((r - mean) ** 2 for r in scored) / max(1, len(scored) - 1)) ** 0.5
            for i in range(gens):
                r = rewards[i]
                adv = 0.0 if r is None or std == 0 else (r - mean) / (std + 1e-4)
                images = [ImageIn(png(colours[(k + g) % 4])) for k in range(n_images)]
                completion = f"step {step} group {g} completion {i}" + (" <script>alert(1)</script>" if i == 3 else "")
                rows.append(
                    SampleIn(
                        group=g,
                        index=i,
                        prompt=[{"role": "user", "content": [{"type": "text", "text": f"q{g}"}]}],
                        completion=completion,
                        images=images,
                        rewards={"acc": r, "fmt": None},
                        reward=r,
                        advantage=adv,
                        completion_length=5 + i,
                        truncated=i == 2,
                        group_mean=mean,
                        group_std=std,
                        dataset_row=g,
                    )  # fmt: skip
                )
                expected.append(dict(step=step, group=g, index=i, reward=r, advantage=adv, n_images=n_images,
                                     truncated=i == 2, zero_std=std == 0, length=5 + i, completion=completion))  # fmt: skip
        app.state.writer.append_samples(run_id, step, rows)
    return expected


def _all_pages(client, run, **params):
    items, cursor = [], None
    while True:
        page = client.get(f"{API}/runs/{run}/samples", params={**params, **({"cursor": cursor} if cursor else {})})
        assert page.status_code == 200, page.text
        body = page.json()
        items += body["items"]
        cursor = body["next_cursor"]
        if cursor is None:
            return items


def test_sample_filters_and_sorts_match_a_hand_computed_expectation(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    expected = _fill(app, run)
    key = lambda e: (e["step"], e["group"], e["index"])  # noqa: E731
    got_key = lambda s: (s["step"], s["group"], s["index"])  # noqa: E731
    cases = [
        ({}, lambda e: True),
        ({"step": 2}, lambda e: e["step"] == 2),
        ({"min_step": 2, "max_step": 3}, lambda e: 2 <= e["step"] <= 3),
        ({"min_reward": 0.5}, lambda e: e["reward"] is not None and e["reward"] >= 0.5),
        ({"max_reward": 0.5}, lambda e: e["reward"] is not None and e["reward"] <= 0.5),
        ({"advantage": "pos"}, lambda e: e["advantage"] > 0),
        ({"advantage": "neg"}, lambda e: e["advantage"] < 0),
        ({"advantage": "zero"}, lambda e: e["advantage"] == 0),
        ({"zero_std_groups": "true"}, lambda e: e["zero_std"]),
        ({"zero_std_groups": "false"}, lambda e: not e["zero_std"]),
        ({"truncated": "true"}, lambda e: e["truncated"]),
        ({"min_images": 2}, lambda e: e["n_images"] >= 2),
        ({"q": "<script>"}, lambda e: "<script>" in e["completion"]),
        ({"q": "group 1 completion"}, lambda e: e["group"] == 1),
    ]
    for params, keep in cases:
        got = _all_pages(client, run, limit=7, **params)
        assert sorted(map(got_key, got)) == sorted(key(e) for e in expected if keep(e)), params
    for sort, nulls in [("reward", True), ("advantage", False), ("completion_length", False), ("step", False)]:
        for prefix in ("", "-"):
            got = _all_pages(client, run, sort=prefix + sort, limit=5)
            assert len(got) == len(expected) and len({s["id"] for s in got}) == len(expected)
            field = "completion_length" if sort == "completion_length" else sort
            vals = [(-1e300 if s[field] is None else s[field]) for s in got]
            assert vals == sorted(vals, reverse=prefix == "-"), (sort, prefix)
            if nulls and prefix == "-":
                assert got[-1]["reward"] is None  # unscorable rows sort lowest
    assert client.get(f"{API}/runs/{run}/samples", params={"sort": "prompt; drop table"}).status_code == 422


def test_sample_rows_carry_images_and_group_info(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    _fill(app, run, steps=1)
    rows = client.get(f"{API}/runs/{run}/samples", params={"limit": 100}).json()["items"]
    group0 = [r for r in rows if r["group"] == 0]
    assert all(r["zero_std"] and r["group_std"] == 0 and r["group_mean"] == 1.0 for r in group0)
    with_images = [r for r in rows if r["num_images"] == 2][0]
    assert len(with_images["images"]) == 2 and with_images["images"][0]["width"] == 24
    assert with_images["rewards"] == {"acc": with_images["reward"], "fmt": None}
    image = client.get(with_images["images"][0]["url"])
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"
    assert "immutable" in image.headers["cache-control"] and image.headers["etag"]
    assert (
        client.get(with_images["images"][0]["url"], headers={"If-None-Match": image.headers["etag"]}).status_code == 304
    )
    thumb = client.get(with_images["images"][0]["thumb_url"])
    assert thumb.status_code == 200 and Image.open(io.BytesIO(thumb.content)).size[0] <= 160


def test_each_distinct_image_is_stored_once_and_a_step_is_one_transaction(api):
    client, _, _, app = api
    from collage.app.store.tables import Image as ImageRow
    from collage.app.store.tables import Sample, SampleImage

    run = client.post(API + "/runs", json=config()).json()["id"]
    pngs = [png((i, 0, 0)) for i in range(3)]
    rows = [
        SampleIn(group=i // 4, index=i % 4, prompt="p", completion="c", images=[ImageIn(p) for p in pngs],
                 rewards={"a": 1.0}, reward=1.0, advantage=0.0, completion_length=1, truncated=False)
        for i in range(64)
    ]  # fmt: skip
    commits = []
    listener = lambda conn: commits.append(1)  # noqa: E731
    event.listen(app.state.engine, "commit", listener)
    try:
        app.state.writer.append_samples(run, 1, rows)
    finally:
        event.remove(app.state.engine, "commit", listener)
    assert len(commits) == 1  # 64 rows x 3 images: one transaction
    assert count_rows(app, Sample) == 64 and count_rows(app, SampleImage) == 192 and count_rows(app, ImageRow) == 3
    app.state.writer.append_samples(run, 1, rows)  # a redelivered step replaces, never duplicates
    assert count_rows(app, Sample) == 64 and count_rows(app, ImageRow) == 3
    files = list((app.state.settings.artifacts / "images").rglob("*.png"))
    assert len(files) == 3


def test_image_ids_are_never_paths(api):
    client, _, _, _ = api
    for bad in ["../../etc/passwd", "..%2F..%2Fetc%2Fpasswd", "a" * 63, "A" * 64, "g" * 64, "%00" + "a" * 61]:
        response = client.get(f"{API}/images/{bad}")
        assert response.status_code in (404, 422), (bad, response.status_code)
    assert client.get(f"{API}/images/{'a' * 64}").status_code == 404
    assert client.get(f"{API}/images/{'a' * 64}", params={"size": "huge"}).status_code == 422


def test_exports(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    expected = _fill(app, run, steps=2)
    app.state.writer.append_metrics(run, 1, {"reward": 0.5, "loss": 1.0})
    jsonl = client.get(f"{API}/runs/{run}/export", params={"what": "samples", "format": "jsonl"})
    assert jsonl.status_code == 200 and "attachment" in jsonl.headers["content-disposition"]
    rows = [json.loads(line) for line in jsonl.text.splitlines()]
    assert len(rows) == len(expected) and all(len(r["images"]) == r["num_images"] for r in rows)
    table = list(csv.DictReader(io.StringIO(client.get(f"{API}/runs/{run}/export", params={"format": "csv"}).text)))
    assert len(table) == len(expected) and json.loads(table[0]["prompt"])[0]["role"] == "user"
    import pyarrow.parquet as pq

    parquet = client.get(f"{API}/runs/{run}/export", params={"format": "parquet"})
    assert pq.read_table(io.BytesIO(parquet.content)).num_rows == len(expected)
    metrics = client.get(f"{API}/runs/{run}/export", params={"what": "metrics", "format": "csv"}).text
    assert list(csv.DictReader(io.StringIO(metrics))) == [
        {"run_id": run, "step": "1", "key": "loss", "value": "1.0"},
        {"run_id": run, "step": "1", "key": "reward", "value": "0.5"},
    ]
    assert client.get(f"{API}/runs/{run}/export", params={"format": "xlsx"}).status_code == 422


def test_events_warning_count_and_stream(api):
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    w = app.state.writer
    w.transition(run, ["queued"], "running")
    w.add_event(run, "warning", "images dropped for text reward model")
    w.set_progress(run, 2)
    w.append_metrics(run, 1, {"reward": 0.2})
    w.append_metrics(run, 2, {"reward": 0.4})
    w.transition(run, ["running"], "succeeded")
    assert client.get(f"{API}/runs/{run}").json()["warning_count"] == 1
    warnings = client.get(f"{API}/runs/{run}/events", params={"level": "warning"}).json()["items"]
    assert [e["message"] for e in warnings] == ["images dropped for text reward model"]
    with client.stream("GET", f"{API}/runs/{run}/stream", params={"poll": 0.1}) as stream:
        text = "".join(stream.iter_text())
    assert "event: status" in text and '"status": "succeeded"' in text
    assert "event: metrics" in text and '"reward": 0.4' in text and "event: progress" in text


def test_catalog(api):
    client, _, _, _ = api
    rewards = client.get(API + "/rewards").json()
    names = {r["name"] for r in rewards["builtins"]}
    assert {"accuracy", "format", "length", "red_count"} <= names and all(r["doc"] for r in rewards["builtins"])
    models = client.get(API + "/models").json()
    assert "tiny:qwen2-vl" in models["tiny"] and {f["layout"] for f in models["families"]} >= {"grid", "batch_padded"}


@pytest.mark.parametrize("broker_up", [True, False])
def test_health_reports_the_real_broker(database_url, tmp_path, broker_up):
    """The Celery dispatcher's own broker check: a reachable broker is ok, a closed port is 503 with the error."""
    from fastapi.testclient import TestClient

    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.store.engine import engine_for
    from collage.worker.dispatcher import CeleryDispatcher

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    broker = "memory://" if broker_up else f"redis://127.0.0.1:{closed}/0"
    settings = Settings(home=tmp_path, database_url=database_url, broker_url=broker, artifacts=tmp_path / "a")
    app = create_app(settings, CeleryDispatcher(settings, engine_for(database_url)))
    from collage.app.store.tokens import create_token

    token = create_token(engine_for(database_url), "ops")
    assert TestClient(app).get(API + "/health").json() == {"ok": broker_up}  # without a token: ok or not
    response = TestClient(app, headers={"Authorization": f"Bearer {token}"}).get(API + "/health")
    body = response.json()
    assert body["store"]["ok"] is True
    assert body["broker"]["ok"] is broker_up and body["ok"] is broker_up
    assert response.status_code == (200 if broker_up else 503)
    if not broker_up:
        assert str(closed) in body["broker"]["url"] and "Error" in body["broker"]["error"]


def test_the_app_refuses_an_unmigrated_database(tmp_path):
    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.store.engine import DatabaseNotMigrated
    from tests.support.api import RecordingDispatcher

    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'new.db'}", broker_url="memory://",
                        artifacts=tmp_path / "a")  # fmt: skip
    with pytest.raises(DatabaseNotMigrated, match="collage db upgrade"):
        create_app(settings, RecordingDispatcher())


def test_out_of_range_numbers_are_422_not_500(api):
    client, _, _, _ = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    big = str(2**40)
    for path, params in [("/metrics", {"from_step": big}), ("/samples", {"step": big}), ("/samples", {"min_images": big}),
                         ("/events", {"after": str(2**70)}), ("/metrics", {"max_points": big})]:  # fmt: skip
        assert client.get(f"{API}/runs/{run}{path}", params=params).status_code == 422, (path, params)
    assert client.post(API + "/runs", json=config(train={"max_steps": 2**40})).status_code == 422
    nan = client.post(
        API + "/runs", content=b'{"train": {"learning_rate": NaN}}', headers={"Content-Type": "application/json"}
    )
    assert nan.status_code == 422


def test_text_search_is_indexed_on_postgresql(migrated_postgres_url):
    from sqlalchemy import text

    from collage.app.store.engine import engine_for

    with engine_for(migrated_postgres_url).connect() as conn:
        indexes = dict(
            conn.execute(text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'samples'")).all()
        )
        mode = conn.execute(text("SHOW plan_cache_mode")).scalar_one()
    trigram = {name: definition for name, definition in indexes.items() if "gin_trgm_ops" in definition}
    # one per text column, each led by the run id (0009): a search reads the run's matches, not the table's
    assert sorted(trigram) == ["ix_samples_run_completion_trgm", "ix_samples_run_prompt_text_trgm"], indexes
    assert "USING gin (run_id, completion gin_trgm_ops)" in trigram["ix_samples_run_completion_trgm"]
    assert "USING gin (run_id, prompt_text gin_trgm_ops)" in trigram["ix_samples_run_prompt_text_trgm"]
    assert mode == "force_custom_plan"


def test_downsampled_series_follow_rewrites_and_truncation(api):
    """The rollups behind downsampling always match the raw points: after a rewrite that removes a bucket's
    extreme, and after a resumed run drops the steps past its checkpoint."""
    client, _, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    w = app.state.writer
    rng = random.Random(3)
    values = {s: rng.uniform(-1, 1) for s in range(1, 3001)}
    values[100] = 9.0
    for s, v in values.items():
        w.append_metrics(run, s, {"loss": v})

    def series(**params):
        return client.get(f"{API}/runs/{run}/metrics", params={"keys": "loss", "max_points": 61, **params}).json()[
            "loss"
        ]

    def check(points, truth):
        assert len(points) <= 61 and [p[0] for p in points] == sorted(p[0] for p in points)
        assert all(truth[s] == v for s, v in points)
        assert points[-1][0] == max(truth)
        lo, hi = min(truth.values()), max(truth.values())
        assert any(v == lo for _, v in points) and any(v == hi for _, v in points)

    check(series(), values)
    assert [100, 9.0] in series()
    w.append_metrics(run, 100, {"loss": 0.0})  # the old maximum is gone
    values[100] = 0.0
    check(series(), values)
    assert [100, 9.0] not in series()
    w.begin_attempt(run, 1999, max_steps=3000)  # resumed from step 1999
    values = {s: v for s, v in values.items() if s <= 1999}
    check(series(), values)
    for s in range(2000, 2101):
        w.append_metrics(run, s, {"loss": -5.0 if s == 2050 else 0.5})
        values[s] = -5.0 if s == 2050 else 0.5
    check(series(), values)
    assert [2050, -5.0] in series()
    inner = series(from_step=500, to_step=1500)
    assert inner[0][0] >= 500 and inner[-1][0] == 1500


def test_migration_0004_backfills_rollups_of_existing_metrics(tmp_path):
    from sqlalchemy import text

    from collage.app.store.engine import make_engine, upgrade
    from collage.app.store.rollups import downsample

    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0003")
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name, algorithm, config, status, step, max_steps, model_path, "
                          "dataset_source, created_at, updated_at, attempt, warning_count) VALUES ('r', 'n', 'grpo', "
                          "'{}', 'succeeded', 0, 0, '', '', '2026-01-01 00:00:00', '2026-01-01 00:00:00', 1, 0)"))  # fmt: skip
        conn.execute(text("INSERT INTO metrics (run_id, key, step, value) VALUES ('r', 'loss', :s, :v)"),
                     [{"s": s, "v": float(s % 97) - (300.0 if s == 1234 else 0.0)} for s in range(1, 5001)])  # fmt: skip
    upgrade(url)
    with Session(engine) as session:
        points = downsample(session, "r", {"loss": (1, 5000)}, 101)["loss"]
    assert [1234, 1234 % 97 - 300.0] in points and len(points) <= 101
    engine.dispose()
