"""Listings of export jobs (``GET /runs/{id}/exports``, ``GET /exports``), on SQLite and PostgreSQL through the
in-process app: a run's exports are every token's (members read every run, as ``GET /exports/{id}`` lets them),
``GET /exports`` is the calling token's own (an admin's: everyone's); newest first, bounded by ``limit``; a finished
export carries its size, who made it and its download URL, so it is found again after its browser tab is gone."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update
from sqlmodel import Session

from collage.app.core.status import JobKind, RunStatus
from collage.app.store import jobs
from collage.app.store.tables import ApiToken, Job, utcnow
from collage.app.store.tokens import create_token, verify_token
from tests.support import API
from tests.support.api import config, member_and_token


def _token(app, secret: str) -> ApiToken:
    found = verify_token(app.state.engine, secret)
    assert found is not None
    return found


def _export(app, run: str, by: ApiToken, step: int, merge: bool = False, minutes_ago: int = 0, done: bool = False):
    """An export job of ``run`` as ``POST /runs/{id}/exports`` stores it, made ``minutes_ago``; ``done``: a worker
    ran it to success (its result as worker/export_job.py reports it)."""
    engine = app.state.engine
    request = {"run_id": run, "step": step, "asked": step, "merge_lora": merge}
    job = jobs.create_job(engine, JobKind.EXPORT, "default", request, run_id=run, created_by=by)
    with Session(engine) as session:
        made = utcnow() - timedelta(minutes=minutes_ago)
        session.execute(update(Job).where(Job.id == job.id).values(created_at=made))
        session.commit()
    if done:
        assert jobs.claim_next_job(engine, "default", "w").id == job.id
        result = {"path": f"exports/{job.id}", "bytes": 1000 + step, "kind": "adapter", "merged": merge,
                  "run_id": run, "step": step}  # fmt: skip
        assert jobs.finish_job(engine, job.id, RunStatus.SUCCEEDED, result=result)
    return job.id


def _ids(response) -> list[str]:
    assert response.status_code == 200, response.text
    return [item["id"] for item in response.json()["items"]]


def test_a_runs_exports_and_a_tokens_own_are_listed_newest_first(api):
    admin, admin_secret, _, app = api
    run = admin.post(API + "/runs", json=config()).json()["id"]
    other_run = admin.post(API + "/runs", json=config(name="other")).json()["id"]
    mallory, mallory_secret = member_and_token(app, "mallory")
    alice, alice_secret = member_and_token(app, "alice")
    m, a, root = _token(app, mallory_secret), _token(app, alice_secret), _token(app, admin_secret)
    old = _export(app, run, m, step=1, minutes_ago=30, done=True)
    merged = _export(app, run, a, step=2, merge=True, minutes_ago=20, done=True)
    elsewhere = _export(app, other_run, m, step=3, minutes_ago=10, done=True)
    newest = _export(app, run, root, step=2, minutes_ago=0)  # still queued
    jobs.create_job(app.state.engine, JobKind.GENERATE, "default", {}, run_id=run, created_by=m)  # not an export

    # a run's exports: every token's, whoever asks (members read every run), newest first
    for client in (mallory, alice, admin):
        assert _ids(client.get(f"{API}/runs/{run}/exports")) == [newest, merged, old]
    assert _ids(mallory.get(f"{API}/runs/{other_run}/exports")) == [elsewhere]

    items = {i["id"]: i for i in mallory.get(f"{API}/runs/{run}/exports").json()["items"]}
    done = items[merged]
    assert done["run_id"] == run and done["step"] == 2 and done["merge_lora"] is True
    assert done["status"] == "succeeded" and done["bytes"] == 1002 and done["kind"] == "adapter"
    assert done["created_by"] == "alice" and done["mine"] is False and done["finished_at"] is not None
    assert done["download_url"] == f"{API}/exports/{merged}/download"
    assert items[old]["created_by"] == "mallory" and items[old]["mine"] is True
    waiting = items[newest]
    assert waiting["status"] == "queued" and waiting["queue_position"] == 1 and waiting["created_by"] == "tests"
    assert waiting["download_url"] is None and waiting["bytes"] is None and waiting["finished_at"] is None
    assert waiting["merge_lora"] is False and waiting["mine"] is False
    # the listing's item is the export's own view, plus who made it
    single = mallory.get(f"{API}/exports/{merged}").json()
    assert {k: v for k, v in done.items() if k not in ("created_by", "mine")} == single

    # a token's own exports, of every run; an admin sees everyone's
    assert _ids(mallory.get(f"{API}/exports")) == [elsewhere, old]
    assert _ids(alice.get(f"{API}/exports")) == [merged]
    assert all(i["mine"] for i in mallory.get(f"{API}/exports").json()["items"])
    assert _ids(admin.get(f"{API}/exports")) == [newest, elsewhere, merged, old]
    fresh, _ = member_and_token(app, "bob")
    assert _ids(fresh.get(f"{API}/exports")) == []

    # a removed export (replaced by its token's newer one) is listed, without a download
    from collage.app.store import exports as export_store

    export_store.mark_removed(app.state.engine, old, "replaced by a newer export of this token")
    gone = {i["id"]: i for i in mallory.get(f"{API}/exports").json()["items"]}[old]
    assert gone["download_url"] is None and gone["removed"] == "replaced by a newer export of this token"


def test_a_revoked_tokens_exports_keep_its_name(api):
    admin, _, _, app = api
    run = admin.post(API + "/runs", json=config()).json()["id"]
    secret = create_token(app.state.engine, "leaver")
    job = _export(app, run, _token(app, secret), step=1, done=True)
    assert admin.delete(f"{API}/tokens/leaver").status_code in (200, 204)
    (item,) = admin.get(f"{API}/runs/{run}/exports").json()["items"]
    assert item["id"] == job and item["created_by"] == "leaver"


def test_listings_are_bounded_and_an_unknown_run_is_404(api):
    admin, admin_secret, _, app = api
    run = admin.post(API + "/runs", json=config()).json()["id"]
    root = _token(app, admin_secret)
    made = [_export(app, run, root, step=i, minutes_ago=10 - i, done=True) for i in range(5)]
    newest_first = made[::-1]
    assert _ids(admin.get(f"{API}/runs/{run}/exports")) == newest_first  # the default (50) holds all five
    for path in (f"/runs/{run}/exports", "/exports"):
        assert _ids(admin.get(API + path, params={"limit": 2})) == newest_first[:2]
        assert _ids(admin.get(API + path, params={"limit": 1})) == newest_first[:1]
        assert _ids(admin.get(API + path, params={"limit": 200})) == newest_first
        for bad in (0, -1, 201, "many"):
            response = admin.get(API + path, params={"limit": bad})
            assert response.status_code == 422, (path, bad, response.text)
            assert [d["path"] for d in response.json()["detail"]] == ["query.limit"], response.text
    for unknown in ("nope", "x" * 33):
        response = admin.get(f"{API}/runs/{unknown}/exports")
        assert response.status_code == 404 and "no run with id" in response.json()["detail"]
