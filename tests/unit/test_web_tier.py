"""The shape of the web tier, checked on the source: routes take what they need through the typed aliases of
``app/deps.py`` (never ``request.app.state``), leave SQL to ``app/store/`` and never open a store session of their
own; only ``app/core/settings.py`` reads configuration from the environment; no function in ``app/`` grows past 80
lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


APP = ROOT / "app"


ROUTERS = sorted((APP / "routers").glob("*.py"))


# the names a router may take from sqlalchemy / sqlmodel: types for its signatures, never a query builder
SQL_TYPES = {"Engine", "Session"}


# functions that hand the environment to a child process or set libraries' switches: plumbing, not configuration
ENVIRONMENT_PLUMBING = {
    ("app/datasets/client.py", "_helper_env"),  # the dataset helper inherits the web process's environment
    ("app/cli/serve.py", "_spawn"),  # serve's embedded workers: its environment plus COLLAGE_PARENT_PID
    ("app/cli/progress.py", "quiet_library_progress_bars"),  # sets the Hugging Face libraries' own switches
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
    """Operator (and CLI client) configuration comes through app/core/settings.py; app/cli/main.py is the command line's own."""
    found = []
    for path in sorted(APP.rglob("*.py")):
        rel = _rel(path)
        if rel in ("app/core/settings.py", "app/cli/main.py"):
            continue
        found += [f"{rel}:{line} {where}" for line, where in _environment_reads(_tree(path))
                  if (rel, where) not in ENVIRONMENT_PLUMBING]  # fmt: skip
    assert found == [], "read it through Settings (app/core/settings.py): add a field there"


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
