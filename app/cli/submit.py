"""``collage submit``: send a run config to a server over REST, optionally follow it to the end."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import yaml

from collage.app.cli.client import ApiError, connect, detail
from collage.app.cli.serve_record import resolve_server, wait_ready
from collage.app.core.settings import get_settings
from collage.app.core.status import ENDED, RunStatus

READY_WAIT = 120.0  # seconds `collage submit` waits for a serve that is still starting its workers


def submit(config_path: str, overrides: list[str], server: str | None, token: str | None, follow: bool) -> int:
    from collage.training.config import ConfigError, apply_overrides, name_override_values, parse_override

    file = Path(config_path)
    if not file.is_file():
        print(f"collage: error: config file not found: {file}", file=sys.stderr)
        return 2
    try:
        parsed = [parse_override(o) for o in overrides]
        data = apply_overrides(yaml.safe_load(file.read_text()) or {}, parsed)
    except (yaml.YAMLError, ConfigError) as exc:
        print(f"collage: error: {exc}", file=sys.stderr)
        return 2
    home = get_settings().home
    server = resolve_server(server, home)
    # a `collage serve` of this COLLAGE_HOME that is still starting: its embedded worker is not taking runs yet
    # (nor is its token written), and a run sent now would be reported as waiting for a worker seconds away
    record = wait_ready(home, server, READY_WAIT, lambda r: print(
        f"waiting for collage serve (pid {r.pid}) to start its worker{'s' if r.workers != 1 else ''}…",
        file=sys.stderr, flush=True))  # fmt: skip
    if record is not None and not record.ready:
        print(f"collage: warning: collage serve (pid {record.pid}) has no worker taking runs after {READY_WAIT:.0f} s;"
              " submitting anyway", file=sys.stderr)  # fmt: skip
    try:
        client, server = connect(server, token)
    except ApiError as exc:
        print(f"collage: error: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        response = client.post("/runs", json=data)
    except httpx.HTTPError as exc:
        print(f"collage: error: cannot reach {server}: {exc} (is `collage serve` running? choose the server with "
              "--server or COLLAGE_SERVER)", file=sys.stderr)  # fmt: skip
        return 2
    if response.status_code == 422:
        errors = [(e["path"], e["message"]) for e in response.json()["detail"]]
        for path, message in name_override_values(errors, parsed):
            print(f"collage: config error: {path}: {message}", file=sys.stderr)
        return 2
    if response.status_code != 201:
        print(f"collage: error: {response.status_code} {detail(response)}", file=sys.stderr)
        return 2
    run = response.json()
    print(f"submitted run {run['id']} ({server}{run['url']})", flush=True)
    # stdout keeps its one line per event for scripts; the page to open in a browser goes to stderr
    print(f"dashboard: {server}/runs/{run['id']}", file=sys.stderr, flush=True)
    if not follow:
        return 0
    return _follow(client, run["id"])


def shown_rewards(run: dict) -> str:
    """The training reward and, once the run has evaluated, the held-out number it is judged by: the metric it
    picks its best checkpoint by (``reward 0.512 (eval accuracy 0.547)``), else the weighted eval reward."""
    reward = run.get("latest_reward")
    shown = "-" if reward is None else f"{reward:.3f}"
    metric, value = run.get("eval_metric"), run.get("eval_metric_value")
    if metric and value is not None:
        return f"{shown} (eval {metric.removeprefix('eval/')} {value:.3f})"
    if run.get("eval_reward") is not None:
        return f"{shown} (eval reward {run['eval_reward']:.3f})"
    return shown


def _follow(client: httpx.Client, run_id: str) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    status, seen_events = RunStatus.QUEUED, None
    with Progress(
        TextColumn("[bold]{task.fields[status]}"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
        TextColumn("reward {task.fields[reward]}"), TimeElapsedColumn(), TimeRemainingColumn(),
        disable=not sys.stderr.isatty(),
    ) as progress:  # fmt: skip
        task = progress.add_task("run", total=None, status=status, reward="-")
        last_print = None
        queued_since = time.monotonic()
        warned = False
        while True:
            try:
                run = client.get(f"/runs/{run_id}").json()
                events = client.get(
                    f"/runs/{run_id}/events", params={"after": seen_events} if seen_events else {}
                ).json()
            except httpx.HTTPError as exc:
                print(f"(server unreachable: {exc}; retrying)", file=sys.stderr)
                time.sleep(2)
                continue
            for event in events["items"]:
                if event["level"] in ("warning", "error"):
                    progress.console.print(f"[{event['level']}] {event['message'].splitlines()[0][:300]}")
            seen_events = events["last_id"]
            status = run["status"]
            shown = shown_rewards(run)
            progress.update(
                task, total=run["progress"]["max_steps"], completed=run["progress"]["step"], status=status, reward=shown
            )
            line = (status, run["progress"]["step"])
            if not sys.stderr.isatty() and line != last_print:
                print(
                    f"{status} step {run['progress']['step']}/{run['progress']['max_steps']} reward {shown}", flush=True
                )
                last_print = line
            if status in ENDED:
                break
            if status == RunStatus.QUEUED and not warned and time.monotonic() - queued_since > 15:
                resources = (run.get("config") or {}).get("resources", {})
                queue, nodes = resources.get("queue", "default"), int(resources.get("nodes") or 1)
                workers = client.get("/health").json().get("workers", [])
                live = sum(queue in w["queues"] for w in workers)
                if live < nodes:
                    wanted = "no live worker takes" if nodes == 1 else f"{live} live workers (of {nodes} needed) take"
                    progress.console.print(f"[warning] {wanted} runs from queue {queue!r}: start one with "
                                           f"`collage worker --queues {queue}`")  # fmt: skip
                warned = True
            time.sleep(1)
    print(f"run {run_id} {status}" + (f": {run['error'].splitlines()[-1]}" if run.get("error") else ""))
    return 0 if status == RunStatus.SUCCEEDED else 1
