"""The shape of the web tier, checked on the source and on a live app: routes take what they need through the typed
aliases of ``app/deps.py`` (never ``request.app.state``), leave SQL to ``app/store/``, never open a store session
of their own, and do a request's reads and writes in its one session; only ``app/settings.py`` reads configuration
from the environment; no function in ``app/`` grows past 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session as OrmSession

from .test_api import API, config

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app"
ROUTERS = sorted((APP / "routers").glob("*.py"))

# the names a router may take from sqlalchemy / sqlmodel: types for its signatures, never a query builder
SQL_TYPES = {"Engine", "Session"}
# functions that hand the environment to a child process or set libraries' switches: plumbing, not configuration
ENVIRONMENT_PLUMBING = {
    ("app/dataset_helper.py", "_helper_env"),  # the dataset helper inherits the web process's environment
    ("app/serve.py", "_spawn"),  # serve's embedded workers: its environment plus COLLAGE_PARENT_PID
    ("app/progress.py", "quiet_library_progress_bars"),  # sets the Hugging Face libraries' own switches
}
LONGEST_FUNCTION = 80


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_routers_never_read_the_app_state():
    found = [f"{_rel(p)}:{n}" for p in ROUTERS for n, line in enumerate(p.read_text().splitlines(), 1)
             if "app.state" in line]  # fmt: skip
    assert found == [], "take SettingsDep, EngineDep, ... from app/deps.py instead"


def _calls(tree: ast.AST, names: set[str]) -> list[int]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in names:
                out.append(node.lineno)
    return out


@pytest.mark.parametrize("router", ROUTERS, ids=lambda p: p.name)
def test_a_router_opens_no_session_and_writes_no_sql(router):
    """The request's session comes from SessionDep; a store function that needs its own short sessions (a stream, a
    job's lifecycle) opens them in app/store/."""
    tree = _tree(router)
    assert _calls(tree, {"Session", "session_scope"}) == [], f"{router.name} opens a store session"
    assert "Session(" not in router.read_text() and "session_scope(" not in router.read_text()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("sqlalchemy", "sqlmodel"):
            names = {alias.name for alias in node.names}
            assert names <= SQL_TYPES, (
                f"{router.name}:{node.lineno} imports {names - SQL_TYPES}: SQL goes to app/store/"
            )
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] in ("sqlalchemy", "sqlmodel") for a in node.names), router.name


def test_routes_declare_their_dependencies_through_aliases():
    """No ``Annotated[..., Depends(...)]`` in a route's signature: the aliases (module level) say it once."""
    found = []
    for path in ROUTERS:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for arg in [*node.args.args, *node.args.kwonlyargs]:
                    if arg.annotation is not None and _calls(arg.annotation, {"Depends"}):
                        found.append(f"{_rel(path)}:{arg.lineno} {node.name}({arg.arg})")
    assert found == []


def _environment_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, enclosing function)`` of every ``os.environ`` / ``os.getenv`` / ``environ`` in the module."""
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    found = []
    for node in ast.walk(tree):
        hit = (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb")) or (
            isinstance(node, ast.Name) and node.id in ("environ", "getenv")
        )
        if hit:
            owner: ast.AST | None = node
            while owner is not None and not isinstance(owner, ast.FunctionDef | ast.AsyncFunctionDef):
                owner = parents.get(owner)
            found.append((node.lineno, owner.name if owner is not None else "<module>"))
    return found


def test_only_the_settings_read_the_environment():
    """Operator (and CLI client) configuration comes through app/settings.py; app/cli.py is the command line's own."""
    found = []
    for path in sorted(APP.rglob("*.py")):
        rel = _rel(path)
        if rel in ("app/settings.py", "app/cli.py"):
            continue
        found += [f"{rel}:{line} {where}" for line, where in _environment_reads(_tree(path))
                  if (rel, where) not in ENVIRONMENT_PLUMBING]  # fmt: skip
    assert found == [], "read it through Settings (app/settings.py): add a field there"


def test_the_environment_check_sees_reads(tmp_path):
    source = "import os\nA = os.environ.get('X')\ndef f():\n    return os.getenv('Y')\n"
    assert _environment_reads(ast.parse(source)) == [(2, "<module>"), (4, "f")]


def test_no_function_in_the_web_tier_is_over_80_lines():
    long = []
    for path in sorted(APP.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > LONGEST_FUNCTION:
                    long.append(f"{_rel(path)}:{node.lineno} {node.name} ({size} lines)")
    assert long == []


# ------------------------------------------------------------------------------------------------- a live app


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


def test_collage_serve_freezes_its_start_up_heap_before_it_answers(tmp_path):
    """The objects start-up made are out of the cyclic collector's reach when the server starts answering: its full
    collections were the SQLite metrics route's p95 (docs/benchmarks.md). In a process of its own: a frozen heap
    in the test process would stay frozen for every later test."""
    import json
    import os
    import subprocess
    import sys

    script = (
        "import gc, json, sys, uvicorn\n"
        "from collage.app.serve import serve\n"
        "def run(self):\n"
        "    print(json.dumps({'frozen': gc.get_freeze_count(), 'app': any(type(o).__name__ == 'FastAPI' for o in "
        "gc.get_objects())}))\n"
        "uvicorn.Server.run = run\n"
        "sys.exit(serve('127.0.0.1', 0, 0))\n"
    )
    env = {**os.environ, "COLLAGE_HOME": str(tmp_path / "home"), "COLLAGE_ARTIFACTS": str(tmp_path / "artifacts")}
    for name in ("COLLAGE_DATABASE_URL", "COLLAGE_BROKER_URL"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    # the app itself is among the frozen objects (gc.get_objects() lists only the tracked, unfrozen ones)
    assert seen["frozen"] > 10_000 and not seen["app"], seen
