"""The OpenAPI document and every CLI command's help are exactly the snapshots' (tests/support/contracts.py): a
move of modules or a rename inside the app cannot change the public surface unnoticed."""

from __future__ import annotations

from tests.support.contracts import CLI_HELP, OPENAPI, cli_help, openapi_document


def test_the_openapi_document_is_the_snapshot():
    assert openapi_document() == OPENAPI.read_text(), (
        "the OpenAPI document changed: if that is meant, run `python -m tests.support.contracts` and review the diff"
    )


def test_every_cli_command_s_help_is_the_snapshot():
    assert cli_help() == CLI_HELP.read_text(), (
        "a CLI command's help changed: if that is meant, run `python -m tests.support.contracts` and review the diff"
    )
