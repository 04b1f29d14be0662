"""Crafted bad input: every case is a 4xx naming the field, never a 500 or a hang (issue "0 5xx on bad input").

Each test runs against the real app on SQLite and on PostgreSQL (the ``api`` fixture); the schemathesis fuzz in
test_api_fuzz.py covers what generators find, these cases cover what they are unlikely to generate. Also: signed
cursors, CSV cells neutralised, concurrent exports past their limit, and a pool connection for every server thread.
"""

from __future__ import annotations

import asyncio
import base64
import csv
import io
import json
import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlmodel import Session

from collage.app.store.queries import encode_cursor
from collage.app.store.tables import Run
from collage.app.store.writer import SampleIn
from tests.support import API
from tests.support.api import config

NUL = "must not contain a NUL byte (\\x00)"


def _client(api) -> TestClient:
    """A client that shows a server error as a 500 response instead of raising it."""
    _, token, _, app = api
    return TestClient(app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {token}"})


def _runs(app) -> int:
    with Session(app.state.engine) as session:
        return session.execute(select(func.count()).select_from(Run)).scalar_one()


def _deep_json(depth: int, leaf: str = "1") -> str:
    """``depth`` nested objects as JSON text (the client's own encoder cannot write this deep)."""
    return '{"a":' * depth + leaf + "}" * depth


def _post_raw(client, path: str, body: str):
    return client.post(API + path, content=body.encode(), headers={"content-type": "application/json"})


def _paths(response) -> dict[str, str]:
    return {e["path"]: e["message"] for e in response.json()["detail"]}


def _samples(app, run: str, completions: list[str], step: int = 1) -> None:
    rows = [
        SampleIn(group=0, index=i, prompt=[{"role": "user", "content": [{"type": "text", "text": "p"}]}],
                 completion=c, images=[], rewards={"acc": 1.0}, reward=1.0, advantage=0.0, completion_length=1,
                 truncated=False, group_mean=1.0, group_std=0.0)
        for i, c in enumerate(completions)
    ]  # fmt: skip
    app.state.writer.append_samples(run, step, rows)


def test_deeply_nested_reward_args_are_422_naming_the_field(api):
    client = _client(api)
    app = api[3]
    template = json.dumps(config(rewards=[{"name": "accuracy"}, {"name": "length", "args": "DEEP"}]))
    for depth in (33, 256, 600):  # 256 and 600 were 500s: pydantic's serialiser gives up at a few hundred levels
        response = _post_raw(client, "/runs", template.replace('"DEEP"', _deep_json(depth)))
        assert response.status_code == 422, (depth, response.text)
        assert _paths(response)["rewards[1].args"].startswith("nested deeper than 32 levels")
    too_deep_to_parse = _post_raw(client, "/runs", template.replace('"DEEP"', _deep_json(5000)))
    # Python's JSON parser refuses it first: still a 422 naming the body, not the generic parse error
    assert too_deep_to_parse.status_code == 422, too_deep_to_parse.text
    assert _paths(too_deep_to_parse)["body"].startswith("nested too deeply to parse")
    assert _runs(app) == 0
    at_the_limit = _post_raw(client, "/runs", template.replace('"DEEP"', _deep_json(32)))
    assert at_the_limit.status_code == 201, at_the_limit.text
    stored = client.get(at_the_limit.json()["url"]).json()["config"]["rewards"][1]["args"]
    assert json.dumps(stored, separators=(",", ":")) == _deep_json(32)


def test_large_or_non_finite_reward_args_are_422(api):
    client = _client(api)
    big = config(rewards=[{"name": "accuracy", "args": {"words": ["w" * 100] * 1000}}])
    response = client.post(API + "/runs", json=big)
    assert response.status_code == 422 and _paths(response)["rewards[0].args"] == "larger than 65536 bytes as JSON"
    nan = json.dumps(config(rewards=[{"name": "accuracy", "args": {"x": [1, "NAN"]}}])).replace('"NAN"', "NaN")
    response = _post_raw(client, "/runs", nan)  # Python's JSON parser accepts NaN; no JSON column does
    assert response.status_code == 422 and _paths(response)["rewards[0].args"] == "numbers must be finite (at x[1])"
    assert _runs(api[3]) == 0


def test_deeply_nested_clone_overrides_are_422_naming_the_field(api):
    client = _client(api)
    app = api[3]
    run = client.post(API + "/runs", json=config()).json()["id"]
    for body in ('{"overrides": {"x": ' + "[" * 300 + "]" * 300 + "}}",
                 '{"overrides": {"rewards": [{"name": "accuracy", "args": ' + _deep_json(33) + "}]}}"):  # fmt: skip
        response = _post_raw(client, f"/runs/{run}/clone", body)
        assert response.status_code == 422, response.text
        assert _paths(response)["overrides"].startswith("nested deeper than 35 levels")
    assert _runs(app) == 1
    # overrides nest like the config: reward args at the config's own limit still clone
    body = '{"overrides": {"rewards": [{"name": "accuracy", "args": ' + _deep_json(32) + "}]}}"
    response = _post_raw(client, f"/runs/{run}/clone", body)
    assert response.status_code == 201, response.text


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def test_run_list_cursors_are_signed(api):
    client = _client(api)
    app = api[3]
    for i in range(3):
        client.post(API + "/runs", json=config(name=f"run-{i}"))
    cursor = client.get(API + "/runs", params={"limit": 1}).json()["next_cursor"]
    assert client.get(API + "/runs", params={"limit": 1, "cursor": cursor}).status_code == 200
    body, tag = cursor.split(".")
    values = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    forged = [
        body + "." + tag[:-2] + ("AA" if tag[-2:] != "AA" else "BB"),  # another signature
        _b64(json.dumps([["runs"], ["2999-01-01T00:00:00", "zzz"]]).encode()) + "." + tag,  # other values
        encode_cursor(values[1], b"not the server's key", ["runs"]),  # well formed, signed with another key
        body,  # no signature
        "garbage!",
        "." * 3,
    ]
    # unsigned cursors of every wrong shape, type and range: the old format, and what a fuzzer would send
    for raw in (["x", "y"], [1, 2], ["2020-01-01T00:00:00", 5], [None, None], {"a": 1}, [], "s", 10**30):
        forged.append(_b64(json.dumps(raw).encode()))
    for bad in forged:
        response = client.get(API + "/runs", params={"cursor": bad})
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["detail"].startswith("cursor is not one this API returned"), bad
    # signed by the server but holding values no page ever ends with: still a 400, never a 500 from the database
    key = app.state.cursor_key
    for values in (["not a time", "x"], ["2020-01-01T00:00:00", 5], ["2020-01-01T00:00:00", "x" * 40], [1, "x"]):
        response = client.get(API + "/runs", params={"cursor": encode_cursor(values, key, ["runs"])})
        assert response.status_code == 400, (values, response.text)
    for values in ([], ["2020-01-01T00:00:00"], ["2020-01-01T00:00:00", "x", 3]):
        response = client.get(API + "/runs", params={"cursor": encode_cursor(values, key, ["runs"])})
        assert response.status_code == 400, (values, response.text)
    assert client.get(API + "/runs", params={"cursor": "a" * 501}).status_code == 422


def test_sample_cursors_belong_to_their_run_and_sort_order(api):
    client = _client(api)
    app = api[3]
    run, other = (client.post(API + "/runs", json=config()).json()["id"] for _ in range(2))
    for r in (run, other):
        _samples(app, r, ["a", "b", "c", "d"])
    page = client.get(f"{API}/runs/{run}/samples", params={"sort": "-reward", "limit": 1}).json()
    cursor = page["next_cursor"]
    ok = client.get(f"{API}/runs/{run}/samples", params={"sort": "-reward", "limit": 1, "cursor": cursor})
    assert ok.status_code == 200 and ok.json()["items"][0]["id"] != page["items"][0]["id"]
    for sort in ("reward", "-advantage", "step"):
        response = client.get(f"{API}/runs/{run}/samples", params={"sort": sort, "cursor": cursor})
        assert response.status_code == 400, (sort, response.text)
        assert response.json()["detail"] == (
            f"cursor was made for the samples of run {run} sorted by -reward, not for the samples of run {run} "
            f"sorted by {sort}: request the first page again without it"
        )
    response = client.get(f"{API}/runs/{other}/samples", params={"sort": "-reward", "cursor": cursor})
    assert (
        response.status_code == 400
        and f"run {run} sorted by -reward, not for the samples of run {other}" in (response.json()["detail"])
    )
    runs_cursor = client.get(API + "/runs", params={"limit": 1}).json()["next_cursor"]
    response = client.get(f"{API}/runs/{run}/samples", params={"cursor": runs_cursor})
    assert response.status_code == 400 and response.json()["detail"].startswith("cursor was made for the run list")
    # signed values of the wrong type or range for the sort column (these were 500s before signing)
    key = app.state.cursor_key
    for sort, values in [("step", [10**30, 1]), ("step", [1, 10**30]), ("step", [1.5, 1]), ("step", [True, 1]),
                         ("reward", [True, 1]), ("reward", ["a", 1]), ("-advantage", [1.0, 2**70]),
                         ("reward", [1.0, None]), ("step", [None, 1])]:  # fmt: skip
        bad = encode_cursor(values, key, ["samples", run, sort])
        response = client.get(f"{API}/runs/{run}/samples", params={"sort": sort, "cursor": bad})
        assert response.status_code == 400, (sort, values, response.text)
    # and unsigned ones (the old format) are refused before any value is looked at
    for values in ([float("inf"), 1], [1, 10**30], ["a", 1]):
        unsigned = _b64(json.dumps(values).encode())
        assert client.get(f"{API}/runs/{run}/samples", params={"cursor": unsigned}).status_code == 400


@pytest.mark.parametrize(
    "changes,path",
    [({"name": "a\x00b"}, "name"), ({"tags": ["ok", "t\x00"]}, "tags"), ({"model": {"path": "tiny:\x00"}}, "model.path"),
     ({"dataset": {"source": "synth:count-red\x00"}}, "dataset.source"), ({"dataset": {"split": "\x00"}}, "dataset.split"),
     ({"rewards": [{"name": "accuracy\x00"}]}, "rewards[0].name"),
     ({"rewards": [{"name": "accuracy", "args": {"k\x00": 1}}]}, "rewards[0].args"),
     ({"rewards": [{"name": "accuracy", "args": {"k": {"deeper": ["v\x00"]}}}]}, "rewards[0].args"),
     ({"model": {"lora": {"target_modules": ["q_proj\x00"]}}}, "model.lora.target_modules"),
     ({"resources": {"queue": "q\x00"}}, "resources.queue")],
)  # fmt: skip
def test_nul_bytes_in_the_run_config_are_422_naming_the_field(api, changes, path):
    client = _client(api)
    response = client.post(API + "/runs", json=config(**changes))
    assert response.status_code == 422, response.text
    assert path in _paths(response), response.text
    assert _runs(api[3]) == 0


def test_nul_bytes_in_other_request_bodies_are_422(api):
    client = _client(api)
    run = client.post(API + "/runs", json=config()).json()["id"]
    response = client.post(f"{API}/runs/{run}/clone", json={"overrides": {"name": "x\x00"}})
    assert response.status_code == 422 and _paths(response) == {"overrides": "strings " + NUL + " (at name)"}
    response = client.post(f"{API}/runs/{run}/clone", json={"overrides": {"train.max\x00": 1}})
    assert response.status_code == 422 and _paths(response) == {"overrides": "keys " + NUL}
    for field in ("source", "split", "model"):
        body = {"source": "synth:count-red", field: "synth:count-red\x00"}
        response = client.post(API + "/datasets/check", json=body)
        assert response.status_code == 422 and _paths(response) == {field: NUL}, response.text
    assert _runs(api[3]) == 1


def test_nul_bytes_in_query_and_path_parameters_are_422_naming_them(api):
    client = _client(api)
    run = client.post(API + "/runs", json=config()).json()["id"]
    cases = [
        (f"{API}/runs?q=a%00b", "query.q"),
        (f"{API}/runs?status=queued%00", "query.status"),
        (f"{API}/runs?tag=%00", "query.tag"),
        (f"{API}/runs?cursor=abc%00", "query.cursor"),
        (f"{API}/runs/{run}/samples?q=%00", "query.q"),
        (f"{API}/runs/{run}/samples?limit=2&sort=step&q=x%00y", "query.q"),
        (f"{API}/runs/{run}/metrics?keys=a%00", "query.keys"),
        (f"{API}/runs/{run}/events?level=info%00", "query.level"),
        (f"{API}/datasets/preview?source=synth:count-red%00", "query.source"),
        (f"{API}/runs?q%00=x", "query"),
        (f"{API}/runs/a%00b", "path.run_id"),
        (f"{API}/runs/a%00b/samples", "path.run_id"),
        (f"{API}/runs/a%00b/export", "path.run_id"),
        (f"{API}/images/{'a' * 63}%00", "path.sha256"),
        ("/nowhere/%00", "path"),
    ]
    for url, path in cases:
        for method in ("GET", "POST", "DELETE"):
            response = client.request(method, url)
            assert response.status_code == 422, (method, url, response.text)
            assert response.json() == {"detail": [{"path": path, "message": NUL}]}, (method, url)
    assert client.get(f"{API}/runs/{run}").status_code == 200  # nothing else is caught


ABOVE_MAX = [
    ("dataset.rows", 10_000_001), ("dataset.min_images", 65), ("dataset.max_images", 65), ("dataset.seed", 2**32),
    ("train.max_steps", 10**30), ("train.learning_rate", 1e308), ("train.per_device_train_batch_size", 1025),
    ("train.gradient_accumulation_steps", 1025), ("train.num_generations", 1026), ("train.max_prompt_length", 2**63),
    ("train.max_completion_length", 131_073), ("train.temperature", 101.0), ("train.beta", 1e300),
    ("train.epsilon", 101.0), ("train.epsilon_high", 101.0), ("train.num_iterations", 1025),
    ("train.steps_per_generation", 1025), ("train.seed", 2**64), ("train.save_steps", 10_000_001),
    ("train.warmup_steps", 10_000_001), ("train.weight_decay", 101.0), ("train.max_grad_norm", 1e7),
    ("model.lora.r", 4097), ("model.lora.alpha", 65_537), ("resources.gpus", 1025),
    ("logging.samples_every", 10_000_001), ("rewards[0].weight", 1e7), ("rewards[0].weight", -1e7),
]  # fmt: skip


def _with(path: str, value) -> dict:
    data = config(model={"path": "tiny:qwen2-vl", "lora": {"r": 8}})
    section, key = path.split(".")
    if section == "rewards[0]":
        data["rewards"][0][key] = value
    elif section == "model" and key != "path":
        data["model"]["lora"] = {key.split(".")[-1]: value}
    else:
        data.setdefault(section, {})[key] = value
    return data


def test_numbers_above_their_maximum_are_422_naming_the_field(api):
    client = _client(api)
    for path, value in ABOVE_MAX:
        data = _with(path.replace("model.lora.", "model."), value)
        response = client.post(API + "/runs", json=data)
        assert response.status_code == 422, (path, response.text)
        assert "than or equal to" in _paths(response).get(path, ""), (path, response.text)
    assert _runs(api[3]) == 0


def test_csv_export_cells_that_would_run_as_formulas_are_neutralised(api):
    client = _client(api)
    app = api[3]
    run = client.post(API + "/runs", json=config()).json()["id"]
    texts = ['=HYPERLINK("http://evil","x")', "+1+2", "-2+3", "@SUM(A1)", "\tx", "\rx", "plain", "a=b", ""]
    _samples(app, run, texts)
    app.state.writer.append_metrics(run, 1, {"=cmd|' /C calc'!A0": 1.0, "loss": -0.5})
    response = client.get(f"{API}/runs/{run}/export", params={"format": "csv"})
    assert response.status_code == 200
    rows = sorted(csv.DictReader(io.StringIO(response.text, newline="")), key=lambda r: int(r["index"]))
    assert [r["completion"] for r in rows] == [
        "'" + t if t[:1] in ("=", "+", "-", "@", "\t", "\r") else t for t in texts
    ]
    assert rows[0]["advantage"] == "0.0" and json.loads(rows[0]["prompt"])[0]["role"] == "user"
    metrics = client.get(f"{API}/runs/{run}/export", params={"what": "metrics", "format": "csv"}).text
    table = {r["key"]: r["value"] for r in csv.DictReader(io.StringIO(metrics))}
    assert table == {"'=cmd|' /C calc'!A0": "1.0", "loss": "-0.5"}  # numbers stay numbers, even negative ones
    jsonl = client.get(f"{API}/runs/{run}/export", params={"format": "jsonl"}).text  # only CSV is for spreadsheets
    assert sorted(json.loads(line)["completion"] for line in jsonl.splitlines()) == sorted(texts)


class _SlowClient:
    """One HTTP client of the ASGI app. Of a 200 answer it reads the first body chunk, then stalls (the app's
    ``send`` blocks, as it does for a slow download) until :meth:`resume`, or until :meth:`hang_up`. A server of
    ASGI spec 2.3 (uvicorn) tells the app of a gone client through ``receive``; one of spec 2.4 by failing ``send``
    with an OSError: both are exercised."""

    def __init__(self, app, token: str, path: str, query: str, spec: str = "2.3"):
        self.app, self.spec, self.status, self.headers, self.chunks = app, spec, None, {}, []
        self.scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
            "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
            "root_path": "", "headers": [(b"host", b"testserver"), (b"authorization", f"Bearer {token}".encode())],
            "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
        }  # fmt: skip
        self.first_chunk, self.wake, self.gone = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.sent_request = self.stalled = False

    def resume(self) -> None:
        self.wake.set()

    def hang_up(self) -> None:
        self.gone.set()
        if self.spec >= "2.4":
            self.wake.set()

    async def receive(self):
        if not self.sent_request:
            self.sent_request = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode().lower(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            self.chunks.append(message.get("body", b""))
            self.first_chunk.set()
            if self.status == 200 and not self.stalled:
                self.stalled = True
                await self.wake.wait()
            if self.gone.is_set():
                raise OSError("the client hung up")

    async def run(self):
        try:
            await self.app(self.scope, self.receive, self.send)
        except Exception:  # a hung-up client's request may end in ClientDisconnect: it is gone anyway
            if not self.gone.is_set():
                raise
        self.first_chunk.set()  # an answer without a body counts as read


def test_concurrent_exports_beyond_the_limit_are_429_and_streams_hold_no_connection(api):
    _, token, _, app = api
    client = _client(api)
    run = client.post(API + "/runs", json=config()).json()["id"]
    _samples(app, run, ["a", "b", "c"])
    limit = app.state.settings.max_exports
    assert limit >= 3
    path = f"{API}/runs/{run}/export"
    pool = app.state.engine.pool

    async def scenario():
        async def start(query="format=jsonl", spec="2.3"):
            c = _SlowClient(app, token, path, query, spec)
            task = asyncio.create_task(c.run())
            await asyncio.wait_for(c.first_chunk.wait(), 30)
            return c, task

        streams = [await start("format=jsonl"), await start("format=jsonl", spec="2.4"), await start("format=csv")]
        streams += [await start("format=parquet") for _ in range(limit - 3)]
        assert [c.status for c, _ in streams] == [200] * limit
        # every stream is stalled by its slow client after its first rows: none holds a database connection
        assert pool.checkedout() == 0, pool.status()
        refused, task = await start()
        await task
        assert refused.status == 429 and refused.headers["retry-after"] == "10", refused.chunks
        assert json.loads(b"".join(refused.chunks))["detail"].startswith(f"{limit} downloads are running")
        # clients that hang up (either way a server may tell) give their slots back, and so does one that finishes
        for _ in range(2):
            gone, gone_task = streams.pop(0)
            gone.hang_up()
            await asyncio.wait_for(gone_task, 30)
        done, done_task = streams.pop(0)
        done.resume()
        await asyncio.wait_for(done_task, 30)
        assert b"".join(done.chunks).decode().count("\n") == 4  # the CSV header and three rows
        streams += [await start() for _ in range(3)]
        assert [c.status for c, _ in streams] == [200] * limit
        again, task = await start()
        await task
        assert again.status == 429
        for c, t in streams:
            c.resume()
            await asyncio.wait_for(t, 30)
            assert c.status == 200

    asyncio.run(scenario())
    assert pool.checkedout() == 0
    for _ in range(limit + 1):  # every slot came back
        assert client.get(path, params={"format": "csv"}).status_code == 200


def test_the_pool_has_a_connection_for_every_server_thread(api):
    """Sync routes and streamed exports run on anyio's threads: as many connections must be available at once
    without waiting (a smaller pool makes requests time out under load)."""
    import anyio.to_thread

    async def threads() -> int:
        return int(anyio.to_thread.current_default_thread_limiter().total_tokens)

    engine = api[3].state.engine
    connections = []
    started = time.monotonic()
    try:
        for _ in range(anyio.run(threads)):
            connections.append(engine.connect())
    finally:
        for connection in connections:
            connection.close()
    assert time.monotonic() - started < 20  # a pool too small waits 30 s for a connection, then fails
