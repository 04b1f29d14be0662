"""The one direction between the tiers, checked on the source: ``training`` imports neither ``app`` nor ``worker``;
``app`` never imports ``worker`` except in its composition roots (``app/cli.py`` starts workers, ``app/serve.py``
wires the Celery dispatcher and the reaper into the web process); ``worker`` may use ``app``'s store, settings and
trust modules. Every import counts, a function-local one too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSITION_ROOTS = {"app/cli.py", "app/serve.py"}


def imports_of(file: Path) -> list[tuple[int, str]]:
    """Every module ``file`` imports, relative imports resolved to ``collage.<tier>...``, with its line."""
    relative = file.relative_to(ROOT).with_suffix("")
    package = ["collage", *relative.parts[:-1]]
    if relative.name == "__init__":
        package = ["collage", *relative.parts[:-1]]
    found = []
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found.extend((node.lineno, f"{name}.{alias.name}") for alias in node.names if not node.module)
    return found


def _sources(tier: str) -> list[Path]:
    return sorted(p for p in (ROOT / tier).rglob("*.py") if "__pycache__" not in p.parts)


def _violations(tier: str, forbidden: tuple[str, ...], allowed: set[str] = frozenset()) -> list[str]:
    out = []
    for file in _sources(tier):
        rel = file.relative_to(ROOT).as_posix()
        if rel in allowed:
            continue
        for line, name in imports_of(file):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                out.append(f"{rel}:{line} imports {name}")
    return out


def test_training_imports_neither_the_web_tier_nor_the_workers():
    assert _violations("training", ("collage.app", "collage.worker", "app", "worker")) == []


def test_the_web_tier_imports_the_workers_only_in_its_composition_roots():
    assert _violations("app", ("collage.worker", "worker"), COMPOSITION_ROOTS) == []


@pytest.mark.parametrize("source, expected", [
    ("from collage.worker.registry import live_workers\n", ["app/routers/x.py:1 imports collage.worker.registry"]),
    ("def f():\n    from ...worker import main\n", ["app/routers/x.py:2 imports collage.worker"]),
    ("from ..store import workers\n", []),
])  # fmt: skip
def test_the_check_sees_absolute_relative_and_local_imports(tmp_path, monkeypatch, source, expected):
    """The checker itself: a new import that breaks the direction is found, however it is written."""
    fake = tmp_path / "app" / "routers"
    fake.mkdir(parents=True)
    (fake / "x.py").write_text(source)
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    assert _violations("app", ("collage.worker", "worker")) == expected


def test_no_function_is_over_80_lines():
    """Small rooms: a function that grows past 80 lines is split (migrations are exempt: generated, then frozen)."""
    long = []
    for tier in ("app", "worker", "training", "bench"):
        for file in _sources(tier):
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1 if node.end_lineno else 0
                    if lines > 80:
                        long.append(f"{file.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def _modules(root: Path) -> dict[str, Path]:
    """``collage.<tier>.<...>`` -> its file, for every module of app/, worker/ and training/ under ``root``."""
    found = {}
    for tier in ("app", "worker", "training"):
        for file in sorted((root / tier).rglob("*.py")):
            parts = list(file.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(["collage", *parts])] = file
    return found


def import_circles(root: Path) -> list[list[str]]:
    """Every set of modules that import each other round in a circle (function-local imports count: a circle that
    only works because one side imports late is still one), each sorted, as Tarjan's algorithm finds them."""
    modules = _modules(root)
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, file in modules.items():
        for _, imported in imports_of(file):
            target = imported
            while target and target not in modules:  # `from pkg.mod import name` names the module pkg.mod
                target = target.rpartition(".")[0]
            if target and target != name:
                edges[name].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # recursive: the import graph is shallow
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in edges:
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle():
    assert import_circles(ROOT) == []


def test_the_circle_check_finds_a_circle_through_a_late_import(tmp_path, monkeypatch):
    data = tmp_path / "training" / "data"
    data.mkdir(parents=True)
    (data / "rows.py").write_text("def mapped():\n    from .mapping import RowMapping\n")
    (data / "mapping.py").write_text("from .rows import RowError\n")
    (data / "check.py").write_text("from .rows import mapped\n")  # imports into the circle, not part of it
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    assert import_circles(tmp_path) == [["collage.training.data.mapping", "collage.training.data.rows"]]
