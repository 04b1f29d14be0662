"""The test tiers, and the check that keeps every test in the folder of its tier.

=============== ===============================================================================================
folder          what its tests may use
=============== ===============================================================================================
tests/unit      Python alone: no database, no process, no model, no connection (torch tensors are fine)
tests/store     + SQLite and PostgreSQL, the app in-process (TestClient, or uvicorn in a thread on loopback)
tests/training  + tiny models, built and loaded in-process
tests/processes + processes: workers, ``collage serve``, CLI commands, the dataset and playground helper
                  processes, multi-process runs, and the shared Redis and S3 servers
tests/browser   + Chromium
=============== ===============================================================================================

The folder is the only record of a test's tier: scripts/test.sh runs each job by folder, and ``pytest tests/unit
tests/store`` is the fast loop. While a test runs (its setup, its call and its teardown), an audit hook
(:func:`sys.addaudithook`) sees what it does in this process and fails it at once with :class:`TierViolation`
when its folder does not allow it:

- **a process**: ``subprocess``, ``os.fork``, ``os.posix_spawn``, ``os.system``, ``os.exec*``, and
  ``multiprocessing`` (every start method);
- **Chromium**: a process whose program is Chromium or Playwright's driver;
- **a service**: a connection to the suite's Redis (6379) or S3 server (8333);
- **a database**: a SQLite file opened, or a connection to PostgreSQL (5432, or its Unix socket);
- **a connection**: any other socket connection (a server in a thread of the test process on loopback);
- **a model**: a model or processor file read (``config.json``, ``*.safetensors``, a tokenizer or processor
  config, a chat template), a transformers model built in memory (``PreTrainedModel``), or a fixture that gives
  one (``tiny``, ``tiny_model_dir``).

Before it runs, a test is also refused when it asks for a fixture its folder does not allow (a browser page under
tests/processes, a tiny model under tests/store), and a test file outside the five folders is refused whole.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ORDER = ("unit", "store", "training", "processes", "browser")
# what each tier may do beyond the tiers below it (a tier allows everything the ones before it allow)
ADDS = {
    "unit": set(),
    "store": {"database", "connection"},
    "training": {"model"},
    "processes": {"process", "service"},
    "browser": {"chromium"},
}
ALLOWED: dict[str, frozenset[str]] = {}
_so_far: set[str] = set()
for _tier in ORDER:
    _so_far |= ADDS[_tier]
    ALLOWED[_tier] = frozenset(_so_far)

WHAT = {
    "process": "starts a process",
    "chromium": "starts Chromium",
    "service": "connects to a shared service (Redis or S3)",
    "database": "opens a database",
    "connection": "opens a network connection",
    "model": "loads a model",
}
# fixtures that give what a tier may not have, whether or not this test is the one that builds them
FIXTURES = {
    "tiny": "model", "tiny_model_dir": "model",
    "database_url": "database", "postgres_url": "database", "migrated_sqlite_url": "database",
    "migrated_postgres_url": "database", "api": "database",
    "server": "process", "redis_server": "process", "cluster": "process", "embedded": "process",
    "browser": "chromium", "page": "chromium",
}  # fmt: skip
MODEL_FILES = {"config.json", "preprocessor_config.json", "processor_config.json", "tokenizer.json",
               "tokenizer_config.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
               "adapter_config.json"}  # fmt: skip
SERVICE_PORTS = {6379: "Redis", 8333: "the S3 server"}
DATABASE_PORTS = {5432}


class TierViolation(Exception):
    """A test did what the folder it lives in does not allow (tests/support/tiers.py)."""


def tier_of(path: Path) -> str | None:
    """The tier of a test file: the tier folder (``tests/<tier>/...``) it lives in, or None."""
    for folder in Path(path).resolve().parents:
        if folder.name in ALLOWED and folder.parent.name == "tests":
            return folder.name
    return None


def lowest_tier(needs: str) -> str:
    return next(t for t in ORDER if needs in ALLOWED[t])


class _State:
    """The running test's tier and what it was caught doing (the audit hook cannot raise into every caller: a
    refused event is also remembered and fails the test at its end). A test that runs pytest inside itself
    (tests/unit/test_tiers.py) nests: the inner test's state is set and then the outer one's put back."""

    tier: str | None = None
    test: str | None = None
    caught: list[str] = []
    installed = False


def _refuse(kind: str, detail: str) -> None:
    tier = _State.tier
    if tier is None or kind in ALLOWED[tier]:
        return
    message = (f"{_State.test} {WHAT[kind]} ({detail}), which tests/{tier}/ does not allow: it belongs in "
               f"tests/{lowest_tier(kind)}/ (tests/support/tiers.py)")  # fmt: skip
    _State.caught.append(message)
    raise TierViolation(message)


def _program(args: tuple) -> str:
    executable, argv = args[0], args[1]
    first = argv[0] if isinstance(argv, (list, tuple)) and argv else argv
    return os.fsdecode(executable or first or "")


def _is_chromium(program: str, argv: object) -> bool:
    name = os.path.basename(program)
    text = " ".join(map(str, argv))[:400] if isinstance(argv, (list, tuple)) else str(argv)
    return "chrom" in name or "chrome" in text or (name == "node" and "playwright" in text)


def _readable(args: tuple) -> bool:
    mode, flags = args[1], args[2]
    if isinstance(mode, str):
        return not any(c in mode for c in "wax+")
    return isinstance(flags, int) and flags & os.O_ACCMODE == os.O_RDONLY


def _probing_libraries() -> bool:
    """Whether the process being started is ctypes.util.find_library's ``ldconfig -p`` (or its compiler probe):
    ``import torch`` runs it the first time, whichever test imports torch first. A library looking up the system's
    shared libraries is not a test starting a process."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "find_library" and frame.f_code.co_filename.endswith(
            os.path.join("ctypes", "util.py")
        ):
            return True
        frame = frame.f_back
    return False


