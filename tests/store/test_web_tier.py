"""The shape of the web tier on a live app, on SQLite and PostgreSQL through the in-process app: a run is edited,
cancelled and resumed with a request's reads and writes in its one store session, and the settings a route sees
are the app's of the moment."""

from __future__ import annotations

from sqlalchemy import event
from sqlalchemy.orm import Session as OrmSession

from tests.support import API
from tests.support.api import config


class SessionsOf:
    """The store sessions that loaded a run, and those that wrote an audit entry, while it is open."""

    def __init__(self) -> None:
        self.loaded_runs: set[int] = set()
        self.audited: set[int] = set()

    def _loaded(self, session, instance) -> None:
        if type(instance).__name__ == "Run":
            self.loaded_runs.add(id(session))

    def _flushing(self, session, _context, _instances) -> None:
        if any(type(o).__name__ == "AuditEntry" for o in session.new):
            self.audited.add(id(session))

    def __enter__(self) -> SessionsOf:
        event.listen(OrmSession, "loaded_as_persistent", self._loaded)
        event.listen(OrmSession, "before_flush", self._flushing)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(OrmSession, "loaded_as_persistent", self._loaded)
        event.remove(OrmSession, "before_flush", self._flushing)


def test_a_run_is_edited_cancelled_and_resumed_in_the_requests_one_session(api):
    """The run read for the permission check, the change and its audit entry, and the run sent back: one session."""
    client, _, dispatcher, app = api
    run = client.post(API + "/runs", json=config()).json()["id"]
    with SessionsOf() as seen:
        edited = client.patch(f"{API}/runs/{run}", json={"tags": ["x", "x", "y"], "notes": "why"})
    assert edited.status_code == 200, edited.text
    assert edited.json()["tags"] == ["x", "y"] and edited.json()["notes"] == "why"
    assert edited.json()["config"]["tags"] == ["x", "y"]
    assert len(seen.loaded_runs) == 1 and seen.audited == seen.loaded_runs

    for action, status in (("cancel", "cancelled"), ("resume", "queued")):
        with SessionsOf() as seen:
            response = client.post(f"{API}/runs/{run}/{action}")
        assert response.status_code == 200 and response.json()["status"] == status, response.text
        assert len(seen.loaded_runs) == 1 and seen.audited == seen.loaded_runs, action
    assert dispatcher.cancelled == [] and [r for r, _ in dispatcher.submitted] == [run, run]  # created, resumed
    audit = [(a["action"], a["target"]) for a in client.get(API + "/audit").json()][:3]
    assert audit == [("run.resume", run), ("run.cancel", run), ("run.edit", run)]
    assert client.get(f"{API}/runs/{run}").json()["attempt"] == 2


def test_the_settings_a_route_sees_are_the_apps_of_the_moment(api):
    """SettingsDep reads the app's settings per request: an operator's (or a test's) swap shows at once."""
    import dataclasses

    client, _, _, app = api
    before = client.get(API + "/rewards").json()["user_functions"]
    app.state.settings = dataclasses.replace(app.state.settings, reward_modules=("some.module",))
    assert "some.module" in client.get(API + "/rewards").json()["user_functions"]
    assert "some.module" not in before
