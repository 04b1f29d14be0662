"""The export job (``jobs`` of kind ``export``): a run's checkpoint as a plain transformers folder under
``COLLAGE_ARTIFACTS/exports/<job id>/`` (``training/export.py``), for the dashboard's download.

:func:`run_export` runs in the worker (torch-free): it finds the checkpoint the store records, refuses a folder outside
the run's own folder under the artifacts and a model the operator's roots do not allow, then makes the export in a
process of its own, ``python -m collage.worker.export_job``:

- in an empty working folder, so a hub id (``org/name``) never resolves to a folder where the worker was started;
- at the training's CPU priority (``COLLAGE_TRAIN_NICE``), dying with the worker;
- its memory (a whole model, twice for a merge) given back when it ends;
- killed at once on cancel, whatever it is doing (a long load or merge), its temporary folder then removed: a
  cancelled or failed export leaves no files.

The process reports progress as JSON lines on a pipe of its own; its standard output goes to its standard error (a
library's prints never mix with the reports), which the worker's log receives. Once an export succeeds, the same
token's earlier exports are removed (``app/store/exports.py``: each token keeps its newest export on disk).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from sqlmodel import Session

from collage.app.core.status import RunStatus
from collage.app.store import checkpoints as checkpoint_store
from collage.app.store import exports as export_store
from collage.app.store.tables import Run

from .jobs import JobContext, JobFailed

log = logging.getLogger("collage.worker")

CHECK_EVERY = 1.0  # seconds between looks at the job's cancel flag while the export process is silent


def run_export(context: JobContext) -> dict[str, Any]:
    """Make the export the job asks for; returns its result (``path`` relative to the artifacts, ``bytes``, ...)."""
    from collage.app.core.trust import model_violation
    from collage.training.config import ConfigError, parse_config

    job, settings = context.job, context.settings
    run_id, step = job.request.get("run_id"), job.request.get("step")
    merge_lora = bool(job.request.get("merge_lora"))
    if not isinstance(run_id, str) or not isinstance(step, int):
        raise JobFailed(f"export {job.id}: its request names no run and step")
    context.progress(0.0, "finding the checkpoint")
    with Session(context.engine) as session:
        run = session.get(Run, run_id)
        if run is None:
            raise JobFailed(f"run {run_id} no longer exists")
        entries = checkpoint_store.run_checkpoints(session, run)
    entry = next((e for e in entries if e.step == step), None)
    if entry is None:
        raise JobFailed(
            f"run {run_id} no longer has a checkpoint at step {step} (train.save_total_limit may have removed "
            f"it): {checkpoint_store.describe_steps(entries)}"
        )
    folder = checkpoint_store.checkpoint_folder(entry.path, settings.artifacts, run_id)
    if folder is None:
        raise JobFailed(f"checkpoint step {step} of run {run_id} is recorded outside the run's folder: refused")
    context.progress(0.0, "fetching the checkpoint" if settings.remote_artifacts else "finding the checkpoint")
    present = checkpoint_store.local_checkpoint(folder, settings.artifacts, settings.mirror())
    if not present or not (folder / checkpoint_store.MODEL_FOLDER).is_dir():
        raise JobFailed(f"checkpoint step {step} of run {run_id} is recorded but its files are gone")
    try:
        config = parse_config(run.config)
    except ConfigError as exc:
        raise JobFailed(f"run {run_id}'s config no longer validates: {exc.errors[0][0]}: {exc.errors[0][1]}") from exc
    if (why := model_violation(config.model.path, settings)) is not None:
        raise JobFailed(f"model.path: {why}")
    root = export_store.exports_root(Path(settings.artifacts)).absolute()
    out = root / job.id
    request = {
        "checkpoint": str(folder),
        "base_model": config.model.path,
        "out": str(out),
        "merge_lora": merge_lora,
        "dtype": config.model.dtype,
    }
    made = _run_process(context, request, root)
    _publish(context, out)
    try:
        context.progress(1.0, "exported")  # a cancel that came while the process finished: its export goes too
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        if (mirror := settings.mirror()) is not None:
            mirror.delete_folder(export_store.export_path(job.id))
        raise
    _replace_older(context)
    return {
        "path": export_store.export_path(job.id),
        "bytes": made["bytes"],
        "kind": made["kind"],
        "merged": made["merged"],
        "run_id": run_id,
        "step": step,
    }


def _run_process(context: JobContext, request: dict[str, Any], root: Path) -> dict[str, Any]:
    """Run the export process to its end; its ``done`` report, or :class:`JobFailed` with its error."""
    job, settings = context.job, context.settings
    root.mkdir(parents=True, exist_ok=True)
    work = root / f".{job.id}.cwd"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    env = dict(os.environ)
    home = env.get("COLLAGE_HOME")
    if home:  # tiny:<family> models are cached there: absolute, since the process runs in `work`
        env["COLLAGE_HOME"] = str(Path(home).expanduser().absolute())
    from .child import NICE_ENV

    env[NICE_ENV] = str(settings.training_nice(embedded=bool(os.environ.get("COLLAGE_PARENT_PID"))))
    read_fd, write_fd = os.pipe()
    env[REPORT_FD_ENV] = str(write_fd)
    cmd = [sys.executable, "-m", "collage.worker.export_job", json.dumps(request)]
    log.info("export %s: starting %s", job.id, " ".join(cmd[:3]))
    proc = subprocess.Popen(cmd, cwd=work, env=env, pass_fds=(write_fd,), start_new_session=True)
    os.close(write_fd)
    reports: queue.Queue[dict[str, Any] | None] = queue.Queue()
    reader = threading.Thread(target=_read_reports, args=(os.fdopen(read_fd, "r"), reports), daemon=True)
    reader.start()
    done: dict[str, Any] | None = None
    error: str | None = None
    try:
        ended = False
        while not ended:
            try:
                report = reports.get(timeout=CHECK_EVERY)
            except queue.Empty:
                context.check()  # raises JobCancelled once the job was cancelled
                continue
            if report is None:
                ended = True
            elif "progress" in report:
                context.progress(float(report["progress"]), str(report.get("message") or ""))
            elif "done" in report:
                done = report["done"]
            elif "error" in report:
                error = str(report["error"])
        code = proc.wait()
    except BaseException:
        _kill(proc)
        raise
    finally:
        if proc.poll() is None:
            _kill(proc)
        shutil.rmtree(work, ignore_errors=True)
        for leftover in root.glob(f".{job.id}.export-*"):  # the temporary folder of a killed export process
            shutil.rmtree(leftover, ignore_errors=True)
    if done is not None and code == 0:
        return done
    if error is not None:
        raise JobFailed(error)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        raise JobFailed(f"the export process was killed by signal {name} (out of memory?)")
    raise JobFailed(f"the export process ended with exit code {code} (the worker's log says why)")


def _read_reports(pipe: IO[str], reports: queue.Queue[dict[str, Any] | None]) -> None:
    with pipe:
        for line in pipe:
            try:
                report = json.loads(line)
            except ValueError:
                continue
            if isinstance(report, dict):
                reports.put(report)
    reports.put(None)  # the process closed its end: it has ended


def _kill(proc: subprocess.Popen[Any]) -> None:
    """Kill the export process and anything it started (its own session), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        log.error("export process %s did not end after SIGKILL", proc.pid)


