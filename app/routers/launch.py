"""Putting a run in a queue, for the routes that create, clone or resume runs: the config's checks against the
operator's settings, the submit-time read of its dataset, the stored run, and its hand-over to the dispatcher."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException

from collage.app.core.settings import Settings
from collage.app.core.status import RunStatus
from collage.app.datasets.client import DatasetGate
from collage.app.datasets.probe import probe_errors
from collage.app.store.tables import ApiToken, Run
from collage.training.config import RunConfig

from ..deps import DatasetGateDep, DispatcherDep, SettingsDep, WriterDep
from ..dispatch import Dispatcher
from ..store.writer import StoreWriter
from ..validation import semantic_errors


def validation_error(errors: list[tuple[str, str]]) -> HTTPException:
    """422 with every ``(key path, message)``, the shape a run config's errors have everywhere."""
    return HTTPException(422, [{"path": p, "message": m} for p, m in errors])


@dataclass(frozen=True)
class Launcher:
    settings: Settings
    gate: DatasetGate  # the submit-time dataset read waits in the same gate as the dataset routes
    writer: StoreWriter
    dispatcher: Dispatcher

    def create(self, config: RunConfig, token: ApiToken, parent_id: str | None = None) -> Run:
        """Check ``config`` whole (422 with every error), store it as a queued run and dispatch it."""
        errors = semantic_errors(config, self.settings)
        if not errors:  # the dataset is read only once its source may be read at all
            errors = probe_errors(self.gate, self.settings, config, token)
        if errors:
            raise validation_error(errors)
        run = self.writer.create_run(config.model_dump(mode="json"), parent_id=parent_id, created_by=token)
        self.dispatch(run)
        return run

    def dispatch(self, run: Run) -> None:
        """Hand a stored run to the dispatcher; if that fails the run is marked failed, never left dangling."""
        try:
            self.dispatcher.submit(run.id, run.config.get("resources", {}).get("queue", "default"))
        except Exception as exc:  # any broker failure: the run is marked failed and the error re-raised as 503
            self.writer.transition(
                run.id, [RunStatus.QUEUED], RunStatus.FAILED, error=f"could not queue the run: {exc}"
            )
            raise HTTPException(503, f"run {run.id} was stored but could not be queued: {exc}") from exc


async def _launcher(
    settings: SettingsDep, gate: DatasetGateDep, writer: WriterDep, dispatcher: DispatcherDep
) -> Launcher:
    return Launcher(settings, gate, writer, dispatcher)


LauncherDep = Annotated[Launcher, Depends(_launcher)]
