"""The API tried as an attacker with an ordinary member token would, on SQLite and PostgreSQL, through a real server
where it matters: streams end when their token or session does, one delete of a run wins, input patterns match
whole values, tracebacks reach admins only, cookie writes come from this site, and private answers are not cached."""

from __future__ import annotations

import json
import re
import threading
import time
import traceback

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update
from sqlmodel import Session

from collage.app.store.tables import AuditEntry, Run
from collage.app.store.tokens import create_token, revoke_token
from tests.support import API
from tests.support.api import config, member_and_token, png
from tests.support.live_server import browser_login, page_csrf, serving
from tests.support.waiting import scaled


def _sse(response: httpx.Response):
    """``(event, data)`` pairs of a server-sent event stream, as they arrive, until it ends."""
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            yield name, json.loads(line[len("data: ") :])


@pytest.mark.parametrize("how", ["bearer revoked", "cookie session, token revoked", "cookie session logged out"])
def test_an_open_stream_ends_once_its_token_or_session_does(api, how):
    admin, _, _, app = api
    secret = create_token(app.state.engine, "streamer")
    run = admin.post(API + "/runs", json=config()).json()["id"]
    writer = app.state.writer
    assert writer.transition(run, ["queued"], "running")
    stop = threading.Event()

    def progress():  # the run keeps training: a stream that outlived its credentials would keep sending
        step = 0
        while not stop.wait(0.3):
            step += 1
            writer.set_progress(run, step)

    ticker = threading.Thread(target=progress, daemon=True)
    seen: list[str] = []
    with serving(app) as base:
        if how.startswith("bearer"):
            client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {secret}"}, timeout=scaled(30))
        else:
            client = browser_login(base, secret)
            csrf = page_csrf(client)
        try:
            with client.stream("GET", f"{API}/runs/{run}/stream", params={"poll": 0.2}) as response:
                assert response.status_code == 200
                ticker.start()
                ended_at = None
                for name, data in _sse(response):
                    seen.append(name)
                    if ended_at is None and name == "progress" and data["step"] >= 1:
                        if how.endswith("logged out"):
                            out = client.post("/logout", data={"csrf_token": csrf}, headers={"Origin": base})
                            assert out.status_code == 303
                        else:
                            assert revoke_token(app.state.engine, "streamer") == 1  # `collage token revoke`
                        ended_at = time.monotonic()
                    assert ended_at is None or time.monotonic() - ended_at < scaled(30), (
                        f"the stream outlived it: {seen}"
                    )
            assert ended_at is not None and seen[-1] == "unauthorized", seen
            # and it cannot come back
            assert client.get(f"{API}/runs/{run}/stream").status_code == 401
        finally:
            stop.set()
            if ticker.is_alive():
                ticker.join(scaled(10))
            client.close()


def test_a_stream_with_a_slow_poll_still_rechecks_its_token(api):
    """``poll`` may be up to 10 s: the token is still re-read every few seconds."""
    admin, _, _, app = api
    secret = create_token(app.state.engine, "slow")
    run = admin.post(API + "/runs", json=config()).json()["id"]
    assert app.state.writer.transition(run, ["queued"], "running")
    with serving(app) as base, httpx.Client(base_url=base, timeout=scaled(60)) as client:
        headers = {"Authorization": f"Bearer {secret}"}
        with client.stream("GET", f"{API}/runs/{run}/stream", params={"poll": 10}, headers=headers) as response:
            events = _sse(response)
            assert next(events)[0] == "status"
            revoke_token(app.state.engine, "slow")
            started = time.monotonic()
            rest = [name for name, _ in events]
        # generous: the recheck is every 2 s; a stream that waited out its 10 s polls would take 10 s or more
        assert rest[-1] == "unauthorized" and time.monotonic() - started < 9.5, rest


