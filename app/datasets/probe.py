"""Submit-time reading of a run's local dataset: a run whose mapped columns are missing, or whose dataset has no
usable row among the first ones, is refused with 422 before it is created (no run, no queue, no GPU time).

The dataset helper (``collage.app.datasets.process``, the process that answers Preview) reads the first
:data:`PROBE_ROWS` rows under the same bounds and per-user gate as a preview; nothing is written. A synthetic
source needs no probe, and a Hub id is read by the workers, not by the web host (which may not reach the Hub).
"""

from __future__ import annotations

from typing import Any

import anyio.from_thread
from fastapi import HTTPException

from collage.app.core.settings import Settings
from collage.app.core.trust import is_local
from collage.app.datasets.client import DatasetGate, run_gated
from collage.app.store.tables import ApiToken
from collage.training.config import RunConfig
from collage.training.data.mapping import RowMapping

PROBE_ROWS = 50


def _mapping(config: RunConfig) -> dict[str, Any]:
    d = config.dataset
    fields = {
        "columns": d.columns.model_dump(exclude_none=True) if d.columns is not None else None,
        "prompt_template": d.prompt_template,
        "system_prompt": d.system_prompt,
    }
    return {k: v for k, v in fields.items() if v is not None}


def probe_errors(gate: DatasetGate, settings: Settings, config: RunConfig, token: ApiToken) -> list[tuple[str, str]]:
    """``(key path, message)`` for what keeps the run's dataset from giving it any rows, read now. Called from a
    worker thread (a sync route); the read waits in ``gate``, the one that bounds every dataset read of the app."""
    d = config.dataset
    if d.source.startswith("synth:") or not is_local(d.source):
        return []
    job = {
        "op": "probe",
        "source": d.source,
        "split": d.split,
        "mapping": _mapping(config),
        "config_name": d.config_name,
        "rows": PROBE_ROWS,
        "data_roots": [str(root) for root in settings.allowed_data_roots()],
        "max_images": settings.preview_max_images,
        "max_bytes": settings.preview_max_bytes,
    }
    try:
        report = anyio.from_thread.run(run_gated, gate, settings, token, job, settings.preview_timeout)
    except HTTPException as exc:
        if exc.status_code == 400:  # the helper could not read the source: name the key
            return [("dataset.source", str(exc.detail))]
        raise
    missing = RowMapping.of(d).missing_columns(report["column_names"]) if report["column_names"] else []
    if missing:
        names = ", ".join(repr(n) for n in report["column_names"][:30])
        return [(key, f"no column {column!r} in {d.source} (its columns: {names})") for key, column in missing]
    if report["read"] > 0 and report["usable"] == 0:
        first = report["errors"][0] if report["errors"] else None
        scope = "its rows" if report["read"] >= report["total_rows"] else f"the first {report['read']} rows"
        why = f": row {first[0]}: {first[1]}" if first else ""
        return [("dataset.source", f"none of {scope} is usable (`collage data check` lists them){why}")]
    if report["total_rows"] == 0:
        return [("dataset.source", f"{d.source} split {d.split!r} has no rows")]
    return []
