"""``collage runs list | cancel | logs``: the runs of a Collage server, over its REST API.

Exit codes: 0 done; 1 the server refused (no such run, not allowed in its status, not yours) or, with
``logs --follow``, the run ended without succeeding; 2 the command could not talk to the server (unreachable,
no or bad token). ``logs --follow`` exits like ``submit --follow``: 0 only when the run succeeded.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from typing import Any

import httpx

from collage.app.cli.client import ApiError, call, connect
from collage.app.core.status import ENDED

EVENTS_PAGE = 1000  # the API's most per request


def _when(text: str | None, seconds: bool = False) -> str:
    if not text:
        return "-"
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _status(run: dict[str, Any]) -> str:
    if run["status"] == "queued" and run.get("queue_position"):
        queue = ((run.get("config") or {}).get("resources") or {}).get("queue") or "default"
        return f"queued #{run['queue_position']} in {queue}"
    return run["status"]


def list_runs(server: str | None, token: str | None, status: str | None, tag: str | None, q: str | None,
              limit: int, as_json: bool) -> int:  # fmt: skip
    client, _ = connect(server, token)
    runs: list[dict[str, Any]] = []
    cursor = None
    while len(runs) < limit:
        params = {"status": status, "tag": tag, "q": q, "cursor": cursor, "limit": min(200, limit - len(runs))}
        page = call(client, "GET", "/runs", params={k: v for k, v in params.items() if v is not None})
        runs += page["items"]
        cursor = page["next_cursor"]
        if not cursor:
            break
    # a queued run's place in its queue is on the run itself (GET /runs/{id}), as the dashboard shows it
    for i, run in enumerate(runs):
        if run["status"] == "queued":
            try:
                runs[i] = call(client, "GET", f"/runs/{run['id']}")
            except ApiError as exc:
                if exc.exit_code != 1:  # a run deleted meanwhile keeps its listed state
                    raise
    if as_json:
        print(json.dumps(runs, indent=2))
        return 0
    if not runs:
        print("no runs" + (" match" if status or tag or q else ""), file=sys.stderr)
        return 0
    rows: list[tuple[str, ...]] = [("ID", "NAME", "STATUS", "STEP", "REWARD", "CREATED", "BY")]
    for run in runs:
        reward = run.get("latest_reward")
        step = f"{run['progress']['step']}/{run['progress']['max_steps']}"
        rows.append((run["id"], run["name"], _status(run), step, "-" if reward is None else f"{reward:.3f}",
                     _when(run["created_at"]), run.get("created_by") or "-"))  # fmt: skip
    print(_table(rows))
    if cursor:
        print(f"(more runs on the server: --limit {limit * 2} shows more)", file=sys.stderr)
    return 0


def cancel_runs(server: str | None, token: str | None, run_ids: list[str]) -> int:
    client, _ = connect(server, token)
    code = 0
    for run_id in run_ids:
        try:
            run = call(client, "POST", f"/runs/{run_id}/cancel")
        except ApiError as exc:
            if exc.exit_code != 1:
                raise  # the server is unreachable or refuses the token: no point trying the others
            print(f"collage: error: {exc}", file=sys.stderr)
            code = 1
            continue
        if run["status"] == "cancelling":
            print(f"run {run_id} is cancelling: it saves a checkpoint at its next step, then stops")
        else:
            print(f"run {run_id} is {run['status']}")
    return code


def _print_event(event: dict[str, Any]) -> None:
    first, *rest = event["message"].splitlines() or [""]
    print(f"{_when(event['time'], seconds=True)}  {event['level']:<7}  {first}")
    for line in rest:  # a traceback keeps its lines, indented under its event
        print(f"{'':19}  {'':7}  {line}")


def show_logs(server: str | None, token: str | None, run_id: str, follow: bool, level: str | None) -> int:
    client, _ = connect(server, token)
    after: int | None = None

    def drain() -> None:  # every event written so far, a page at a time
        nonlocal after
        while True:
            params = {"after": after, "level": level, "limit": EVENTS_PAGE}
            page = call(
                client, "GET", f"/runs/{run_id}/events", params={k: v for k, v in params.items() if v is not None}
            )
            for event in page["items"]:
                _print_event(event)
            sys.stdout.flush()
            after = page["last_id"] if page["last_id"] is not None else after
            if len(page["items"]) < EVENTS_PAGE:
                return

    drain()
    if not follow:
        return 0
    while True:
        status = call(client, "GET", f"/runs/{run_id}")["status"]
        drain()  # after reading the status: the events that led to an end are printed before the loop stops
        if status in ENDED:
            print(f"run {run_id} {status}", file=sys.stderr)
            return 0 if status == "succeeded" else 1
        time.sleep(1)


def run_command(args) -> int:
    """The ``collage runs`` subcommands' entry point; an :class:`ApiError` ends it with its message and code."""
    try:
        if args.sub == "list":
            return list_runs(args.server, args.token, args.status, args.tag, args.q, args.limit, args.json)
        if args.sub == "cancel":
            return cancel_runs(args.server, args.token, args.run_ids)
        return show_logs(args.server, args.token, args.run_id, args.follow, args.level)
    except ApiError as exc:
        print(f"collage: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except httpx.HTTPError as exc:  # a connection dropped mid-command
        print(f"collage: error: the server stopped answering: {exc}", file=sys.stderr)
        return 2
