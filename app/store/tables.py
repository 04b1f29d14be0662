"""The run store's tables (SQLModel). Alembic migrations in ``migrations/`` create them; keep both in step."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, ForeignKey, Index, Integer, String, Table, Text, UniqueConstraint
from sqlmodel import Field, SQLModel

from collage.app.core.status import ENDED, RunStatus  # noqa: F401 - re-exported for the store


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Run(SQLModel, table=True):
    __tablename__ = "runs"
    __table_args__ = (
        Index("ix_runs_created", "created_at", "id"),
        Index("ix_runs_status_created", "status", "created_at", "id"),
    )

    id: str = Field(primary_key=True, max_length=32)
    name: str = Field(max_length=200)
    algorithm: str = Field(max_length=16)
    config: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    status: str = Field(default=RunStatus.QUEUED.value, max_length=16)  # a RunStatus value
    step: int = 0
    max_steps: int = 0
    model_path: str = Field(default="", max_length=500)
    dataset_source: str = Field(default="", max_length=500)
    created_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    updated_at: datetime = Field(default_factory=utcnow)
    heartbeat_at: datetime | None = None
    error: str | None = Field(default=None, sa_column=Column(Text))
    attempt: int = 1
    worker: str | None = Field(default=None, max_length=200)
    warning_count: int = 0
    # the API token that created the run (members may change only their own runs); None: made before 0005
    created_by: int | None = Field(
        default=None, sa_column=Column(Integer, ForeignKey("api_tokens.id", ondelete="SET NULL"), nullable=True)
    )
    parent_id: str | None = Field(
        default=None, sa_column=Column(String(32), ForeignKey("runs.id", ondelete="SET NULL"), nullable=True)
    )
    notes: str | None = Field(default=None, sa_column=Column(Text, nullable=True))  # free text, editable (0006)
    # the current attempt's recent mean step time (0010); null until it finished a step: the time left comes from it
    seconds_per_step: float | None = None


class RunTag(SQLModel, table=True):
    __tablename__ = "run_tags"
    __table_args__ = (Index("ix_run_tags_tag", "tag", "run_id"),)

    run_id: str = Field(sa_column=Column(String(32), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True))
    tag: str = Field(primary_key=True, max_length=100)


class Event(SQLModel, table=True):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run", "run_id", "id"),)

    id: int | None = Field(
        default=None,
        sa_column=Column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    )
    run_id: str = Field(sa_column=Column(String(32), ForeignKey("runs.id", ondelete="CASCADE"), nullable=False))
    time: datetime = Field(default_factory=utcnow)
    level: str = Field(max_length=16)
    message: str = Field(sa_column=Column(Text, nullable=False))
    actor: str | None = Field(default=None, max_length=100)  # the token name behind a cancel, resume, ...


class Metric(SQLModel, table=True):
    """One value per (run, key, step): re-writing a step replaces it (idempotent)."""

    __tablename__ = "metrics"

    run_id: str = Field(sa_column=Column(String(32), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True))
    key: str = Field(primary_key=True, max_length=100)
    step: int = Field(primary_key=True)
    value: float | None = None


class Sample(SQLModel, table=True):
    """A rollout row. ``reward_sort`` is ``reward`` with unscorable rows (NULL) as the lowest value, so sorting
    and keyset pagination work on one indexed, non-null column."""

    __tablename__ = "samples"
    __table_args__ = (
        UniqueConstraint("run_id", "split", "step", "group", "index", name="uq_samples_position"),
        Index("ix_samples_step", "run_id", "step", "id"),
        Index("ix_samples_split", "run_id", "split", "step", "id"),
        Index("ix_samples_reward", "run_id", "reward_sort", "id"),
        Index("ix_samples_advantage", "run_id", "advantage", "id"),
        Index("ix_samples_length", "run_id", "completion_length", "id"),
        Index("ix_samples_tool_calls", "run_id", "tool_calls", "id"),
        Index("ix_samples_tool_errors", "run_id", "tool_errors", "id"),
        Index("ix_samples_turns", "run_id", "turns", "id"),
    )

    id: int | None = Field(
        default=None,
        sa_column=Column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    )
    run_id: str = Field(sa_column=Column(String(32), ForeignKey("runs.id", ondelete="CASCADE"), nullable=False))
    step: int
    group: int
    index: int
    prompt: Any = Field(sa_column=Column(JSON, nullable=False))
    prompt_text: str = Field(default="", sa_column=Column(Text, nullable=False))
    completion: str = Field(sa_column=Column(Text, nullable=False))
    rewards: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    reward: float | None = None
    reward_sort: float = -1e300
    advantage: float = 0.0
    completion_length: int = 0
    truncated: bool = False
    num_images: int = 0
    group_mean: float | None = None
    group_std: float | None = None
    zero_std: bool = False
    dataset_row: int | None = None
    # the dataset row's scalar columns besides the prompt and images (`answer`, ...), for judging a reward (0006)
    columns: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    # "train": a rollout the policy was trained on; "eval": a held-out evaluation rollout (advantage 0) (0007)
    split: str = Field(default="train", sa_column=Column(String(8), nullable=False, server_default="train"))
    # a multi-turn rollout's turns (contract: a rollout row's ``trajectory``, its images by hash, each with its width and
    # height as stored); None for a row without tools. The counts are the table's filters and sorts (0012).
    trajectory: list[dict[str, Any]] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    tool_calls: int = Field(default=0, sa_column=Column(Integer, nullable=False, server_default="0"))
    tool_errors: int = Field(default=0, sa_column=Column(Integer, nullable=False, server_default="0"))
    turns: int = Field(default=0, sa_column=Column(Integer, nullable=False, server_default="0"))


class Image(SQLModel, table=True):
    __tablename__ = "images"

    sha256: str = Field(primary_key=True, max_length=64)
    width: int
    height: int
    format: str = Field(default="png", max_length=16)
    size_bytes: int
    path: str = Field(max_length=300)  # relative to COLLAGE_ARTIFACTS
    created_at: datetime = Field(default_factory=utcnow)


class SampleImage(SQLModel, table=True):
    __tablename__ = "sample_images"
    __table_args__ = (Index("ix_sample_images_sha", "sha256"),)

    sample_id: int = Field(
        sa_column=Column(
            BigInteger().with_variant(Integer, "sqlite"), ForeignKey("samples.id", ondelete="CASCADE"), primary_key=True
        )
    )
    position: int = Field(primary_key=True)
    sha256: str = Field(sa_column=Column(String(64), ForeignKey("images.sha256"), nullable=False))


class SampleToolImage(SQLModel, table=True):
    """A tool's image (a crop) in a rollout row's trajectory: the reference that keeps its ``images`` row while the
    row names it, as ``sample_images`` does for the row's own images (the trajectory JSON names it by hash too).
    ``position``: its index over the rollout's images (the row's own first), as a crop's ``source.image`` counts
    (0012)."""

    __tablename__ = "sample_tool_images"
    __table_args__ = (Index("ix_sample_tool_images_sha", "sha256"),)

    sample_id: int = Field(
        sa_column=Column(
            BigInteger().with_variant(Integer, "sqlite"), ForeignKey("samples.id", ondelete="CASCADE"), primary_key=True
        )
    )
    position: int = Field(primary_key=True)
    sha256: str = Field(sa_column=Column(String(64), ForeignKey("images.sha256"), nullable=False))


class Checkpoint(SQLModel, table=True):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "step", name="uq_checkpoints_step"),)

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(sa_column=Column(String(32), ForeignKey("runs.id", ondelete="CASCADE"), nullable=False))
    step: int
    path: str = Field(sa_column=Column(Text, nullable=False))
    created_at: datetime = Field(default_factory=utcnow)
    # written by 0007 and later; None for checkpoints recorded before
    attempt: int | None = None  # the attempt that wrote it
    bytes: int | None = Field(default=None, sa_column=Column(BigInteger, nullable=True))  # the model folder's size
    kind: str | None = Field(default=None, max_length=8)  # "adapter" (LoRA) or "full"
    metric: float | None = None  # train.metric_for_best_model's value at this step, when the run has one


class ApiToken(SQLModel, table=True):
    __tablename__ = "api_tokens"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=100)
    token_hash: str = Field(max_length=64, unique=True, index=True)  # sha256 of the token: never the token
    prefix: str = Field(max_length=12)  # first characters, to tell tokens apart in listings
    created_at: datetime = Field(default_factory=utcnow)
    last_used_at: datetime | None = None
    revoked: bool = False
    role: str = Field(default="member", max_length=16)  # a TokenRole value
    expires_at: datetime | None = None


class WebSession(SQLModel, table=True):
    """A browser session (server-side): the cookie holds a random id, stored here only as its SHA-256, so
    logging out or revoking the token ends it at once."""

    __tablename__ = "web_sessions"
    __table_args__ = (Index("ix_web_sessions_token", "token_id"),)

    id_hash: str = Field(primary_key=True, max_length=64)
    token_id: int = Field(sa_column=Column(Integer, ForeignKey("api_tokens.id", ondelete="CASCADE"), nullable=False))
    csrf: str = Field(max_length=64)
    created_at: datetime = Field(default_factory=utcnow)
    expires_at: datetime


class LoginLink(SQLModel, table=True):
    """A one-time login URL for a token: single use, short-lived, stored only as the SHA-256 of its code."""

    __tablename__ = "login_links"

    code_hash: str = Field(primary_key=True, max_length=64)
    token_id: int = Field(sa_column=Column(Integer, ForeignKey("api_tokens.id", ondelete="CASCADE"), nullable=False))
    created_at: datetime = Field(default_factory=utcnow)
    expires_at: datetime
    used_at: datetime | None = None


class InstallationSecret(SQLModel, table=True):
    """A secret every process of one installation shares (0008): made once, by whichever process needs it first,
    so that web replicas on different machines sign and check alike (``app/store/tokens.py``)."""

    __tablename__ = "installation_secrets"

    name: str = Field(primary_key=True, max_length=64)  # what it is for: "signing" (API cursors)
    value: str = Field(max_length=128)
    created_at: datetime = Field(default_factory=utcnow)


class AuditEntry(SQLModel, table=True):
    """Who did what to which run or token (kept when the run itself is deleted)."""

    __tablename__ = "audit_log"

    id: int | None = Field(
        default=None,
        sa_column=Column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    )
    time: datetime = Field(default_factory=utcnow)
    actor: str = Field(max_length=100)
    action: str = Field(max_length=32)  # run.cancel, run.resume, run.delete, token.create, token.revoke, ...
    target: str = Field(max_length=200)
    detail: str | None = Field(default=None, sa_column=Column(Text, nullable=True))


class Worker(SQLModel, table=True):
    """A live ``collage worker`` (one GPU slot), refreshed every few seconds; stale rows mean a lost worker."""

    __tablename__ = "workers"

    name: str = Field(primary_key=True, max_length=200)
    hostname: str = Field(max_length=200)
    pid: int
    queues: list[str] = Field(sa_column=Column(JSON, nullable=False))
    gpus: list[int] = Field(sa_column=Column(JSON, nullable=False))
    current_run_id: str | None = Field(default=None, max_length=32)
    started_at: datetime = Field(default_factory=utcnow)
    last_seen: datetime = Field(default_factory=utcnow)
    # per visible GPU: {"index", "name", "memory_total_mb", "memory_used_mb", "utilization"} when known (0006)
    gpu_info: list[dict[str, Any]] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    # per file system holding the worker's home and artifacts: {"paths": {name: path}, "free_bytes", "total_bytes"},
    # measured at its last heartbeat (0011)
    disk_info: list[dict[str, Any]] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    # the run whose attempt has reserved this worker as one of its hosts (resources.nodes > 1), set in the leader's
    # claim with the same conditional update that a claim of this worker's own sets current_run_id by (0013)
    reserved_for: str | None = Field(default=None, max_length=32)
    reserved_attempt: int | None = None


class RunNode(SQLModel, table=True):
    """One host of a run attempt on several hosts (``resources.nodes``): which worker runs it, the rendezvous
    endpoint (the leader's row), and the heartbeat of that host's worker, which every other host watches."""

    __tablename__ = "run_nodes"

    run_id: str = Field(sa_column=Column(String(32), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True))
    attempt: int = Field(primary_key=True)
    rank: int = Field(primary_key=True)  # 0 = the leader, whose worker claimed the run
    worker: str = Field(max_length=200)
    endpoint: str | None = Field(default=None, max_length=300)  # host:port of torchrun's c10d rendezvous (rank 0)
    started_at: datetime | None = None  # when this host's worker started its training processes
    heartbeat_at: datetime = Field(default_factory=utcnow)
    ended_at: datetime | None = None


class MetricRollup(SQLModel, table=True):
    """The minimum and maximum point of a metric within each bucket of ``width`` steps, kept up to date by the
    writer, so that a chart of a long run reads a few hundred rows instead of every step."""

    __tablename__ = "metric_rollups"

    run_id: str = Field(sa_column=Column(String(32), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True))
    key: str = Field(primary_key=True, max_length=100)
    width: int = Field(primary_key=True)
    bucket: int = Field(primary_key=True)
    min_step: int
    min_value: float
    max_step: int
    max_value: float


class Job(SQLModel, table=True):
    """Work a worker does for the dashboard besides training: an export of a checkpoint as a transformers folder
    (``kind`` export) or a playground generation (``kind`` generate). Queued like runs, claimed exactly once by a
    conditional transition, kept alive by a heartbeat, cancellable (0007)."""

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_status", "status", "created_at", "id"),
        Index("ix_jobs_run", "run_id", "created_at"),
    )

    id: str = Field(primary_key=True, max_length=32)
    kind: str = Field(max_length=16)  # a JobKind value
    run_id: str | None = Field(
        default=None, sa_column=Column(String(32), ForeignKey("runs.id", ondelete="CASCADE"), nullable=True)
    )
    queue: str = Field(default="default", max_length=100)
    request: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))  # what was asked, validated
    status: str = Field(default="queued", max_length=16)  # a JobStatus value
    progress: float = 0.0  # 0..1
    message: str | None = Field(default=None, sa_column=Column(Text, nullable=True))  # what it is doing now
    result: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    error: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    worker: str | None = Field(default=None, max_length=200)
    created_by: int | None = Field(
        default=None, sa_column=Column(Integer, ForeignKey("api_tokens.id", ondelete="SET NULL"), nullable=True)
    )
    created_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    heartbeat_at: datetime | None = None


class Upload(SQLModel, table=True):
    """An image a token uploaded (the playground): the image itself is content-addressed in ``images``; this row
    is what counts against the token's quota (0007)."""

    __tablename__ = "uploads"
    __table_args__ = (Index("ix_uploads_token", "token_id", "created_at"),)

    sha256: str = Field(sa_column=Column(String(64), ForeignKey("images.sha256"), primary_key=True))
    token_id: int = Field(sa_column=Column(Integer, ForeignKey("api_tokens.id", ondelete="CASCADE"), primary_key=True))
    bytes: int = Field(sa_column=Column(BigInteger, nullable=False))
    created_at: datetime = Field(default_factory=utcnow)


def table_of(model: type[SQLModel]) -> Table:
    """A table model's Core table (``Model.__table__``, which SQLModel's type hints do not declare)."""
    return model.__table__  # type: ignore[attr-defined]
