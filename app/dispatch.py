"""How the API hands runs to workers. The Celery implementation lives in ``worker/``; the API only sees this."""

from __future__ import annotations

from typing import Any, Protocol


class Dispatcher(Protocol):
    def submit(self, run_id: str, queue: str) -> None:
        """Queue a run (new, resumed or cloned) for a worker on ``queue``."""

    def submit_job(self, job_id: str, queue: str) -> None:
        """Queue a job (an export, a playground generation: ``app.store.jobs``) for a worker of ``queue``."""

    def cancel(self, run_id: str) -> None:
        """Ask the worker running ``run_id`` to checkpoint and stop."""

    def health(self) -> dict[str, Any]:
        """Broker and live workers, for ``GET /health``."""
