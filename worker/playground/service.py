"""Playground generations on a worker: the job handler (:func:`run_generate`) and the long-lived process that does
the work (``collage.worker.playground.process``).

The Celery process never imports torch: it keeps one playground process (:data:`PROCESS`), started for the first
generation with the worker's GPU slot (its first GPU, or the CPU), and sends it one request per model of a job.
That process keeps the last job's model(s) loaded for ``COLLAGE_PLAYGROUND_TTL`` seconds (default 600) and then
exits, giving the memory back; a job for other models replaces them. It is stopped as soon as this worker starts
a training (the training gets the GPU), and dies with the worker.

Cancel: the job's status is polled while the process works; a cancel creates the request's cancel file, which the
process looks for between phases and before every forward pass (so a generation stops at its next token), and the
job ends ``cancelled``. A process that does not stop within COLLAGE_CANCEL_GRACE, or that works longer than
COLLAGE_PLAYGROUND_TIMEOUT on one model, is killed. A missing checkpoint, an image that cannot be read, running out
of memory or the process dying all end the job ``failed`` with a message that says so (:class:`JobFailed`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from celery import signals

from collage.app.core.jsonlines import ChildGone, JsonLinesChild
from collage.app.core.settings import Settings
from collage.app.core.status import RunStatus
from collage.app.core.trust import base_model_problem, reward_violation, tool_violation
from collage.app.store import jobs as store
from collage.app.store.jobs import model_summary
from collage.worker.jobs import JobCancelled, JobContext, JobFailed

log = logging.getLogger("collage.worker")

CHILD = "collage.worker.playground.process"
POLL = 0.5  # seconds between looks at the job's status while the process works
PHASES = {"received": 0.05, "loading": 0.1, "generating": 0.4, "scoring": 0.9}


class PlaygroundProcess:
    """This worker's playground process: started when a generation needs it, reaped when it exits (its idle
    timeout, a crash, or a kill), one request at a time."""

    def __init__(self) -> None:
        self.child = JsonLinesChild("the worker's playground process")
        self.lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        proc = self.child.running
        return proc.pid if proc is not None else None

    def _start(self, settings: Settings) -> subprocess.Popen:
        from collage.worker import tasks
        from collage.worker.child import NICE_ENV
        from collage.worker.playground.process import PARENT_ENV, TTL_ENV, WORKDIR_ENV

        env = dict(os.environ)
        if env.get("COLLAGE_HOME"):  # the process works in a folder of its own: the tiny-model cache stays put
            env["COLLAGE_HOME"] = str(Path(env["COLLAGE_HOME"]).expanduser().absolute())
        env[TTL_ENV] = str(settings.playground_ttl)
        env[PARENT_ENV] = str(os.getpid())
        env[NICE_ENV] = str(settings.training_nice(embedded=bool(os.environ.get("COLLAGE_PARENT_PID"))))
        env["CUDA_VISIBLE_DEVICES"] = str(tasks.SLOT.gpus[0]) if tasks.SLOT.gpus else ""
        # it imports from where the worker runs (reward modules, as the training child does), then works in an empty
        # folder of its own: a relative `org/name` is never taken for a folder there
        folder = tempfile.mkdtemp(prefix="collage-playground-")
        env[WORKDIR_ENV] = folder
        proc = self.child.start([sys.executable, "-m", CHILD], env)
        threading.Thread(target=_reap, args=(proc, folder), name="collage-playground-reaper", daemon=True).start()
        log.info("playground process %d started (models stay loaded %.0fs without a request)", proc.pid,
                 settings.playground_ttl)  # fmt: skip
        return proc

    def stop(self, why: str) -> None:
        """End the process now (its models' memory goes back): stdin closed, then killed if it lingers."""
        with self.lock:
            proc = self.child.running
            if proc is not None:
                log.info("playground process %d: stopping (%s)", proc.pid, why)
            self.child.close(grace=5)

    def call(self, request: dict[str, Any], context: JobContext, what: str, fraction: tuple[float, float]) -> dict:
        """The process's answer to ``request`` (its result or ``{"ok": false, ...}``); the job's progress follows its
        events. :class:`JobCancelled` once the job was cancelled and the process stopped (or was killed),
        :class:`JobFailed` when it died or ran out of time. A process that was gone before it took the request (it
        exited idle just then) is started again and asked once more."""
        with self.lock:
            for attempt in (1, 2):
                proc = self.child.running or self._start(context.settings)
                exchange = _Exchange(self.child, request, context, what, fraction)
                try:
                    return exchange.run()
                except ChildGone as gone:
                    self.child.kill()
                    if exchange.acknowledged or attempt == 2:
                        raise JobFailed(f"{what}: {gone}") from gone
                    log.info("playground process %d was gone before it took the request: starting another", proc.pid)
        raise AssertionError("unreachable")


class _Exchange:
    """One request to the playground process, read until its answer: its events report the job's progress, a
    cancel of the job touches the request's cancel file, and the cancel grace and the playground's time-out bound
    it (the process is killed past either)."""

    def __init__(
        self, child: JsonLinesChild, request: dict[str, Any], context: JobContext, what: str, span: tuple[float, float]
    ) -> None:
        self.child, self.request, self.context, self.what, self.span = child, request, context, what, span
        self.acknowledged = False  # whether the process began on the request (an event came)
        self.cancelled_at: float | None = None

    def run(self) -> dict[str, Any]:
        settings = self.context.settings
        self.child.send(self.request)
        deadline = time.monotonic() + settings.playground_timeout
        while True:
            self._check_cancel(settings)
            if time.monotonic() > deadline:
                self.child.kill()
                raise JobFailed(
                    f"{self.what}: took longer than {settings.playground_timeout:.0f}s (COLLAGE_PLAYGROUND_TIMEOUT) "
                    "and was stopped: ask for fewer or shorter completions"
                )
            message = self.child.receive(until=min(deadline, time.monotonic() + POLL))
            if message is None:
                continue
            event = message.get("event")
            if event is None:
                if self.cancelled_at is not None and not message.get("cancelled"):
                    raise JobCancelled(f"{self.what}: cancelled")  # it finished first: the cancel still wins
                return message
            self.acknowledged = True
            if self.cancelled_at is None:
                low, high = self.span
                try:
                    self.context.progress(low + (high - low) * PHASES.get(event, 0.0), f"{self.what}: {event}")
                except JobCancelled:  # seen by the progress report itself: stop the process's work the same way
                    self._cancel()

    def _check_cancel(self, settings: Settings) -> None:
        if self.cancelled_at is None and self.context.cancelled():
            self._cancel()
        if self.cancelled_at is not None and time.monotonic() - self.cancelled_at > settings.cancel_grace:
            self.child.kill()
            raise JobCancelled(f"{self.what}: did not stop within {settings.cancel_grace:.0f}s and was killed")

    def _cancel(self) -> None:
        Path(self.request["cancel"]).touch()  # the process stops at its next check (next token)
        self.cancelled_at = time.monotonic()


def _reap(proc: subprocess.Popen, folder: str) -> None:
    """Wait for the process to end (its idle timeout, a stop or a crash), so it never lingers as a zombie."""
    code = proc.wait()
    shutil.rmtree(folder, ignore_errors=True)
    log.info("playground process %d ended (code %s)", proc.pid, code)


PROCESS = PlaygroundProcess()


@signals.task_prerun.connect(weak=False)
def _training_starts(sender: Any = None, **_kwargs: Any) -> None:
    """A training is about to start on this worker: it gets the memory (the GPU) the playground's models hold."""
    from collage.worker.celery_app import TASK_NAME

    if getattr(sender, "name", None) == TASK_NAME and PROCESS.pid is not None:
        PROCESS.stop("a training starts on this worker")


def _check_model(model: dict[str, Any], settings: Settings) -> None:
    """The worker's own policy again, before anything is loaded: a base model is ``tiny:<family>`` or a folder
    under this worker's COLLAGE_MODEL_ROOTS (the web node checked its own roots)."""
    if model["kind"] == "base" and (problem := base_model_problem(model["path"], settings)) is not None:
        raise JobFailed(f"{model['label']}: refused by this worker: {problem}")
    if model["kind"] != "base":
        model["path"] = str(_local_checkpoint_model(model, settings))


def _local_checkpoint_model(model: dict[str, Any], settings: Settings) -> Path:
    """The checkpoint's ``model/`` folder on this worker: confined to the run's folder under this worker's artifacts
    (with object storage the store records it relative to them) and fetched from the bucket when this host lacks it.
    A folder that is nowhere is left for the playground process to report as gone."""
    from collage.app.store.checkpoints import MODEL_FOLDER, checkpoint_folder, local_checkpoint

    recorded = str(model["path"]).removesuffix("/" + MODEL_FOLDER)
    folder = checkpoint_folder(recorded, settings.artifacts, str(model.get("run") or ""))
    if folder is None:
        raise JobFailed(f"{model['label']}: its checkpoint is recorded outside the run's folder: refused")
    local_checkpoint(folder, settings.artifacts, settings.mirror())
    return folder / MODEL_FOLDER


def _rewards(model: dict[str, Any], settings: Settings) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The model's rewards this worker may run (its COLLAGE_REWARD_MODULES, reward model folders under its roots),
    and why each other one was left out."""
    from collage.worker.playground.process import reward_name

    allowed, refused = [], {}
    for spec in model.get("rewards") or []:
        problem = reward_violation(spec["name"], settings)
        if problem is None:
            allowed.append(spec)
        else:
            refused[reward_name(spec["name"])] = f"not computed on this worker: {problem}"
    return allowed, refused


def run_generate(context: JobContext) -> dict[str, Any]:
    """The job of kind ``generate``: each model of the request, in order, in the worker's playground process."""
    request, settings = context.job.request, context.settings
    models = request["models"]
    for model in models:
        _check_model(model, settings)
    tools = list(request.get("tools") or [])
    for spec in tools:  # this worker's own allowlist again: a tool's code runs here
        if (problem := tool_violation(spec["name"], settings)) is not None:
            raise JobFailed(f"tool {spec['name']!r}: refused by this worker: {problem}")
    results = []
    with tempfile.TemporaryDirectory(prefix="collage-generate-") as tmp:
        for i, model in enumerate(models):
            what = f"model {i + 1}/{len(models)} ({model['label']})"
            span = (i / len(models), (i + 1) / len(models))
            context.progress(span[0], f"{what}: starting")  # raises JobCancelled after a cancel
            rewards, refused = _rewards(model, settings)
            child_request = {
                "op": "generate",
                "model": model,
                "keep": models,
                "prompt": request["prompt"],
                "images": request["images"],
                "artifacts": str(Path(settings.artifacts).absolute()),
                "answer": request.get("answer"),
                "columns": request.get("columns") or {},
                "rewards": rewards,
                "reward_errors": refused,
                "reward_modules": list(settings.reward_modules),
                "max_completion_length": model.get("max_completion_length"),
                "num_generations": request["num_generations"],
                "temperature": request["temperature"],
                "top_p": request["top_p"],
                "max_new_tokens": request["max_new_tokens"],
                "seed": request.get("seed"),
                "tools": tools,
                "tool_modules": list(settings.tool_modules),
                "max_tool_calling_iterations": request.get("max_tool_calling_iterations") or 4,
                "max_images_per_rollout": model.get("max_images_per_rollout"),
                "cancel": str(Path(tmp) / f"cancel-{i}"),
            }
            answer = PROCESS.call(child_request, context, what, span)
            if not answer.get("ok"):
                if answer.get("cancelled"):  # stopped by the process itself: say where (run_job keeps this end)
                    message = f"cancelled while {answer.get('phase') or 'working'}: {what}"
                    store.finish_job(context.engine, context.job.id, RunStatus.CANCELLED, message=message)
                    raise JobCancelled(message)
                raise JobFailed(f"{what}: {answer.get('error') or 'failed'}")
            results.append({"model": model_summary(model), **answer["result"]})
            context.check()
    return {"results": results, "pid": PROCESS.pid}
