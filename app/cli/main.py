"""The ``collage`` command line.

Heavy imports (torch, transformers) happen inside the commands that need them, so ``collage --help`` and the
light commands stay fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any


def _cmd_build_tiny(args: argparse.Namespace) -> int:
    from collage.training.models.tiny import build_tiny

    out = build_tiny(args.family, args.out)
    print(f"built tiny {args.family} model in {out}")
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from collage.training.data.synth import write_synth

    file = write_synth(
        args.task,
        args.out,
        rows=args.rows,
        min_images=args.min_images,
        max_images=args.max_images,
        seed=args.seed,
        fmt=args.format,
        size=args.image_size,
    )
    print(f"wrote {args.rows} rows of {args.task} to {file}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from collage.training.data.check import check_dataset

    if args.max_prompt_length is not None and args.model is None:
        print("collage: error: --max-prompt-length needs --model to count the prompt's tokens", file=sys.stderr)
        return 2
    if args.sample is not None and args.sample < 1:
        print("collage: error: --sample must be at least 1", file=sys.stderr)
        return 2
    mapping = _mapping_of(args)
    if mapping is None:
        return 2
    synth = {}
    if args.source.startswith("synth:"):
        synth = dict(rows=args.rows, min_images=args.min_images, max_images=args.max_images, seed=args.seed)
    from collage.app.cli.progress import CountProgress
    from collage.app.core.settings import get_settings
    from collage.training.data.errors import DatasetError

    roots = get_settings().data_roots or None  # with COLLAGE_DATA_ROOTS set, images are confined as a worker does
    bar = CountProgress("checking rows") if not args.json else None
    try:
        report = check_dataset(
            args.source,
            split=args.split,
            model=args.model,
            max_prompt_length=args.max_prompt_length,
            data_roots=roots,
            mapping=mapping,
            config_name=args.config_name,
            limit=args.sample,
            progress=bar.update if bar is not None else None,
            **synth,
        )
    except DatasetError as exc:
        print(f"collage: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        for err in report.errors:
            print(str(err))
        for kind, count in sorted(report.conversions.items()):
            print(f"{count} image(s): {kind} (as the model's processor does)")
        for large in report.large_images:
            tokens = f", {large['image_tokens']} image tokens in its row for {args.model}" if args.model else ""
            print(f"row {large['row']}: image {large['image']} is {large['width']}x{large['height']}{tokens}")
        print(report.summary() + (f" (a sample: the first {args.sample} rows)" if args.sample else ""))
    if report.rows == 0:
        print(f"{args.source}: the split {args.split!r} has no rows", file=sys.stderr)
    if args.fix is not None:
        return _write_fix(args, mapping, roots, synth)
    return 0 if report.ok else 1


def _mapping_of(args: argparse.Namespace):
    """The RowMapping of --columns, --prompt-template and --system-prompt, validated like dataset.* in a config
    (None after printing the errors)."""
    from pydantic import ValidationError

    from collage.training.config import DatasetSettings
    from collage.training.data.mapping import RowMapping, parse_columns

    try:
        columns = parse_columns(args.columns) if args.columns else None
        settings = DatasetSettings(source=args.source, columns=columns, prompt_template=args.prompt_template,
                                   system_prompt=args.system_prompt)  # fmt: skip
    except ValueError as exc:
        errors = exc.errors() if isinstance(exc, ValidationError) else [{"loc": ("columns",), "msg": str(exc)}]
        for error in errors:
            where = ".".join(str(p) for p in error["loc"])
            flag = {"columns": "--columns", "prompt_template": "--prompt-template", "system_prompt": "--system-prompt"}
            print(f"collage: error: {flag.get(where.split('.')[0], where)} ({where}): {error['msg']}", file=sys.stderr)
        return None
    return RowMapping.of(settings)


def _write_fix(args: argparse.Namespace, mapping, roots, synth) -> int:
    from pathlib import Path

    from collage.training.data.fix import FixError, write_fixed
    from collage.training.data.loader import load_dataset

    dataset = load_dataset(args.source, args.split, data_roots=roots, mapping=mapping, config_name=args.config_name,
                           limit=args.sample, **synth)  # fmt: skip
    try:
        result = write_fixed(dataset, Path(args.fix))
    except FixError as exc:
        print(f"collage: error: {exc}", file=sys.stderr)
        return 2
    for column, why in result.unwritable_columns.items():
        print(f"column {column!r} left out of the fixed copy: it {why}")
    print(f"wrote {result.written} rows to {result.file}; {len(result.bad)} bad rows left out, listed in "
          f"{result.file.parent / 'bad_rows.jsonl'}")  # fmt: skip
    return 0


def _cmd_preview(args: argparse.Namespace) -> int:
    from pathlib import Path

    from collage.app.datasets.process import preview_rows
    from collage.training.data.loader import load_dataset

    dataset = load_dataset(args.source, args.split)
    rows = preview_rows(dataset, args.rows, Path(args.artifacts))
    print(json.dumps({"source": args.source, "rows": rows}, default=str))
    return 0


def _cmd_db_upgrade(args: argparse.Namespace) -> int:
    from collage.app.core.settings import get_settings
    from collage.app.store.engine import current_revision, engine_for, upgrade

    url = get_settings().database_url
    upgrade(url)
    engine = engine_for(url)
    print(f"database {engine.url.render_as_string(hide_password=True)} is at migration {current_revision(engine)}")
    return 0


def _cmd_token_create(args: argparse.Namespace) -> int:
    from collage.app.store.engine import migrated_store
    from collage.app.store.tokens import create_token

    token = create_token(migrated_store(), args.name, args.role, args.expires)
    print(token)
    print(f"API token {args.name!r} ({args.role}) created; it is shown only this once.", file=sys.stderr)
    return 0


def _cmd_token_list(args: argparse.Namespace) -> int:
    from collage.app.store.engine import migrated_store
    from collage.app.store.tokens import list_tokens, usable

    rows: list[tuple[str, ...]] = [("NAME", "ROLE", "PREFIX", "CREATED", "LAST USED", "EXPIRES", "STATE")]
    for t in list_tokens(migrated_store()):
        state = "revoked" if t.revoked else ("live" if usable(t) else "expired")
        when = [f"{d:%Y-%m-%d %H:%M}" if d else "-" for d in (t.created_at, t.last_used_at, t.expires_at)]
        rows.append((t.name, t.role, t.prefix + "…", *when, state))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _cmd_token_revoke(args: argparse.Namespace) -> int:
    from collage.app.store.engine import migrated_store
    from collage.app.store.tokens import revoke_token

    revoke_token(migrated_store(), args.name)
    print(f"revoked {args.name!r}: its API access and browser sessions have ended", file=sys.stderr)
    return 0


def _cmd_token_link(args: argparse.Namespace) -> int:
    from collage.app.cli.serve_record import resolve_server
    from collage.app.core.settings import get_settings
    from collage.app.store.engine import migrated_store
    from collage.app.store.tokens import create_login_link

    code = create_login_link(migrated_store(), args.name)
    base = resolve_server(args.server, get_settings().home)
    print(f"{base}/login/link/{code}")
    print("one-time login link: single use, valid for 10 minutes", file=sys.stderr)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from collage.app.core.extras import require

    require("web", "collage serve")
    if args.workers:
        require(
            "worker", f"collage serve --workers {args.workers} (embedded training workers; --workers 0 serves only)"
        )
    from collage.app.cli.progress import quiet_library_progress_bars
    from collage.app.cli.serve import serve, token_file
    from collage.app.cli.serve_record import Recorder, client_url
    from collage.app.core.settings import get_settings

    quiet_library_progress_bars()  # for the workers and the dataset helper serve starts: they inherit it
    home = get_settings().home
    # where this serve listens, for `collage submit`, `runs` and `token link` on this machine (app/cli/serve_record.py)
    recorder = Recorder(home, client_url(args.host, args.port), args.workers, token_file(home)) if args.port else None
    if recorder is not None:
        recorder.start()
    try:
        return serve(args.host, args.port, args.workers)
    finally:
        if recorder is not None:
            recorder.stop()


ROOT_WARNING = "You're running the worker with superuser privileges"


def allow_embedded_root() -> None:
    """Silence Celery's "running the worker with superuser privileges" warning in a worker `collage serve` started.

    Celery's check (celery.platforms.check_privileges) guards against a root worker that accepts pickle: a broker
    message would then be code run as root. With pickle accepted it *raises* unless C_FORCE_ROOT is set; without
    pickle it only warns, and C_FORCE_ROOT changes nothing. Collage accepts JSON only, so that danger does not exist;
    setting C_FORCE_ROOT would be wrong (it would allow pickle as root if the configuration ever did). An embedded
    worker is a child of `collage serve`, run by the same user with nothing more than serve already has, and its
    advice (Celery's --uid) is not an option of `collage serve`: the warning is noise there. A stand-alone
    `collage worker` as root keeps it: on a GPU host that is a deployment choice worth questioning. Only this one
    warning is filtered, only in the embedded worker; the pickle refusal is an error and is never affected.
    """
    import warnings

    if os.environ.get("COLLAGE_PARENT_PID"):
        warnings.filterwarnings("ignore", message=ROOT_WARNING)


def _cmd_worker(args: argparse.Namespace) -> int:
    from collage.app.core.extras import require

    require("worker", "collage worker")
    from collage.app.cli.progress import quiet_library_progress_bars

    quiet_library_progress_bars()  # a worker's output is its log; the run's progress is in the store
    allow_embedded_root()
    from collage.worker.main import run_worker

    gpus = [int(g) for g in args.gpus.split(",") if g.strip()] if args.gpus else []
    queues = [q for q in args.queues.split(",") if q]
    run_worker(queues, gpus, name=args.name, loglevel="WARNING" if args.quiet else args.loglevel, quiet=args.quiet)
    return 0


def _cmd_submit(args: argparse.Namespace) -> int:
    from collage.app.cli.submit import submit

    return submit(args.config, args.set, args.server, args.token, args.follow)


def _cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from collage.app.cli.progress import ProgressBar, quiet_library_progress_bars
    from collage.training.config import load_config
    from collage.training.trainer import Trainer

    quiet_library_progress_bars()  # one progress bar, Collage's: a checkpoint save would draw another under it
    config = load_config(args.config, args.set)
    assert config.name is not None  # load_config names every run (from dataset, algorithm and model when unset)
    out = Path(args.out or Path("out") / config.name)
    if not args.resume and (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size:
        print(
            f"collage: error: {out} already holds a run; pass --resume to continue it or choose another --out",
            file=sys.stderr,
        )
        return 2
    from collage.training.output import OutputFolder

    bar = ProgressBar(enabled=not args.quiet)
    folder = OutputFolder(out)
    callbacks: list = [folder, bar]
    if config.logging.report_to:  # mirrored as a worker mirrors (worker/trackers.py); a tracker never fails the run
        from collage.worker.trackers import TrackersCallback

        def warn(message: str) -> None:
            folder.on_event("warning", message)
            print(f"collage: warning: {message}", file=sys.stderr)

        callbacks.append(TrackersCallback(config.logging.report_to, warn))
    try:
        from collage.app.core.settings import get_settings

        roots = get_settings().data_roots or None  # COLLAGE_DATA_ROOTS set: image paths confined as on a worker
        result = Trainer(config, out, callbacks, resume=args.resume, data_roots=roots).train()
    finally:
        bar.close()
    print(f"run {config.name} {result.status} at step {result.step}; output in {out}")
    return 0 if result.status == "succeeded" else 1


def _cmd_export(args: argparse.Namespace) -> int:
    from collage.app.core.extras import require

    require("worker", "collage export")
    from collage.app.cli.export import export_command
    from collage.app.cli.progress import quiet_library_progress_bars

    quiet_library_progress_bars()  # its own progress lines only
    return export_command(args.run_id, args.step, args.merge_lora, args.out, quiet=args.quiet)


def _cmd_runs(args: argparse.Namespace) -> int:
    from collage.app.cli.runs import run_command

    return run_command(args)


SERVER_HELP = (
    "server URL (default $COLLAGE_SERVER, else the `collage serve` running on this COLLAGE_HOME, else "
    "http://127.0.0.1:8000)"
)
TOKEN_HELP = "API token (default $COLLAGE_TOKEN, else $COLLAGE_HOME/token)"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from collage.app.version import collage_version

    parser = argparse.ArgumentParser(prog="collage", description="GRPO/RLOO fine-tuning of multi-image VLMs.")
    parser.add_argument("--version", action="version", version=f"collage {collage_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_model_and_data_commands(commands)
    _add_server_commands(commands)
    _add_client_commands(commands)
    _add_admin_commands(commands)
    _add_local_commands(commands)
    return parser


Commands = Any  # argparse's subparsers action (its class is private)


def _add_model_and_data_commands(commands: Commands) -> None:
    """``collage models build-tiny`` and ``collage data synth|check|preview``."""
    from collage.training.data.synth import TASKS
    from collage.training.models.families import TINY_FAMILIES

    models = commands.add_parser("models", help="build and inspect models").add_subparsers(dest="sub", required=True)
    tiny = models.add_parser("build-tiny", help="build a tiny random-weight VLM offline")
    tiny.add_argument("family", choices=TINY_FAMILIES)
    tiny.add_argument("--out", required=True, help="folder to write (must be new or empty)")
    tiny.set_defaults(func=_cmd_build_tiny)

    data = commands.add_parser("data", help="synthetic data and dataset checks").add_subparsers(
        dest="sub", required=True
    )
    synth = data.add_parser("synth", help="write a synthetic multi-image dataset")
    synth.add_argument("task", choices=sorted(TASKS))
    synth.add_argument("--rows", type=int, default=256)
    synth.add_argument("--min-images", type=int, default=0, help="0 mixes text-only rows in")
    synth.add_argument("--max-images", type=int, default=3)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    synth.add_argument("--image-size", type=int, default=56, help="side of each square image in pixels")
    synth.add_argument("--out", required=True)
    synth.set_defaults(func=_cmd_synth)

    check = data.add_parser("check", help="validate a dataset before spending GPU time on it")
    check.add_argument("source", help="synth:<task>, a .jsonl/.parquet file or folder, a save_to_disk folder, a hub id")
    check.add_argument("--split", default="train")
    check.add_argument("--model", help="model (tiny:<family>, folder or hub id) to count image tokens with")
    check.add_argument("--max-prompt-length", type=int)
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument("--columns", help="dataset.columns: prompt=question,images=image_1+image_2,answer=solution")
    check.add_argument("--prompt-template", help="dataset.prompt_template: '{images}Question: {question}'")
    check.add_argument("--system-prompt", help="dataset.system_prompt")
    check.add_argument("--config-name", help="dataset.config_name: a Hub dataset's configuration")
    check.add_argument("--sample", type=int, help="check only the first N rows")
    check.add_argument("--fix", metavar="OUT", help="write a corrected copy (RGB images, mapped columns, bad rows "
                       "left out and listed) to the new folder OUT")  # fmt: skip
    for flag, default in (("--rows", 256), ("--min-images", 0), ("--max-images", 3), ("--seed", 0)):
        check.add_argument(flag, type=int, default=default, help="synth:<task> sources only")
    check.set_defaults(func=_cmd_check)

    preview = data.add_parser("preview", help="the first rows as JSON, images written to an artifacts folder")
    preview.add_argument("source")
    preview.add_argument("--split", default="train")
    preview.add_argument("--rows", type=int, default=5)
    preview.add_argument("--artifacts", required=True, help="folder that receives images/<sha256>.png")
    preview.set_defaults(func=_cmd_preview)


def _add_server_commands(commands: Commands) -> None:
    """``collage serve`` and ``collage worker``: the processes of a deployment."""
    serve = commands.add_parser("serve", help="web app + API + embedded worker(s) on this machine")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=1, help="embedded workers (0: web-only node)")
    serve.set_defaults(func=_cmd_serve)

    worker = commands.add_parser("worker", help="a Celery worker: one run at a time on its GPU slot")
    worker.add_argument("--queues", default="default", help="comma-separated queues to take runs from")
    worker.add_argument("--gpus", default="", help="the GPUs of this worker's slot, e.g. 0 or 0,1 (none: CPU)")
    worker.add_argument("--name", help="worker name (default collage-<host>-<pid>)")
    worker.add_argument("--loglevel", default="INFO")
    worker.add_argument("--quiet", action="store_true", help="no banner, warnings and errors only")
    worker.set_defaults(func=_cmd_worker)


def _add_client_commands(commands: Commands) -> None:
    """``collage submit`` and ``collage runs list|cancel|logs``: a server's REST API from the shell."""
    from collage.app.core.status import RunStatus

    submit = commands.add_parser("submit", help="submit a run config to a Collage server")
    submit.add_argument("config")
    submit.add_argument("--server", default=None, help=SERVER_HELP)
    submit.add_argument("--token", default=None, help=TOKEN_HELP)
    submit.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE")
    submit.add_argument(
        "--follow", action="store_true", help="show progress until the run ends; exit 0 only if it succeeded"
    )
    submit.set_defaults(func=_cmd_submit)

    runs = commands.add_parser("runs", help="list, cancel and read the logs of a server's runs (REST API)")
    runs_sub = runs.add_subparsers(dest="sub", required=True)
    runs_list = runs_sub.add_parser("list", help="the newest runs: id, name, status (queue place), step, reward")
    runs_list.add_argument("--status", choices=[s.value for s in RunStatus])
    runs_list.add_argument("--tag")
    runs_list.add_argument("-q", help="text in the run name, or an exact run id")
    runs_list.add_argument("--limit", type=_positive, default=20, help="at most this many runs (default 20)")
    runs_list.add_argument("--json", action="store_true", help="the runs as the API returns them")
    runs_cancel = runs_sub.add_parser(
        "cancel", help="cancel runs: queued ones at once, running ones after a checkpoint"
    )
    runs_cancel.add_argument("run_ids", nargs="+", metavar="RUN_ID")
    runs_logs = runs_sub.add_parser("logs", help="a run's events: status changes, warnings, errors")
    runs_logs.add_argument("run_id", metavar="RUN_ID")
    runs_logs.add_argument("--follow", "-f", action="store_true",
                           help="keep printing new events until the run ends; exit 0 only if it succeeded")  # fmt: skip
    runs_logs.add_argument("--level", choices=("debug", "info", "warning", "error"), help="only events of this level")
    for command in (runs_list, runs_cancel, runs_logs):
        command.add_argument("--server", default=None, help=SERVER_HELP)
        command.add_argument("--token", default=None, help=TOKEN_HELP)
        command.set_defaults(func=_cmd_runs)


def _add_admin_commands(commands: Commands) -> None:
    """``collage db upgrade`` and ``collage token create|list|revoke|link``: the operator's commands."""
    db = commands.add_parser("db", help="the run store").add_subparsers(dest="sub", required=True)
    db_upgrade = db.add_parser("upgrade", help="apply migrations to COLLAGE_DATABASE_URL")
    db_upgrade.set_defaults(func=_cmd_db_upgrade)

    token = commands.add_parser("token", help="API tokens").add_subparsers(dest="sub", required=True)
    token_create = token.add_parser("create", help="print a new API token (shown once)")
    token_create.add_argument("name")
    token_create.add_argument("--role", choices=("admin", "member"), default="member",
                              help="admin: manages tokens, changes any run; member: changes only its own runs")  # fmt: skip
    token_create.add_argument("--expires", type=float, metavar="DAYS", help="the token stops working after DAYS")
    token_create.set_defaults(func=_cmd_token_create)
    token_list = token.add_parser("list", help="tokens with role, dates and state (never the secret)")
    token_list.set_defaults(func=_cmd_token_list)
    token_revoke = token.add_parser("revoke", help="end a token's API access and browser sessions now")
    token_revoke.add_argument("name")
    token_revoke.set_defaults(func=_cmd_token_revoke)
    token_link = token.add_parser("link", help="print a one-time login URL for a token (single use, 10 minutes)")
    token_link.add_argument("name")
    token_link.add_argument("--server", help="the dashboard's base URL (default $COLLAGE_SERVER, else the `collage "
                            "serve` running on this COLLAGE_HOME, else http://127.0.0.1:8000)")  # fmt: skip
    token_link.set_defaults(func=_cmd_token_link)


def _add_local_commands(commands: Commands) -> None:
    """``collage export``, ``collage config explain`` and ``collage train``: without a server."""
    export = commands.add_parser("export", help="a run's checkpoint as a plain transformers folder")
    export.add_argument("run_id", metavar="RUN_ID", help="a run id in the store, or a `collage train` output folder")
    export.add_argument("--step", default="last", help="a step number, best or last (default last)")
    export.add_argument("--merge-lora", action="store_true", help="merge a LoRA adapter into the base model's weights")
    export.add_argument("--out", required=True, help="folder to write (must be new or empty)")
    export.add_argument("--quiet", action="store_true", help="no progress lines")
    export.set_defaults(func=_cmd_export)

    config = commands.add_parser("config", help="the run config's keys").add_subparsers(dest="sub", required=True)
    explain = config.add_parser("explain", help="what a config key means, its type, default and limits")
    explain.add_argument("key", nargs="?", metavar="KEY", help="a dotted key (train.loss_type); none: list every key")
    explain.add_argument("--markdown", action="store_true", help="the key reference table of docs/training.md")
    explain.set_defaults(func=_cmd_config_explain)

    plan = commands.add_parser("plan", help="the memory a run's processes need, from the model's config alone")
    plan.add_argument("config", help="run config (YAML)")
    plan.add_argument("--gpus", type=int, help="processes to plan for (default: the config's)")
    plan.add_argument("--gpu-memory", help="memory of one GPU, e.g. 80GiB: says whether each strategy fits")
    plan.add_argument(
        "--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a config key (repeatable)"
    )
    plan.add_argument("--json", action="store_true", help="the plan as JSON")
    plan.set_defaults(func=_cmd_plan)

    train = commands.add_parser("train", help="run one GRPO/RLOO run in the foreground, no server")
    train.add_argument("config", help="run config (YAML)")
    train.add_argument("--out", help="output folder (default out/<run name>)")
    train.add_argument(
        "--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a config key (repeatable)"
    )
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(func=_cmd_train)


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from collage.training.config import load_config
    from collage.training.memory_plan import make_plan, parse_size, plan_text

    if args.gpus is not None and args.gpus < 1:
        print("collage: error: --gpus: plan for at least one process", file=sys.stderr)
        return 2
    try:
        memory = parse_size(args.gpu_memory) if args.gpu_memory else None
    except ValueError as exc:
        print(f"collage: error: --gpu-memory: {exc}", file=sys.stderr)
        return 2
    config = load_config(args.config, args.set)
    plan = make_plan(config, args.gpus, memory)
    print(json.dumps(plan.to_json(), indent=1) if args.json else plan_text(plan, args.config))
    return 0


def _cmd_config_explain(args: argparse.Namespace) -> int:
    from collage.training.config_docs import explain, key_docs, reference_markdown

    if args.markdown:
        print(reference_markdown())
        return 0
    if args.key is None:
        for doc in key_docs():
            print(f"{doc.path:45s} {doc.description.split('. ')[0][:90]}")
        return 0
    try:
        print(explain(args.key))
    except KeyError as exc:
        print(f"collage: error: {exc.args[0]}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from collage.training.infra.private import private_umask

    private_umask()  # everything collage writes (store, runs, checkpoints, caches) is its owner's alone
    args = build_parser().parse_args(argv)
    from collage.training.config import ConfigError
    from collage.training.infra.errors import CollageError

    try:
        return args.func(args)
    except ConfigError as exc:
        for path, message in exc.errors:
            print(f"collage: config error: {path}: {message}", file=sys.stderr)
        return exc.exit_code
    except CollageError as exc:
        print(f"collage: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ModuleNotFoundError as exc:
        from collage.app.core.extras import missing_extra

        missing = missing_extra(exc, f"collage {args.command}")
        if missing is None:
            raise
        print(f"collage: error: {missing}", file=sys.stderr)
        return missing.exit_code
    except OSError as exc:  # the file system's word (permissions, a full disk, a folder that exists)
        print(f"collage: error: {exc}", file=sys.stderr)
        return 2
