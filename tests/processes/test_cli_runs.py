"""The command line against a real `collage serve` (issue 17, items 17 and 22): serve records where it listens and
the CLI defaults to it; `collage submit` waits for a serve whose embedded worker is still starting (the demo's false
"no live worker" warning); `collage runs list | cancel | logs` with their errors and exit codes; and a terminal
free of Hugging Face progress bars and of Celery's root warning.

The serve here starts its embedded worker late on purpose (a `sitecustomize` holds `collage worker` back until the
test releases it, as a loaded machine would delay it): the race the demo lost is then certain, not a matter of luck.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from collage.app.cli import serve_record
from tests.support import API, ROOT
from tests.support.browser import small_config, wait_done, wait_step
from tests.support.serve import Serve, serve_env
from tests.support.services import free_port
from tests.support.waiting import scaled, wait_for

# an embedded worker waits for the gate file the test creates (at most 10 minutes, so that nothing is left behind)
HELD_WORKER = """
import os, sys, time
gate = os.environ.get("COLLAGE_TEST_WORKER_GATE")
if gate and os.environ.get("COLLAGE_PARENT_PID") and sys.argv[1:2] == ["worker"]:
    deadline = time.monotonic() + 600
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


NO_WORKER = "no live worker takes runs from queue"


HF_BARS = ("Loading weights", "Writing model shards", "it/s]", "Map:", "Generating train split")


def cli(env: dict, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "collage.app.cli", *argv], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=scaled(timeout))  # fmt: skip


@pytest.fixture(scope="module")
def slow_serve(tmp_path_factory):
    """A `collage serve` on a free port whose embedded worker is held back until ``release()``; yielded as soon as
    its record exists (it is still starting)."""
    home = tmp_path_factory.mktemp("cli-home")
    site = tmp_path_factory.mktemp("held-worker")
    (site / "sitecustomize.py").write_text(HELD_WORKER)
    gate = site / "release"
    env = serve_env(home, PYTHONPATH=f"{site}:{ROOT}", COLLAGE_TEST_WORKER_GATE=str(gate))
    for key in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS", "COLLAGE_REWARD_MODULES"):
        env.pop(key, None)
    serve = Serve(home, env=env).start()
    record = home / "serve" / f"{serve.pid}.json"
    try:
        wait_for(record.exists, "serve to write its record", gone=serve.exited, logs=[serve.log])
        client_env = {k: v for k, v in env.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}
        yield {"proc": serve.proc, "home": home, "port": serve.port, "base": serve.base, "env": client_env,
               "log": serve.log, "record": record, "release": gate.touch, "serve": serve}  # fmt: skip
    finally:
        gate.touch()
        serve.interrupt()
    assert not record.exists(), "serve left its record behind"


def api(serve) -> httpx.Client:
    token = (serve["home"] / "token").read_text().strip()
    return httpx.Client(base_url=serve["base"] + API, headers={"Authorization": f"Bearer {token}"}, timeout=scaled(30))


