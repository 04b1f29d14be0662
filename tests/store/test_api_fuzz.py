"""Property-based fuzzing of the whole REST API from its OpenAPI schema (schemathesis): no input gives a 5xx.

Runs against the real app on SQLite and on PostgreSQL, authenticated, with a run, samples, metrics and an
image in the store so that valid ids are reachable too. Every operation of the schema is fuzzed.
"""

from __future__ import annotations

from collections import Counter

import schemathesis
from hypothesis import HealthCheck, given, settings

from collage.app.store.writer import ImageIn, SampleIn
from tests.support import API
from tests.support.api import config, png

EXAMPLES = {"default": 30, "/datasets": 6, "/stream": 8, "/plan": 10}  # the dataset helper's routes: fewer


def _examples(path: str) -> int:
    return next((n for key, n in EXAMPLES.items() if key in path), EXAMPLES["default"])


def test_no_input_gives_a_server_error(api, monkeypatch):
    client, token, _, app = api
    # the dataset helper is a process (tests/processes fuzzes nothing through it): here an input that would reach
    # it (a valid config for POST /plan) gets the helper's refusal, so everything before it is still fuzzed
    from fastapi import HTTPException

    from collage.app.datasets import client as dataset_helper

    def no_helper(request, timeout):
        raise HTTPException(400, f"the dataset helper does not run in this test tier ({request['op']})")

    monkeypatch.setattr(dataset_helper, "_ask", no_helper)
    run = client.post(API + "/runs", json=config()).json()["id"]
    rows = [
        SampleIn(group=0, index=i, prompt="p", completion="c", images=[ImageIn(png((i, 1, 2)))], rewards={"a": 0.5},
                 reward=0.5, advantage=0.0, completion_length=2, truncated=False, group_mean=0.5, group_std=0.0)
        for i in range(4)
    ]  # fmt: skip
    app.state.writer.append_samples(run, 1, rows)
    app.state.writer.append_metrics(run, 1, {"reward": 0.5})
    schema = schemathesis.openapi.from_asgi(f"{API}/openapi.json", app)
    headers = {"Authorization": f"Bearer {token}"}
    failures = []
    statuses: Counter[int] = Counter()  # answers by class (200, 400, 500), so a fuzz that reached nothing fails
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 17
    sha = client.get(f"{API}/runs/{run}/samples").json()["items"][0]["images"][0]["sha256"]
    real = {"run_id": run, "sha256": sha}
    for operation, use_real in [(op, flag) for op in operations for flag in (False, True)]:
        if use_real and "{" not in operation.path:
            continue

        @settings(max_examples=_examples(operation.path), deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True, database=None)  # fmt: skip
        @given(case=operation.as_strategy())
        def fuzz(case):
            if use_real:  # noqa: B023 - fuzz() runs inside this iteration
                case.path_parameters = {k: real.get(k, v) for k, v in (case.path_parameters or {}).items()}
            if case.path.endswith("/stream"):
                case.query = {**(case.query or {}), "poll": 0.1}
            response = case.call(headers=headers)
            statuses[response.status_code // 100 * 100] += 1
            if response.status_code >= 500:
                failures.append((case.method, case.formatted_path, case.query, case.body, response.text[:300]))

        if use_real and operation.path.endswith("/stream"):
            # a live run's stream would never end
            app.state.writer.transition(run, ["queued", "running", "cancelling"], "succeeded")
        fuzz()  # once with generated ids, once with the real run's id and image hash (deeper code paths)
    assert statuses[500] == 0 and not failures, f"{len(failures)} server errors (5xx), the first: {failures[:5]}"
    assert statuses[200] and statuses[400], statuses  # both accepted and refused input reached the app