def _audit(event: str, args: tuple) -> None:
    if _State.tier is None or _State.tier == "browser":
        return
    if event == "open":
        path = args[0]
        if isinstance(path, (str, bytes, os.PathLike)):
            name = os.path.basename(os.fsdecode(path))
            if (name in MODEL_FILES or name.endswith(".safetensors")) and _readable(args):
                _refuse("model", os.fsdecode(path))
    elif event == "subprocess.Popen":
        if _probing_libraries():
            return
        program = _program(args)
        _refuse("chromium" if _is_chromium(program, args[1]) else "process", " ".join(map(str, args[1]))[:200])
    elif event == "os.posix_spawn":
        program = os.fsdecode(args[0])
        _refuse("chromium" if _is_chromium(program, args[1]) else "process", program)
    elif event in ("os.fork", "os.forkpty", "os.system", "os.exec", "os.spawn"):
        _refuse("process", f"{event} {args[0] if args else ''}"[:200])
    elif event == "sqlite3.connect":
        _refuse("database", f"SQLite {args[0]}")
    elif event == "socket.connect":
        address = args[1]
        if isinstance(address, tuple) and len(address) >= 2:
            port = address[1]
            if port in SERVICE_PORTS:
                _refuse("service", f"{SERVICE_PORTS[port]} at {address[0]}:{port}")
            elif port in DATABASE_PORTS:
                _refuse("database", f"PostgreSQL at {address[0]}:{port}")
            else:
                _refuse("connection", f"{address[0]}:{port}")
        else:
            name = os.fsdecode(address) if isinstance(address, (str, bytes)) else str(address)
            _refuse("database" if ".s.PGSQL" in name else "connection", name)


def _refusing(kind: str, what, describe):
    """``what`` (a function) that first asks whether the running test may do ``kind``."""

    @functools.wraps(what)
    def guarded(*args, **kwargs):
        _refuse(kind, describe(*args))
        return what(*args, **kwargs)

    return guarded


def _guard_model_class(modeling_utils) -> None:
    cls = modeling_utils.PreTrainedModel
    cls.__init__ = _refusing("model", cls.__init__, lambda model, *_: f"{type(model).__name__} built in memory")


class _GuardModelsOnImport(importlib.abc.MetaPathFinder):
    """Guards transformers' model class the moment transformers.modeling_utils is imported (most tests never
    import it: the check costs them nothing)."""

    NAME = "transformers.modeling_utils"

    def find_spec(self, name, path=None, target=None):
        if name != self.NAME:
            return None
        sys.meta_path.remove(self)  # found once, by the other finders
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_and_guard(module) -> None:
            execute(module)
            _guard_model_class(module)

        spec.loader.exec_module = exec_and_guard  # type: ignore[method-assign]
        return spec


def install() -> None:
    if _State.installed:
        return
    _State.installed = True
    sys.addaudithook(_audit)
    # multiprocessing's spawn and forkserver start methods start processes without an audit event of their own
    import multiprocessing.process

    base = multiprocessing.process.BaseProcess
    base.start = _refusing("process", base.start, lambda process: f"multiprocessing {process.name}")
    if _GuardModelsOnImport.NAME in sys.modules:
        _guard_model_class(sys.modules[_GuardModelsOnImport.NAME])
    else:
        sys.meta_path.insert(0, _GuardModelsOnImport())


# ------------------------------------------------------------------------------------------------ pytest hooks


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test lives in a tier folder and asks only for fixtures its tier allows."""
    outside = sorted({str(item.path.relative_to(config.rootpath)) for item in items if tier_of(item.path) is None})
    if outside:
        raise pytest.UsageError(
            "test files outside the tier folders (tests/unit, tests/store, tests/training, tests/processes, "
            "tests/browser; see tests/support/tiers.py): " + ", ".join(outside)
        )
    for item in items:
        tier = tier_of(item.path)
        assert tier is not None
        for name in getattr(item, "fixturenames", ()):
            kind = FIXTURES.get(name)
            if kind is not None and kind not in ALLOWED[tier]:
                item.add_marker(pytest.mark.tier_violation(
                    f"{item.nodeid} asks for the fixture {name!r}, which {WHAT[kind]}: tests/{tier}/ does not "
                    f"allow that; it belongs in tests/{lowest_tier(kind)}/ (tests/support/tiers.py)"
                ))  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "tier_violation(message): set by tests/support/tiers.py, never by hand")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    install()
    outer = (_State.tier, _State.test, _State.caught)
    _State.tier, _State.test, _State.caught = None, item.nodeid, []
    try:
        return (yield)
    finally:
        _State.tier, _State.test, _State.caught = outer


def _guarded(item: pytest.Item):
    """Around a test's setup and call: what they do is checked against the test's tier. (Teardown is not: a
    module's or the session's fixtures end in whichever test happens to be last, of any tier.)"""
    _State.tier = tier_of(item.path)
    try:
        yield
    finally:
        _State.tier = None
    if _State.caught:  # refused in a thread, or caught and swallowed by the code under test
        raise TierViolation(_State.caught[0])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    marker = item.get_closest_marker("tier_violation")
    if marker is not None:
        raise TierViolation(marker.args[0])
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _guarded(item))