def test_submit_waits_for_a_starting_serve_and_its_run_has_no_false_warning(slow_serve, tmp_path):
    """The demo's order (serve started, its /health answering, then submit) while the embedded worker is still
    starting: submit waits for it, so the run is never told that no worker serves its queue."""
    first = json.loads(slow_serve["record"].read_text())
    assert first["url"] == slow_serve["base"] and first["pid"] == slow_serve["proc"].pid and first["ready"] is False
    # as scripts/demo.sh did: wait for /health, then submit at once
    wait_for(lambda: httpx.get(slow_serve["base"] + API + "/health", timeout=scaled(5)).status_code, "/health",
             until=lambda status: status == 200, ignore=(httpx.HTTPError,), gone=slow_serve["serve"].exited)  # fmt: skip
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_config("cli-first", max_steps=2)))
    stderr = tmp_path / "submit.err"
    with stderr.open("w") as err:
        submit = subprocess.Popen(
            [sys.executable, "-m", "collage.app.cli", "submit", str(config), "--server", slow_serve["base"], "--follow"],
            env=slow_serve["env"], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
        try:
            # submit is waiting for the worker that is still held back; only then does the worker start
            wait_for(
                stderr.read_text,
                "submit to wait for the starting serve",
                until=lambda text: "waiting for collage serve" in text,
                gone=lambda: None if submit.poll() is None else f"submit exited with {submit.returncode}",
            )
            slow_serve["release"]()
            out, _ = submit.communicate(timeout=scaled(300))
        finally:
            submit.kill()
    done = subprocess.CompletedProcess(submit.args, submit.returncode, out, stderr.read_text())
    assert done.returncode == 0, done.stdout + done.stderr
    assert NO_WORKER not in done.stdout + done.stderr
    run_id = done.stdout.split()[2]
    events = api(slow_serve).get(f"/runs/{run_id}/events").json()["items"]
    assert not [e for e in events if NO_WORKER in e["message"]], events
    assert json.loads(slow_serve["record"].read_text())["ready"] is True


def test_the_terminal_shows_no_progress_bars_and_no_root_warning(slow_serve):
    """What serve's terminal showed while the first run built its tiny model, loaded it and saved checkpoints (the
    terminal `scripts/demo.sh` follows its run in)."""
    slow_serve["release"]()
    client = api(slow_serve)
    if not client.get("/runs", params={"status": "succeeded"}).json()["items"]:  # run on its own (-k): train once
        wait_done(client, client.post("/runs", json=small_config("cli-bars", max_steps=1)).json()["id"])
    text = slow_serve["log"].read_text()
    assert "Collage is serving on" in text
    assert not [bar for bar in HF_BARS if bar in text], text[-3000:]
    assert "superuser privileges" not in text, text[-3000:]


def test_token_link_and_submit_default_to_the_running_serve(slow_serve, tmp_path):
    slow_serve["release"]()
    slow_serve["serve"].wait_up(workers=1)
    env = slow_serve["env"]
    done = cli(env, "token", "link", "collage serve")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{slow_serve['base']}/login/link/"), done.stdout
    # an explicit --server, or COLLAGE_SERVER, still wins
    assert cli(env, "token", "link", "collage serve", "--server", "http://elsewhere:9").stdout.startswith(
        "http://elsewhere:9/login/link/"
    )
    assert cli({**env, "COLLAGE_SERVER": "http://env:7/"}, "token", "link", "collage serve").stdout.startswith(
        "http://env:7/login/link/"
    )
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_config("cli-default", max_steps=1)))
    done = cli(env, "submit", str(config))  # no --server: not port 8000, the serve's own
    assert done.returncode == 0, done.stderr
    assert slow_serve["base"] in done.stdout and "waiting" not in done.stderr  # ready now: no wait
    wait_done(api(slow_serve), done.stdout.split()[2])


def test_a_killed_serve_leaves_a_stale_record_that_is_skipped_and_removed(slow_serve):
    dead = subprocess.Popen(["true"])
    dead.wait()
    folder = slow_serve["home"] / "serve"
    stale = serve_record.ServeRecord(url="http://127.0.0.1:1", pid=dead.pid, started=None, since=time.time() + 60,
                                     workers=1, ready=True)  # fmt: skip
    path = serve_record.write(slow_serve["home"], stale)
    done = cli(slow_serve["env"], "token", "link", "collage serve")
    assert done.stdout.startswith(slow_serve["base"]), done.stdout
    assert not path.exists() and sorted(p.name for p in folder.iterdir()) == [slow_serve["record"].name]


