"""The one direction between the tiers, checked on the source: ``training`` imports neither ``app`` nor ``worker``;
``app`` never imports ``worker`` except in its composition roots (``app/cli/main.py`` starts workers, ``app/cli/serve.py``
wires the Celery dispatcher and the reaper into the web process); ``worker`` uses only the app's kernel
(``app/core``: settings, trust, extras, status, errors; ``app/store``: tables, engine, writer, queries), which imports
neither fastapi nor torch; the web tier and the command line reach no torch (but the dataset process and `collage
train`); no import circle. Every import counts, a function-local one too (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSITION_ROOTS = {"app/cli/main.py", "app/cli/serve.py"}


def _nodes(tree: ast.AST, at_load: bool) -> list[ast.AST]:
    """Every node of ``tree``; with ``at_load`` only those that run when the module is imported (not a function's
    body)."""
    if not at_load:
        return list(ast.walk(tree))
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return found


def imports_of(file: Path, at_load: bool = False) -> list[tuple[int, str]]:
    """Every module ``file`` imports, relative imports resolved to ``collage.<tier>...``, with its line (with
    ``at_load``: only those its import runs, not a function's)."""
    relative = file.relative_to(ROOT).with_suffix("")
    package = ["collage", *relative.parts[:-1]]
    if relative.name == "__init__":
        package = ["collage", *relative.parts[:-1]]
    found = []
    for node in _nodes(ast.parse(file.read_text(encoding="utf-8"), str(file)), at_load):
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


# ------------------------------------------------------------------------------------------------ the app's kernel
KERNEL = ("collage.app.core", "collage.app.store")  # what the web tier, the command line and the workers share
HEAVY = ("torch", "torchvision", "transformers", "accelerate", "peft", "fastapi", "starlette")


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def reachable_imports(root: Path, start: tuple[str, ...], skip: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Every package outside Collage that the modules under ``start`` import (function-local imports count), directly
    or through what the modules they import import when they load, each with one chain of modules that leads to it;
    modules under ``skip`` are neither started from nor followed. (Another tier's function-local imports run only when its function is
    called, which a kernel module that imports it for a constant or a check never does.)"""
    modules = _modules(root)
    chains: dict[str, list[str]] = {m: [m] for m in modules if _within(m, start) and not _within(m, skip)}
    queue = list(chains)
    external: dict[str, list[str]] = {}
    while queue:
        name = queue.pop(0)
        for _, imported in imports_of(modules[name], at_load=not _within(name, start)):
            target = imported
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target:
                if target not in chains and not _within(target, skip):
                    chains[target] = [*chains[name], target]
                    queue.append(target)
            elif not imported.startswith("collage"):
                external.setdefault(imported.split(".")[0], [*chains[name], imported])
    return external


def test_workers_use_only_the_app_s_core_and_store():
    found = [f"{file.relative_to(ROOT)}:{line} imports {name}" for file in _sources("worker")
             for line, name in imports_of(file) if _within(name, ("collage.app",)) and not _within(name, KERNEL)]  # fmt: skip
    assert found == [], "a worker uses the app's kernel only (app/core, app/store): move what it needs there"


def test_the_kernel_imports_neither_fastapi_nor_torch():
    heavy = {package: chain for package, chain in reachable_imports(ROOT, KERNEL).items() if package in HEAVY}
    assert heavy == {}, " ; ".join(" -> ".join(chain) for chain in heavy.values())


DATASET_PROCESS = ("collage.app.datasets.process",)  # the web tier's one torch process: it loads processors for checks
# `collage train` trains in its own process (torchrun launches it on every host: docs/scaling.md), the command line's
# one door to the trainer; no other command, page or route may reach torch
TRAIN_COMMAND = ["collage.app.cli.main", "collage.training.trainer"]


def test_the_web_tier_and_the_command_line_load_no_torch():
    """Lazily or not: a page, a route or a CLI command that reached torch would load it into the web process (the
    dataset process, which the web tier starts and talks to over a pipe, is the one exception, and `collage train`
    the command line's)."""
    torch_side = ("torch", "torchvision", "transformers", "accelerate", "peft")
    found = {p: chain for p, chain in reachable_imports(ROOT, ("collage.app",), DATASET_PROCESS).items()
             if p in torch_side and chain[:2] != TRAIN_COMMAND}  # fmt: skip
    assert found == {}, " ; ".join(" -> ".join(chain) for chain in found.values())


def test_the_kernel_checks_find_a_violation(tmp_path, monkeypatch):
    """The checks themselves: a worker importing a router, and a store module reaching torch through training."""
    for folder in ("app/core", "app/store", "app/routers", "worker", "training"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "app" / "store" / "writer.py").write_text("def f():\n    from collage.training.deep import x\n")
    (tmp_path / "training" / "deep.py").write_text("import torch.nn\n\ndef g():\n    import fastapi\n")
    (tmp_path / "app" / "routers" / "runs.py").write_text("")
    (tmp_path / "worker" / "tasks.py").write_text("from collage.app.routers import runs\nfrom ..app.core import x\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    reached = reachable_imports(tmp_path, KERNEL)
    assert reached["torch"] == ["collage.app.store.writer", "collage.training.deep", "torch.nn"]
    assert "fastapi" not in reached, "a function of another tier's module that the kernel never calls"
    with pytest.raises(AssertionError, match="collage.app.routers"):
        test_workers_use_only_the_app_s_core_and_store()
    with pytest.raises(AssertionError, match="torch"):
        test_the_kernel_imports_neither_fastapi_nor_torch()
    with pytest.raises(AssertionError, match="torch"):
        test_the_web_tier_and_the_command_line_load_no_torch()