def test_concurrent_deletes_of_one_run_answer_one_204_and_audit_once(api):
    admin, token, _, app = api
    run = admin.post(API + "/runs", json=config()).json()["id"]
    writer = app.state.writer
    assert writer.transition(run, ["queued"], "running") and writer.transition(run, ["running"], "failed")
    barrier = threading.Barrier(10)
    statuses: list[int] = []

    def delete():
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=scaled(120)) as client:
            assert client.get(API + "/health").status_code == 200  # connected before the race
            barrier.wait()
            statuses.append(client.delete(f"{API}/runs/{run}").status_code)

    with serving(app) as base:
        threads = [threading.Thread(target=delete) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert sorted(statuses) == [204] + [404] * 9, statuses
    with Session(app.state.engine) as session:
        audited = session.scalar(
            select(func.count()).where(AuditEntry.action == "run.delete", AuditEntry.target == run)
        )
        assert audited == 1
        assert session.get(Run, run) is None


def test_deleting_a_run_that_is_active_again_is_409_and_deletes_nothing(api):
    admin, _, _, app = api
    run = admin.post(API + "/runs", json=config()).json()["id"]
    writer = app.state.writer
    assert writer.transition(run, ["queued"], "running") and writer.transition(run, ["running"], "failed")
    writer.append_metrics(run, 1, {"reward": 0.5})
    # resumed between the route's check and the delete: the store's conditional delete refuses it
    assert writer.transition(run, ["failed"], "queued", attempt=Run.attempt + 1)
    assert writer.delete_run(run, actor="tests") is False
    assert admin.get(f"{API}/runs/{run}/metrics").json() == {"reward": [[1, 0.5]]}
    assert admin.delete(f"{API}/runs/{run}").status_code == 409


def test_a_trailing_newline_never_passes_a_pattern(api):
    from collage.app.core.settings import Settings
    from collage.app.core.trust import dataset_violation, model_violation, split_violation
    from collage.training.rewards.registry import import_path_error

    client, _, _, app = api
    allowed = ("tests.support.rewards",)
    assert import_path_error("tests.support.rewards:starts_with_digit", allowed) is None
    assert import_path_error("tests.support.rewards:starts_with_digit\n", allowed) is not None
    settings: Settings = app.state.settings
    for good, bad in (("tiny:qwen2-vl", "tiny:qwen2-vl\n"), ("org/name", "org/name\n")):
        assert model_violation(good, settings) is None and model_violation(bad, settings) is not None
    for good, bad in (("synth:count-red", "synth:count-red\n"), ("org/data", "org/data\n")):
        assert dataset_violation(good, settings) is None and dataset_violation(bad, settings) is not None
    assert split_violation("train[:10%]") is None and split_violation("train\n") is not None
    # at submit: the whole config is refused, naming the field
    bad = client.post(API + "/runs", json=config(rewards=[{"name": "tests.support.rewards:starts_with_digit\n"}]))
    assert bad.status_code == 422 and "rewards[0].name" in [d["path"] for d in bad.json()["detail"]], bad.text
    good = client.post(API + "/runs", json=config(rewards=[{"name": "tests.support.rewards:starts_with_digit"}]))
    assert good.status_code == 201, good.text


def _a_traceback() -> str:
    def crash():
        raise RuntimeError("the reward's table is missing")

    try:
        crash()
    except RuntimeError as exc:
        return "".join(traceback.format_exception(exc))
    raise AssertionError("unreachable")


def test_tracebacks_reach_admins_only(api):
    admin, _, _, app = api
    member, secret = member_and_token(app)
    writer = app.state.writer
    server_path = __file__  # what a traceback gives away: where the code lives on the server
    tb = _a_traceback()
    assert server_path in tb
    run = admin.post(API + "/runs", json=config()).json()["id"]
    assert writer.transition(run, ["queued"], "running")
    writer.add_event(run, "error", tb)  # what the trainer reports for an unexpected error
    # what the worker's child stores for a reward that raised: a message, then the traceback
    assert writer.transition(
        run, ["running"], "failed", error=f"reward 'lookup' raised on dataset row 3 (2 images)\n{tb}"
    )
    public = "reward 'lookup' raised on dataset row 3 (2 images): RuntimeError: the reward's table is missing"

    mine = member.get(f"{API}/runs/{run}").json()
    assert mine["error"] == public and mine["error_detail"] is None
    assert [r["error"] for r in member.get(API + "/runs").json()["items"]] == [public]
    events = member.get(f"{API}/runs/{run}/events").json()
    assert server_path not in json.dumps(events) and "Traceback" not in json.dumps(events)
    assert "RuntimeError: the reward's table is missing" in [e["message"] for e in events["items"]]
    assert member.get(f"{API}/runs/{run}/events", params={"level": "traceback"}).json()["items"] == []
    with member.stream("GET", f"{API}/runs/{run}/stream") as response:
        streamed = response.read().decode()
    assert public in streamed and server_path not in streamed

    theirs = admin.get(f"{API}/runs/{run}").json()
    assert theirs["error"] == public and server_path in theirs["error_detail"]
    assert theirs["error_detail"].startswith("reward 'lookup' raised") and "Traceback" in theirs["error_detail"]
    details = [e for e in admin.get(f"{API}/runs/{run}/events").json()["items"] if e["level"] == "traceback"]
    assert len(details) == 2 and all(server_path in e["message"] for e in details)

    # a run that failed before tracebacks moved out of `error` keeps it there: members still see one line
    with Session(app.state.engine) as session:
        session.execute(update(Run).where(Run.id == run).values(error=tb))
        session.commit()
    assert member.get(f"{API}/runs/{run}").json()["error"] == "RuntimeError: the reward's table is missing"
    assert admin.get(f"{API}/runs/{run}").json()["error_detail"] == tb


def test_cookie_writes_from_another_origin_are_refused(api, database_url, tmp_path):
    _, token, _, app = api
    browser = TestClient(app, base_url="http://testserver")
    page = browser.get("/login")
    login_csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    # a login form posted from another site is refused too (login CSRF)
    evil_login = browser.post(
        "/login",
        data={"token": token, "csrf_token": login_csrf},
        headers={"Origin": "http://evil.example"},
        follow_redirects=False,
    )
    assert evil_login.status_code == 403 and "collage_session" not in browser.cookies
    done = browser.post(
        "/login",
        data={"token": token, "csrf_token": login_csrf},
        headers={"Origin": "http://testserver"},
        follow_redirects=False,
    )
    assert done.status_code == 303
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', browser.get("/runs").text).group(1)

    def post(**headers):
        return browser.post(API + "/runs", json=config(), headers={"X-CSRF-Token": csrf, **headers})

    assert post(Origin="http://testserver").status_code == 201
    assert post(Origin="http://testserver:80").status_code == 201
    assert post(Referer="http://testserver/launch").status_code == 201  # no Origin: the Referer decides
    assert post().status_code == 201  # neither header (a script): the CSRF token alone
    for headers in (
        {"Origin": "http://evil.example"},
        {"Origin": "null"},  # an opaque origin: a sandboxed frame, a page that withholds its referrer
        {"Origin": "http://testserver:8080"},  # another port is another origin
        {"Origin": "https://testserver"},  # and another scheme
        {"Referer": "http://evil.example/page"},
    ):
        refused = post(**headers)
        assert refused.status_code == 403 and "cross-origin" in refused.json()["detail"], headers
    # the bearer path has no cookie to abuse: Origin does not matter
    bearer = TestClient(app, headers={"Authorization": f"Bearer {token}", "Origin": "http://evil.example"})
    assert bearer.post(API + "/runs", json=config()).status_code == 201


@pytest.mark.parametrize("trusted", [True, False])
def test_behind_a_trusted_proxy_the_origin_is_the_forwarded_scheme(database_url, tmp_path, trusted):
    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from tests.support.api import RecordingDispatcher

    settings = Settings(home=tmp_path, database_url=database_url, broker_url="memory://",
                        artifacts=tmp_path / "a", forwarded_allow_ips="*" if trusted else "10.9.9.9")  # fmt: skip
    app = create_app(settings, RecordingDispatcher())
    token = create_token(app.state.engine, "proxied")
    # TLS ends at the proxy: the browser's origin is https://collage.example, the app hears http
    browser = TestClient(app, base_url="http://collage.example", headers={"X-Forwarded-Proto": "https"})
    page = browser.get("/login")
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    # the form's cookie is Secure when the proxy is trusted: the browser sends it back over https (the client here
    # talks plain http to the app, so it is sent by hand)
    done = browser.post(
        "/login",
        data={"token": token, "csrf_token": csrf},
        headers={"Origin": "https://collage.example", "Cookie": f"collage_login_csrf={csrf}"},
        follow_redirects=False,
    )
    assert done.status_code == (303 if trusted else 403)


def test_private_answers_are_never_cached_static_files_and_images_are(api):
    from collage.app.store.writer import ImageIn, SampleIn

    client, token, _, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]

    image = png((200, 0, 0))
    row = SampleIn(0, 0, "p", "c", [ImageIn(image)], {}, 1.0, 0.0, 1, False)
    assert app.state.writer.transition(run, ["queued"], "running")
    app.state.writer.append_samples(run, 1, [row])
    sha = client.get(f"{API}/runs/{run}/samples").json()["items"][0]["images"][0]["sha256"]
    from tests.support.api import session_client

    browser = session_client(app, token=token)
    for response in (
        client.get(API + "/runs"),
        client.get(f"{API}/runs/{run}"),
        client.get(f"{API}/runs/{run}/samples"),
        client.get(API + "/tokens"),
        TestClient(app).get(API + "/runs"),  # a 401
        browser.get("/runs"),
        browser.get(f"/runs/{run}"),
        TestClient(app).get("/login"),
    ):
        assert response.headers["cache-control"] == "no-store", (response.request.url, response.headers)
    image = client.get(f"{API}/images/{sha}")
    assert image.status_code == 200 and image.headers["cache-control"] == "private, max-age=31536000, immutable"
    static = client.get("/static/collage.css")
    assert static.status_code == 200 and "no-store" not in static.headers.get("cache-control", "")
    app.state.writer.transition(run, ["running"], "succeeded")
    with client.stream("GET", f"{API}/runs/{run}/stream") as stream:
        assert stream.headers["cache-control"] == "no-store"