def test_runs_list_cancel_and_logs(slow_serve):
    slow_serve["release"]()
    env, client = slow_serve["env"], api(slow_serve)
    long = client.post("/runs", json=small_config("cli-long", max_steps=400)).json()["id"]
    wait_step(client, long, 1)
    waiting = client.post("/runs", json=small_config("cli-waiting")).json()["id"]

    listed = cli(env, "runs", "list")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["ID", "NAME", "STATUS", "STEP", "REWARD", "CREATED", "BY"]
    by_id = {row.split()[0]: row for row in rows}
    assert "queued #1 in default" in by_id[waiting] and " running " in by_id[long], listed.stdout
    assert "cli-first" in listed.stdout and "succeeded" in listed.stdout
    as_json = json.loads(cli(env, "runs", "list", "--json", "--status", "queued").stdout)
    assert [r["id"] for r in as_json] == [waiting] and as_json[0]["queue_position"] == 1
    assert [r["name"] for r in json.loads(cli(env, "runs", "list", "--json", "--limit", "1").stdout)] == ["cli-waiting"]
    assert cli(env, "runs", "list", "--limit", "0").returncode == 2

    # cancel: a queued run at once, a running one after its checkpoint; refusals exit 1 with the server's words
    done = cli(env, "runs", "cancel", waiting, "nosuchrun")
    assert done.returncode == 1
    assert done.stdout.strip() == f"run {waiting} is cancelled"
    assert "no run with id 'nosuchrun'" in done.stderr
    again = cli(env, "runs", "cancel", waiting)
    assert again.returncode == 1 and "only queued or running runs can be cancelled" in again.stderr
    member = cli(env, "token", "create", "member-1").stdout.strip()
    mine = cli({**env, "COLLAGE_TOKEN": member}, "runs", "cancel", long)
    assert mine.returncode == 1 and "only the run's creator or an admin" in mine.stderr
    follow = subprocess.Popen([sys.executable, "-m", "collage.app.cli", "runs", "logs", long, "--follow"], env=env,
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    done = cli(env, "runs", "cancel", long)
    assert done.returncode == 0 and "cancelling: it saves a checkpoint" in done.stdout, done.stdout + done.stderr
    out, err = follow.communicate(timeout=scaled(180))
    assert follow.returncode == 1, out + err  # followed to its end, which is not a success
    assert f"run {long} cancelled" in err
    lines = out.splitlines()
    assert "queued" in lines[0] and any("status: running" in line for line in lines)
    assert any("cancel requested" in line for line in lines) and lines[-1].split()[2] == "info"

    logs = cli(env, "runs", "logs", waiting)
    assert logs.returncode == 0 and "cancelled before it started" in logs.stdout
    first = cli(env, "runs", "list", "--json", "-q", "cli-first")
    done = cli(env, "runs", "logs", json.loads(first.stdout)[0]["id"], "--follow")
    assert done.returncode == 0 and "succeeded at step 2" in done.stdout, done.stdout + done.stderr
    assert cli(env, "runs", "logs", "nosuchrun").returncode == 1


def test_runs_commands_say_what_is_wrong_with_the_server_or_token(slow_serve, tmp_path):
    env = slow_serve["env"]
    bad = cli({**env, "COLLAGE_TOKEN": "not-a-token"}, "runs", "list")
    assert bad.returncode == 2 and "refused the API token" in bad.stderr and "Traceback" not in bad.stderr
    port = free_port()
    gone = cli(env, "runs", "list", "--server", f"http://127.0.0.1:{port}")
    assert gone.returncode == 2 and f"cannot reach http://127.0.0.1:{port}" in gone.stderr
    empty = tmp_path / "home"
    none = cli({**env, "COLLAGE_HOME": str(empty)}, "runs", "logs", "x", "--server", slow_serve["base"])
    assert none.returncode == 2 and "no API token" in none.stderr


def _record(home: Path, pid: int, since: float, ready: bool, url: str) -> Path:
    rec = serve_record.ServeRecord(url=url, pid=pid, started=serve_record.process_start(pid), since=since, workers=1,
                                   ready=ready)  # fmt: skip
    return serve_record.write(home, rec)


def test_two_serves_the_newest_ready_one_is_chosen(tmp_path, monkeypatch):
    monkeypatch.delenv("COLLAGE_SERVER", raising=False)
    one, two = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    try:
        assert serve_record.resolve_server(None, tmp_path) == "http://127.0.0.1:8000"  # none: the old default
        _record(tmp_path, one.pid, 100.0, True, "http://127.0.0.1:8001")
        _record(tmp_path, two.pid, 200.0, False, "http://127.0.0.1:8002")  # newer, still starting
        assert serve_record.resolve_server(None, tmp_path) == "http://127.0.0.1:8001"
        _record(tmp_path, two.pid, 200.0, True, "http://127.0.0.1:8002")  # rewritten in place: ready
        assert serve_record.resolve_server(None, tmp_path) == "http://127.0.0.1:8002"
        assert serve_record.resolve_server("http://x:1/", tmp_path) == "http://x:1"
        monkeypatch.setenv("COLLAGE_SERVER", "http://env:2")
        assert serve_record.resolve_server(None, tmp_path) == "http://env:2"
        assert sorted(p.stat().st_mode & 0o777 for p in (tmp_path / "serve").iterdir()) == [0o600, 0o600]
    finally:
        for proc in (one, two):
            proc.kill()
            proc.wait()
    monkeypatch.delenv("COLLAGE_SERVER")
    assert serve_record.resolve_server(None, tmp_path) == "http://127.0.0.1:8000"  # both gone: stale, removed
    assert list((tmp_path / "serve").iterdir()) == []


def test_only_the_embedded_workers_root_warning_is_silenced(tmp_path):
    """Celery warns a root worker that accepts JSON and refuses one that accepts pickle (unless C_FORCE_ROOT). An
    embedded worker drops the warning; a stand-alone worker keeps it; the pickle refusal stays."""
    code = """
import os, sys
os.getuid = os.geteuid = lambda: 0  # as root
from celery.exceptions import SecurityError
from celery.platforms import check_privileges
from collage.app.cli.main import allow_embedded_root
allow_embedded_root()
check_privileges({"json"})
try:
    check_privileges({"pickle"})
except SecurityError:
    print("pickle refused")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default"}
    env.pop("C_FORCE_ROOT", None)
    for embedded in (True, False):
        run_env = {**env, "COLLAGE_PARENT_PID": "1"} if embedded else {k: v for k, v in env.items()
                                                                       if k != "COLLAGE_PARENT_PID"}  # fmt: skip
        done = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True,
                              timeout=scaled(60))  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "pickle refused"
        assert ("superuser privileges" in done.stderr) is not embedded, done.stderr
