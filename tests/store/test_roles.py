"""Tokens with roles, one-time login links, server-side sessions, browser hardening and /health, on SQLite and
PostgreSQL through the in-process app: tried as an attacker with an ordinary (member) token would, code gadgets
included."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from tests.support import API
from tests.support.api import config, session_client

pytestmark = pytest.mark.usefixtures("api")


def _member(app, name="mallory", **kwargs) -> TestClient:
    from collage.app.store.tokens import create_token

    token = create_token(app.state.engine, name, **kwargs)
    return TestClient(app, headers={"Authorization": f"Bearer {token}"})


def test_members_change_only_their_own_runs_admins_any(api):
    admin, _, _, app = api
    mallory, alice = _member(app, "mallory"), _member(app, "alice")
    theirs = alice.post(API + "/runs", json=config()).json()["id"]
    mine = mallory.post(API + "/runs", json=config()).json()["id"]
    assert mallory.get(f"{API}/runs/{theirs}").json()["created_by"] == "alice"  # members read every run
    assert {r["id"]: r["created_by"] for r in mallory.get(API + "/runs").json()["items"]}[mine] == "mallory"
    for method, path in [("POST", "cancel"), ("POST", "resume"), ("DELETE", "")]:
        response = mallory.request(method, f"{API}/runs/{theirs}" + (f"/{path}" if path else ""))
        assert response.status_code == 403, (method, path, response.text)
        assert "only the run's creator or an admin" in response.json()["detail"]
    assert alice.get(f"{API}/runs/{theirs}").json()["status"] == "queued"  # nothing happened to it
    assert mallory.post(f"{API}/runs/{mine}/cancel").json()["status"] == "cancelled"
    # a clone of someone else's run is the cloner's own run
    clone = mallory.post(f"{API}/runs/{theirs}/clone", json={}).json()["id"]
    assert mallory.post(f"{API}/runs/{clone}/cancel").status_code == 200
    # an admin changes anyone's run; every change names its actor in the run's events and the audit log
    assert admin.post(f"{API}/runs/{theirs}/cancel").json()["status"] == "cancelled"
    assert admin.post(f"{API}/runs/{theirs}/resume").json()["status"] == "queued"
    events = alice.get(f"{API}/runs/{theirs}/events").json()["items"]
    assert [e["message"].split(":")[0] for e in events][-2:] == ["cancelled before it started", "resume requested"]
    assert admin.post(f"{API}/runs/{theirs}/cancel").status_code == 200
    assert admin.delete(f"{API}/runs/{theirs}").status_code == 204
    audit = admin.get(API + "/audit").json()
    assert [(a["actor"], a["action"], a["target"]) for a in audit[:4]] == [
        ("tests", "run.delete", theirs), ("tests", "run.cancel", theirs), ("tests", "run.resume", theirs),
        ("tests", "run.cancel", theirs),
    ]  # fmt: skip
    with app.state.engine.connect() as connection:
        from sqlalchemy import text

        actors = connection.execute(text("SELECT actor FROM events WHERE run_id = :r"), {"r": mine}).scalars().all()
    assert "mallory" in actors


def test_token_management_needs_an_admin(api):
    admin, _, _, app = api
    mallory = _member(app)
    for method, path in [("GET", "/tokens"), ("POST", "/tokens"), ("DELETE", "/tokens/tests"),
                         ("POST", "/tokens/tests/link"), ("GET", "/audit")]:  # fmt: skip
        response = mallory.request(method, API + path, json={"name": "x"} if method == "POST" else None)
        assert response.status_code == 403 and "admin" in response.json()["detail"], (method, path)
    made = admin.post(API + "/tokens", json={"name": "bob", "role": "member", "expires_days": 2})
    assert made.status_code == 201 and made.json()["token"].startswith("clg_")
    listed = {t["name"]: t for t in admin.get(API + "/tokens").json()}
    assert listed["bob"]["role"] == "member" and listed["bob"]["expires_at"] and "token" not in listed["bob"]
    assert not any(made.json()["token"] in str(v) for t in listed.values() for v in t.values())
    assert admin.post(API + "/tokens", json={"name": "bob"}).status_code == 409
    assert admin.post(API + "/tokens", json={"name": "x", "role": "owner"}).status_code == 422
    bob = TestClient(app, headers={"Authorization": f"Bearer {made.json()['token']}"})
    assert bob.get(API + "/runs").status_code == 200
    assert admin.delete(API + "/tokens/bob").status_code == 204
    assert bob.get(API + "/runs").status_code == 401  # at once
    assert admin.delete(API + "/tokens/bob").status_code == 404


def test_an_expired_token_is_refused(api):
    from datetime import timedelta

    from sqlalchemy import update

    from collage.app.store.engine import session_scope
    from collage.app.store.tables import ApiToken, utcnow

    _, _, _, app = api
    eve = _member(app, "eve", expires_days=1)
    assert eve.get(API + "/runs").status_code == 200
    with session_scope(app.state.engine) as session:
        session.execute(
            update(ApiToken).where(ApiToken.name == "eve").values(expires_at=utcnow() - timedelta(seconds=1))
        )
    assert eve.get(API + "/runs").status_code == 401


def test_one_time_login_links_and_no_tokens_in_urls(api):
    admin, token, _, app = api
    # ?token= in a URL no longer logs in
    browser = TestClient(app)
    browser.get(f"/login?token={token}")
    assert browser.get("/runs", follow_redirects=False).status_code == 303
    link = admin.post(API + "/tokens/tests/link").json()
    assert link["expires_in_seconds"] == 600 and "/login/link/" in link["url"]
    code = link["url"].rsplit("/", 1)[1]
    assert token not in link["url"]
    # opening the link (a chat app's preview) does not spend it; the button does, once
    assert TestClient(app).get("/login/link/" + code).status_code == 200
    logged = session_client(app, code=code)
    assert logged.get("/runs", follow_redirects=False).status_code == 200
    assert logged.get(API + "/runs").status_code == 200  # the session reaches the API too
    again = TestClient(app)
    page = again.get("/login/link/" + code)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    spent = again.post("/login/link/" + code, data={"csrf_token": csrf}, follow_redirects=False)
    assert spent.status_code == 401 and "already used" in spent.text
    assert again.get("/runs", follow_redirects=False).status_code == 303


def test_a_link_expires_after_ten_minutes(api):
    from datetime import timedelta

    from sqlalchemy import update

    from collage.app.store.engine import session_scope
    from collage.app.store.tables import LoginLink, utcnow
    from collage.app.store.tokens import create_login_link

    _, _, _, app = api
    code = create_login_link(app.state.engine, "tests")
    with session_scope(app.state.engine) as session:
        session.execute(update(LoginLink).values(expires_at=utcnow() - timedelta(seconds=1)))
    browser = TestClient(app)
    page = browser.get("/login/link/" + code)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    assert browser.post("/login/link/" + code, data={"csrf_token": csrf}).status_code == 401


def test_logout_and_revoke_end_sessions_server_side(api):
    admin, _, _, app = api
    from collage.app.store.tokens import create_token

    secret = create_token(app.state.engine, "carol")
    first = session_client(app, token=secret)
    stolen = dict(first.cookies)  # an attacker copied the cookie
    second = session_client(app, token=secret)
    page = first.get("/runs")
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    assert first.post("/logout", data={"csrf_token": csrf}, follow_redirects=False).status_code == 303
    replay = TestClient(app, cookies=stolen)
    assert replay.get(API + "/runs").status_code == 401, "a logged-out session's cookie is worthless"
    assert second.get(API + "/runs").status_code == 200  # other sessions live on
    assert admin.delete(API + "/tokens/carol").status_code == 204
    assert second.get(API + "/runs").status_code == 401, "revoking the token ends its sessions at once"
    assert second.get("/runs", follow_redirects=False).status_code == 303


def test_session_api_writes_need_the_csrf_header(api):
    _, token, _, app = api
    browser = session_client(app, token=token)
    assert browser.post(API + "/runs", json=config()).status_code == 403
    page = browser.get("/runs")
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    assert browser.post(API + "/runs", json=config(), headers={"X-CSRF-Token": csrf}).status_code == 201


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_cookies_are_secure_over_https_and_headers_harden_every_response(api, scheme):
    _, token, _, app = api
    browser = TestClient(app, base_url=f"{scheme}://testserver")
    page = browser.get("/login")
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    done = browser.post("/login", data={"token": token, "csrf_token": csrf}, follow_redirects=False)
    cookie = [h for h in done.headers.get_list("set-cookie") if h.startswith("collage_session=")][0]
    assert ("Secure" in cookie) == (scheme == "https") and "HttpOnly" in cookie and "SameSite=lax" in cookie
    for path in ("/login", API + "/health", "/static/collage.css", API + "/runs"):
        headers = browser.get(path).headers
        assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
        assert headers["referrer-policy"] == "same-origin"  # Origin on same-site form posts (CSRF check)
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert "script-src 'self'" in browser.get("/login").headers["content-security-policy"]


def test_a_trusted_proxy_makes_cookies_secure(database_url, tmp_path):
    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.store.tokens import create_token
    from tests.support.api import RecordingDispatcher

    for trusted, secure in (("*", True), ("10.9.9.9", False)):
        settings = Settings(home=tmp_path, database_url=database_url, broker_url="memory://",
                            artifacts=tmp_path / "a", forwarded_allow_ips=trusted)  # fmt: skip
        app = create_app(settings, RecordingDispatcher())
        create_token(app.state.engine, f"p-{trusted}")
        # the proxy terminated TLS and says so; only a trusted proxy is believed
        page = TestClient(app, headers={"X-Forwarded-Proto": "https"}).get("/login")
        cookie = [h for h in page.headers.get_list("set-cookie") if h.startswith("collage_login_csrf=")][0]
        assert ("Secure" in cookie) == secure, trusted


def test_health_says_only_ok_without_a_token(api):
    client, _, _, app = api
    anonymous = TestClient(app).get(API + "/health")
    assert anonymous.status_code == 200 and anonymous.json() == {"ok": True}
    assert TestClient(app, headers={"Authorization": "Bearer wrong"}).get(API + "/health").json() == {"ok": True}
    detailed = client.get(API + "/health").json()
    assert detailed["ok"] and detailed["store"]["ok"] and detailed["workers"][0]["queues"] == ["default"]


@pytest.mark.parametrize(
    "gadget", ["alembic.config:main", "logging:basicConfig", "os:system", "subprocess:run", "builtins:exec"]
)
def test_code_gadgets_are_refused_for_every_role(api, gadget):
    admin, _, dispatcher, app = api
    member = _member(app, "m-" + gadget.replace(":", "-"))
    for client in (admin, member):
        body = config(rewards=[{"name": gadget, "args": {"argv": ["upgrade", "head"], "filename": "/tmp/x"}}])
        response = client.post(API + "/runs", json=body)
        assert response.status_code == 422, response.text
        assert [e["path"] for e in response.json()["detail"]] == ["rewards[0].name"]
        cloned_from = client.post(API + "/runs", json=config()).json()["id"]
        clone = client.post(f"{API}/runs/{cloned_from}/clone", json={"overrides": {"rewards": [{"name": gadget}]}})
        assert clone.status_code == 422 and clone.json()["detail"][0]["path"] == "rewards[0].name"
    assert all(run_id for run_id, _ in dispatcher.submitted)
    submitted = {r for r, _ in dispatcher.submitted}
    with app.state.engine.connect() as connection:
        from sqlalchemy import text

        stored = connection.execute(text("SELECT config FROM runs")).scalars().all()
    assert gadget not in " ".join(map(str, stored)) and len(submitted) == len(stored)