def _publish(context: JobContext, out: Path) -> None:
    """With object storage, the export goes to the bucket (its manifest last) before the job succeeds: any web node
    serves it from there. The local copy stays as this host's cache."""
    mirror = context.settings.mirror()
    if mirror is None:
        return
    context.progress(0.99, "uploading the export")
    try:
        mirror.put_folder(export_store.export_path(context.job.id), out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def _replace_older(context: JobContext) -> None:
    """Each token keeps its newest export on disk: the same token's earlier ones are removed now (and the folder of
    one cancelled just as it finished, if any)."""
    root = export_store.exports_root(Path(context.settings.artifacts))
    for old in export_store.older_exports(context.engine, context.job):
        shutil.rmtree(root / old.id, ignore_errors=True)
        if (mirror := context.settings.mirror()) is not None:
            mirror.delete_folder(export_store.export_path(old.id))
        if old.status == RunStatus.SUCCEEDED:
            export_store.mark_removed(
                context.engine, old.id, f"replaced by the newer export {context.job.id} of the same token (each "
                "token keeps its newest export)"
            )  # fmt: skip


# ------------------------------------------------------------------------------------------- the export process
REPORT_FD_ENV = "COLLAGE_EXPORT_REPORT_FD"


def main(argv: list[str]) -> int:
    from .child import die_with_parent, lower_priority

    die_with_parent()
    lower_priority()
    from collage.training.infra.private import private_umask

    private_umask()
    report_fd = int(os.environ[REPORT_FD_ENV])
    reports = os.fdopen(report_fd, "w", buffering=1)
    os.dup2(2, 1)  # a library's prints go to the log, never into the reports

    def send(**report: Any) -> None:
        reports.write(json.dumps(report) + "\n")

    request = json.loads(argv[0])
    from collage.training.export import export_checkpoint
    from collage.training.infra.errors import CollageError

    try:
        result = export_checkpoint(
            request["checkpoint"],
            request["base_model"],
            request["out"],
            merge_lora=request["merge_lora"],
            progress=lambda fraction, message: send(progress=fraction, message=message),
            dtype=request["dtype"],
        )
    except CollageError as exc:
        send(error=str(exc))
        return 2
    except Exception as exc:  # noqa: BLE001 - anything else: its type and first line; the traceback to the log
        import traceback

        traceback.print_exc()
        first = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ""
        send(error=f"{type(exc).__name__}: {first}" if first else type(exc).__name__)
        return 1
    send(done={"bytes": result.bytes, "kind": result.kind, "merged": result.merged})
    reports.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
