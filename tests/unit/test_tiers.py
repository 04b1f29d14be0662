"""The tier folders are the only record of a test's tier, and a test that does more than its folder allows fails
(tests/support/tiers.py): the rule table itself, event by event, and whole pytest sessions run in-process on test
files placed in the wrong folder."""

from __future__ import annotations

import pytest

from tests.support import tiers

pytest_plugins = ["pytester"]

# (event, audit arguments, what it is): as sys.audit reports them
EVENTS = {
    "process": ("subprocess.Popen", ("/bin/true", ["true"], None, None)),
    "fork": ("os.fork", ()),
    "chromium": ("subprocess.Popen", ("/usr/bin/chromium", ["/usr/bin/chromium", "--headless"], None, None)),
    "playwright": ("subprocess.Popen", (None, ["/x/playwright/driver/node", "/x/playwright/cli.js"], None, None)),
    "redis": ("socket.connect", (None, ("127.0.0.1", 6379))),
    "s3": ("socket.connect", (None, ("127.0.0.1", 8333))),
    "postgresql": ("socket.connect", (None, ("127.0.0.1", 5432))),
    "postgresql socket": ("socket.connect", (None, "/var/run/postgresql/.s.PGSQL.5432")),
    "sqlite": ("sqlite3.connect", ("/tmp/x.db",)),
    "loopback server": ("socket.connect", (None, ("127.0.0.1", 40123))),
    "model config": ("open", ("/m/config.json", "r", 0)),
    "weights": ("open", ("/m/model.safetensors", "rb", 0)),
}
NEEDS = {"process": "process", "fork": "process", "chromium": "chromium", "playwright": "chromium",
         "redis": "service", "s3": "service", "postgresql": "database", "postgresql socket": "database",
         "sqlite": "database", "loopback server": "connection", "model config": "model", "weights": "model"}  # fmt: skip
FIRST = {"process": "processes", "service": "processes", "chromium": "browser", "database": "store",
         "connection": "store", "model": "training"}  # fmt: skip


@pytest.fixture
def as_tier():
    """Run the audit hook as if a test of ``tier`` were running (the real state is put back after)."""
    saved = (tiers._State.tier, tiers._State.test, tiers._State.caught)

    def check(tier: str, event: str, args: tuple) -> None:
        tiers._State.tier, tiers._State.test, tiers._State.caught = tier, "tests/x/test_x.py::test_x", []
        try:
            tiers._audit(event, args)
        finally:
            tiers._State.tier, tiers._State.test, tiers._State.caught = saved

    return check


@pytest.mark.parametrize("tier", tiers.ORDER)
@pytest.mark.parametrize("name", sorted(EVENTS))
def test_each_tier_allows_what_its_folder_lists_and_refuses_the_rest(as_tier, tier, name):
    event, args = EVENTS[name]
    allowed = tiers.ORDER.index(tier) >= tiers.ORDER.index(FIRST[NEEDS[name]])
    if allowed:
        as_tier(tier, event, args)
    else:
        with pytest.raises(tiers.TierViolation, match=f"which tests/{tier}/ does not allow: it belongs in tests/"
                                                      f"{FIRST[NEEDS[name]]}/"):  # fmt: skip
            as_tier(tier, event, args)


def test_writing_a_file_named_like_a_model_file_is_not_loading_a_model(as_tier):
    as_tier("unit", "open", ("/out/config.json", "w", 0))
    as_tier("unit", "open", ("/out/config.json", None, 0o1101))  # os.open with O_WRONLY | O_CREAT | O_TRUNC


def test_the_tier_of_a_file_is_the_folder_under_tests(tmp_path):
    assert tiers.tier_of(tmp_path / "tests" / "store" / "test_x.py") == "store"
    assert tiers.tier_of(tmp_path / "tests" / "unit" / "deeper" / "test_x.py") == "unit"
    assert tiers.tier_of(tmp_path / "tests" / "test_x.py") is None
    assert tiers.tier_of(tmp_path / "store" / "test_x.py") is None


CONFTEST = """
from tests.support.tiers import (  # noqa: F401
    pytest_collection_modifyitems, pytest_configure, pytest_runtest_call, pytest_runtest_protocol,
    pytest_runtest_setup,
)
import pytest

@pytest.fixture
def tiny():
    raise AssertionError("never built: the tier check refuses the test first")
"""


def _tree(pytester: pytest.Pytester, files: dict[str, str]) -> None:
    pytester.makeconftest(CONFTEST)
    for path, source in files.items():
        target = pytester.path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source)


def test_a_test_that_does_more_than_its_folder_allows_fails_saying_where_it_belongs(pytester):
    _tree(pytester, {
        # no process is started: the check refuses the call before it happens
        "tests/unit/test_misplaced.py": "import subprocess\ndef test_it():\n    subprocess.run(['true'])\n",
        "tests/unit/test_swallowed.py": ("import sqlite3\ndef test_it():\n    try:\n        sqlite3.connect(':memory:')\n"
                                         "    except Exception:\n        pass\n"),
        "tests/store/test_tiny.py": "def test_it(tiny):\n    pass\n",
        "tests/store/test_placed.py": "import sqlite3\ndef test_it():\n    sqlite3.connect(':memory:').close()\n",
    })  # fmt: skip
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "tests")
    result.assert_outcomes(passed=1, failed=2, errors=1)
    out = result.stdout.str()
    assert "test_misplaced.py::test_it starts a process (true), which tests/unit/ does not allow: it belongs in " \
           "tests/processes/" in out  # fmt: skip
    # the code under test caught the refusal: the test fails all the same
    assert "test_swallowed.py::test_it opens a database (SQLite :memory:)" in out
    assert "test_tiny.py::test_it asks for the fixture 'tiny', which loads a model" in out


def test_a_test_file_outside_the_tier_folders_is_refused(pytester):
    _tree(
        pytester,
        {"tests/test_loose.py": "def test_it():\n    pass\n", "tests/unit/test_ok.py": "def test_it():\n    pass\n"},
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "tests")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "test files outside the tier folders" in result.stderr.str() + result.stdout.str()
    assert "tests/test_loose.py" in result.stderr.str() + result.stdout.str()


def test_a_library_looking_up_shared_libraries_is_not_a_test_starting_a_process():
    """``import torch`` runs ctypes.util.find_library's ``ldconfig -p`` the first time: allowed in every tier (this
    test is in tests/unit), while any other process is not (above)."""
    import ctypes.util

    assert ctypes.util.find_library("collage-no-such-library") is None
