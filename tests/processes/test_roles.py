"""Tokens with roles and one-time login links from the command line, `collage db upgrade` and `collage token create |
list | link | revoke` each run as a process: the store file is owner-only, a listing never shows a secret, a revoked
token gets no link, and a taken name or an unknown role is refused."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest

from tests.support.waiting import scaled

pytestmark = pytest.mark.usefixtures("api")


def test_cli_tokens_roles_list_revoke_and_links(tmp_path):
    env = {**os.environ, "COLLAGE_HOME": str(tmp_path), "COLLAGE_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}"}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "collage.app.cli", *args], capture_output=True, text=True,
                              env=env, timeout=scaled(120))  # fmt: skip

    assert cli("db", "upgrade").returncode == 0
    mode = stat.S_IMODE(os.stat(tmp_path / "c.db").st_mode)
    assert mode == 0o600, oct(mode)  # the store holds token hashes and sessions: owner only
    admin = cli("token", "create", "ops", "--role", "admin", "--expires", "30")
    member = cli("token", "create", "dev")
    assert admin.returncode == 0 and member.returncode == 0 and "(member)" in member.stderr
    assert cli("token", "create", "dev").returncode == 2  # the name is taken
    listing = cli("token", "list").stdout
    rows = {line.split()[0]: line.split() for line in listing.splitlines()[1:]}
    assert rows["ops"][1] == "admin" and rows["dev"][1] == "member" and rows["dev"][-1] == "live"
    assert admin.stdout.strip() not in listing and member.stdout.strip() not in listing
    link = cli("token", "link", "dev", "--server", "https://collage.example")
    assert link.returncode == 0 and re.fullmatch(r"https://collage\.example/login/link/[\w-]{40,}\n", link.stdout)
    assert cli("token", "revoke", "dev").returncode == 0
    assert cli("token", "list").stdout.splitlines()[-1].split()[-1] == "revoked"
    assert cli("token", "link", "dev").returncode == 2 and "no live token" in cli("token", "link", "dev").stderr
    assert cli("token", "create", "x", "--role", "owner").returncode == 2
