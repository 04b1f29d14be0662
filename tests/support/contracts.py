"""The public surface a refactor must leave as it is: the OpenAPI document and the help of every CLI command.

``python -m tests.support.contracts`` writes them into ``tests/snapshots/`` (run it only for a change that means
to alter the surface, and review the diff); ``tests/store/test_contract_snapshots.py`` compares them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

SNAPSHOTS = Path(__file__).resolve().parents[1] / "snapshots"
OPENAPI = SNAPSHOTS / "openapi.json"
CLI_HELP = SNAPSHOTS / "cli-help.txt"
COLUMNS = "100"  # argparse wraps help at the terminal's width: one width for every machine


def openapi_document() -> str:
    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.store.engine import upgrade
    from tests.support.api import RecordingDispatcher

    with tempfile.TemporaryDirectory() as tmp:
        database = f"sqlite:///{Path(tmp) / 'collage.db'}"
        upgrade(database)
        settings = Settings(home=Path(tmp), database_url=database, broker_url="memory://",
                            artifacts=Path(tmp) / "artifacts")  # fmt: skip
        return json.dumps(create_app(settings, RecordingDispatcher()).openapi(), indent=1, sort_keys=True) + "\n"


def _commands(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:  # argparse keeps its subcommands there (no public API lists them)
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, f"{path} {name}")
    return found


def cli_help() -> str:
    from collage.app.cli.main import build_parser

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS
    try:
        pages = [f"=== {path}\n{parser.format_help()}" for path, parser in _commands(build_parser(), "collage")]
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before
    return "\n".join(pages)


if __name__ == "__main__":
    SNAPSHOTS.mkdir(exist_ok=True)
    OPENAPI.write_text(openapi_document())
    CLI_HELP.write_text(cli_help())
    print(f"wrote {OPENAPI} and {CLI_HELP}")
