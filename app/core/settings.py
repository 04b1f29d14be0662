"""Settings from the environment (contract: COLLAGE_HOME, COLLAGE_DATABASE_URL, COLLAGE_BROKER_URL,
COLLAGE_ARTIFACTS). Read once per process through :func:`get_settings`.

The one place in ``collage.app`` that reads configuration from the environment: the operator's (:class:`Settings`)
and the command-line client's (:class:`ClientSettings`). Other modules take a Settings, or pass the environment on
to a child process untouched."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from collage.training.infra.objectstore import (
    CACHE_UNITS,
    CachePruner,
    ObjectMirror,
    is_remote,
    local_cache_root,
    mirror_for,
    retry_for_of,
)

# every variable Settings.from_env reads (docker-compose.yml may set only these)
ENV_VARS = (
    "COLLAGE_HOME",
    "COLLAGE_DATABASE_URL",
    "COLLAGE_BROKER_URL",
    "COLLAGE_ARTIFACTS",
    # object storage (COLLAGE_ARTIFACTS=s3://bucket/prefix; credentials and region: the standard AWS variables)
    "COLLAGE_S3_ENDPOINT_URL",
    "COLLAGE_S3_PRESIGN",
    "COLLAGE_S3_PUBLIC_URL",
    "COLLAGE_S3_RETRY_FOR",
    "COLLAGE_CACHE_MAX_GB",
    "COLLAGE_HEARTBEAT_INTERVAL",
    "COLLAGE_HEARTBEAT_TIMEOUT",
    "COLLAGE_CANCEL_GRACE",
    "COLLAGE_REWARD_MODULES",
    "COLLAGE_TOOL_MODULES",
    "COLLAGE_DATA_ROOTS",
    "COLLAGE_MODEL_ROOTS",
    "COLLAGE_MAX_EXPORTS",
    "COLLAGE_FORWARDED_ALLOW_IPS",
    # the dataset routes' bounds (preview, check)
    "COLLAGE_DATASET_PER_USER",
    "COLLAGE_DATASET_QUEUE",
    "COLLAGE_PREVIEW_TIMEOUT",
    "COLLAGE_CHECK_TIMEOUT",
    "COLLAGE_PREVIEW_MAX_IMAGES",
    "COLLAGE_PREVIEW_MAX_BYTES",
    "COLLAGE_DB_LOCK_TIMEOUT",
    "COLLAGE_TRAIN_NICE",
    "COLLAGE_REQUEUE_AFTER",
    "COLLAGE_MIN_FREE_DISK_MB",
    # the playground (issue 18): uploads and generations
    "COLLAGE_PLAYGROUND_TTL",
    "COLLAGE_PLAYGROUND_TIMEOUT",
    "COLLAGE_PLAYGROUND_PER_USER",
    "COLLAGE_PLAYGROUND_MAX_IMAGES",
    "COLLAGE_PLAYGROUND_MAX_NEW_TOKENS",
    "COLLAGE_UPLOAD_MAX_BYTES",
    "COLLAGE_UPLOAD_MAX_PIXELS",
    "COLLAGE_UPLOAD_QUOTA_MB",
    "COLLAGE_UPLOAD_BUDGET_MB",
    # the dataset helper (app/datasets/process.py), read in the helper process itself
    "COLLAGE_DATA_HELPER_IDLE",
)


def _names(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def _paths(value: str | None) -> tuple[Path, ...]:
    # os.pathsep-separated like PATH (a comma may be part of a folder name)
    return tuple(Path(v).expanduser() for v in (value or "").split(os.pathsep) if v.strip())


def home_from(environ: Mapping[str, str]) -> Path:
    """COLLAGE_HOME as ``environ`` sets it (default ``~/.collage``): also the home of a child given that environment."""
    return Path(environ.get("COLLAGE_HOME") or Path.home() / ".collage").expanduser()


EMBEDDED_TRAIN_NICE = 10


def _nice(value: str | None) -> int | None:
    """COLLAGE_TRAIN_NICE: unset or empty means the default for the kind of worker."""
    if value is None or not value.strip():
        return None
    try:
        nice = int(value)
    except ValueError as exc:
        raise ValueError(f"COLLAGE_TRAIN_NICE: {value!r} is not a whole number (a nice value, 0 to 19)") from exc
    if not 0 <= nice <= 19:
        raise ValueError(f"COLLAGE_TRAIN_NICE: {nice} is out of range (a nice value, 0 to 19)")
    return nice


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    broker_url: str
    # the local artifacts folder; with object storage (artifacts_url s3://...), this host's cache of the bucket
    artifacts: Path
    artifacts_url: str = ""  # COLLAGE_ARTIFACTS as given: s3://bucket/prefix, or the local folder
    s3_endpoint_url: str | None = None  # a server that is not AWS (SeaweedFS, MinIO); None: AWS itself
    # seconds a presigned URL is valid: > 0 redirects image and download requests to the bucket, 0 streams them
    s3_presign: int = 0
    s3_public_url: str | None = None  # the endpoint browsers reach, for presigned URLs (default: s3_endpoint_url)
    s3_retry_for: float = 120.0  # seconds an object-storage call retries an unreachable server before failing
    # seconds a web request waits for the bucket (an image fetched into the cache, a thumbnail) before it answers 503
    s3_request_wait: float = 15.0
    cache_max_gb: float = 20.0  # with object storage: the most this host's cache of the bucket keeps (0: no bound)
    max_body_bytes: int = 1_048_576  # request bodies above this are refused (413)
    heartbeat_interval: float = 5.0  # seconds between a running run's heartbeats
    heartbeat_timeout: float = 60.0  # a running run without a heartbeat for this long is marked failed
    cancel_grace: float = 60.0  # seconds a cancelled run may take to checkpoint before it is killed
    # modules (and their submodules) whose functions API-submitted runs may name as rewards ("module:function")
    reward_modules: tuple[str, ...] = ()
    # modules (and their submodules) whose functions and classes API-submitted runs may name as tools or as the
    # environment ("module:function", "module:Class"); a list of its own, never implied by reward_modules
    tool_modules: tuple[str, ...] = ()
    # local dataset / model folders an API client may name must lie under these (default: COLLAGE_HOME alone)
    data_roots: tuple[Path, ...] = ()
    model_roots: tuple[Path, ...] = ()
    max_exports: int = 4  # concurrent export downloads per web process; more are answered 429
    forwarded_allow_ips: str = "127.0.0.1"  # proxies whose X-Forwarded-Proto/For are believed (uvicorn's option)
    # the dataset routes (GET /datasets/preview, POST /datasets/check): what one web process takes on and what one
    # request may do; beyond the first two, 429 with Retry-After (docs/data.md, Previews)
    dataset_per_user: int = 2  # dataset requests of one token in flight at once (the launch form sends two)
    dataset_queue: int = 8  # dataset requests one web process holds at once, running or waiting for its helper
    preview_timeout: float = 60.0  # seconds a preview may take, waiting included; then its helper work is killed
    check_timeout: float = 600.0  # the same for a check (it reads every row)
    preview_max_images: int = 800  # images one preview decodes (200 rows of four, or 12 rows of the 64-image maximum)
    preview_max_bytes: int = 256 << 20  # bytes of image data one preview reads and decodes
    # seconds a web request waits for a lock on the store (another process's write) before it answers 503
    db_lock_timeout: float = 10.0
    # --- workers and faults (issue 17) ---
    # the training's nice value; None: 10 under `collage serve` (the web app on the same CPUs stays responsive),
    # 0 for `collage worker` (a dedicated training host)
    train_nice: int | None = None
    requeue_after: float = 60.0  # a run queued this long without a message in the broker is sent again
    # seconds a training process may take to start (imports, checkpoint download) before its own heartbeat runs; a
    # process not ready by then is killed and its run fails (docs/workers.md)
    child_start_timeout: float = 3600.0
    # --- runs on several hosts (resources.nodes; docs/scaling.md) ---
    # the address the other hosts of a run reach this worker's host at (torchrun's rendezvous and process group);
    # empty: this host's name
    node_address: str = ""
    rendezvous_port: int = 0  # the port a leading worker's rendezvous listens on; 0: a free one for each run
    min_free_disk_mb: int = 1024  # /health reports a disk (home, artifacts, SQLite store) with less free as low
    # --- the playground (issue 18; docs/playground.md) ---
    # seconds a worker's playground process keeps its model(s) loaded without a request, then exits (memory back)
    playground_ttl: float = 600.0
    playground_timeout: float = 900.0  # seconds one model's load and generation may take; then its process is killed
    playground_per_user: int = 4  # generations one token may have queued or running at once (429 beyond)
    playground_max_images: int = 16  # images one generation's prompt may hold
    playground_max_new_tokens: int = 1024  # the largest max_new_tokens a generation may ask for
    upload_max_bytes: int = 10 << 20  # an uploaded image file above this is refused (413) while it is read
    upload_max_pixels: int = 40_000_000  # an upload whose header announces more pixels is refused before decoding
    upload_quota_mb: int = 200  # megabytes of (re-encoded) uploads one token may keep (429 beyond)
    upload_budget_mb: int = 10240  # megabytes of uploads all tokens together may keep (507 beyond)
    # seconds the dataset helper (the child that answers previews and checks) waits for a request, then exits
    data_helper_idle: float = 600.0

    def training_nice(self, embedded: bool) -> int:
        if self.train_nice is not None:
            return self.train_nice
        return EMBEDDED_TRAIN_NICE if embedded else 0

    @property
    def remote_artifacts(self) -> bool:
        return is_remote(self.artifacts_url)

    def mirror(self) -> ObjectMirror | None:
        """The artifacts' bucket (one client per process), or None when the artifacts are a local folder."""
        return mirror_for(self.artifacts_url, self.s3_endpoint_url, self.s3_retry_for, self.s3_public_url)

    def cache_pruner(self, kinds: tuple[str, ...] = CACHE_UNITS) -> CachePruner | None:
        """The thread that keeps this host's cache of the bucket under ``cache_max_gb`` (None: no bucket, no bound)."""
        if not self.remote_artifacts or self.cache_max_gb <= 0:
            return None
        return CachePruner(self.artifacts, int(self.cache_max_gb * (1 << 30)), kinds)

    def allowed_data_roots(self) -> tuple[Path, ...]:
        return self.data_roots or (self.home,)

    def allowed_model_roots(self) -> tuple[Path, ...]:
        """COLLAGE_MODEL_ROOTS, or where models are kept in COLLAGE_HOME: ``models/`` (the operator's) and
        ``cache/models/`` (tiny models Collage builds). Never COLLAGE_HOME itself: it holds the store, the broker
        and the serve token, none of them a model."""
        return self.model_roots or default_model_roots(self.home)

    @classmethod
    def from_env(cls) -> Settings:
        home = home_from(os.environ)
        database_url = os.environ.get("COLLAGE_DATABASE_URL") or f"sqlite:///{home / 'collage.db'}"
        broker_url = os.environ.get("COLLAGE_BROKER_URL") or f"sqla+sqlite:///{home / 'broker.db'}"
        artifacts_url = os.environ.get("COLLAGE_ARTIFACTS") or str(home / "artifacts")
        if is_remote(artifacts_url):
            artifacts = local_cache_root(home, artifacts_url)  # validates the URL too
        else:
            artifacts = Path(artifacts_url).expanduser()
        return cls(
            home=home,
            database_url=database_url,
            broker_url=broker_url,
            artifacts=artifacts,
            artifacts_url=artifacts_url,
            s3_endpoint_url=os.environ.get("COLLAGE_S3_ENDPOINT_URL") or None,
            s3_presign=int(os.environ.get("COLLAGE_S3_PRESIGN") or 0),
            s3_public_url=os.environ.get("COLLAGE_S3_PUBLIC_URL") or None,
            s3_retry_for=retry_for_of(os.environ),
            s3_request_wait=float(os.environ.get("COLLAGE_S3_REQUEST_WAIT") or 15.0),
            cache_max_gb=float(os.environ.get("COLLAGE_CACHE_MAX_GB") or 20.0),
            heartbeat_interval=float(os.environ.get("COLLAGE_HEARTBEAT_INTERVAL", 5.0)),
            heartbeat_timeout=float(os.environ.get("COLLAGE_HEARTBEAT_TIMEOUT", 60.0)),
            cancel_grace=float(os.environ.get("COLLAGE_CANCEL_GRACE", 60.0)),
            reward_modules=_names(os.environ.get("COLLAGE_REWARD_MODULES")),
            tool_modules=_names(os.environ.get("COLLAGE_TOOL_MODULES")),
            data_roots=_paths(os.environ.get("COLLAGE_DATA_ROOTS")),
            model_roots=_paths(os.environ.get("COLLAGE_MODEL_ROOTS")),
            max_exports=int(os.environ.get("COLLAGE_MAX_EXPORTS", 4)),
            forwarded_allow_ips=os.environ.get("COLLAGE_FORWARDED_ALLOW_IPS", "127.0.0.1"),
            dataset_per_user=int(os.environ.get("COLLAGE_DATASET_PER_USER", 2)),
            dataset_queue=int(os.environ.get("COLLAGE_DATASET_QUEUE", 8)),
            preview_timeout=float(os.environ.get("COLLAGE_PREVIEW_TIMEOUT", 60.0)),
            check_timeout=float(os.environ.get("COLLAGE_CHECK_TIMEOUT", 600.0)),
            preview_max_images=int(os.environ.get("COLLAGE_PREVIEW_MAX_IMAGES", 800)),
            preview_max_bytes=int(os.environ.get("COLLAGE_PREVIEW_MAX_BYTES", 256 << 20)),
            db_lock_timeout=float(os.environ.get("COLLAGE_DB_LOCK_TIMEOUT", 10.0)),
            train_nice=_nice(os.environ.get("COLLAGE_TRAIN_NICE")),
            requeue_after=float(os.environ.get("COLLAGE_REQUEUE_AFTER", 60.0)),
            child_start_timeout=float(os.environ.get("COLLAGE_CHILD_START_TIMEOUT") or 3600.0),
            node_address=os.environ.get("COLLAGE_NODE_ADDRESS", ""),
            rendezvous_port=int(os.environ.get("COLLAGE_RENDEZVOUS_PORT") or 0),
            min_free_disk_mb=int(os.environ.get("COLLAGE_MIN_FREE_DISK_MB", 1024)),
            playground_ttl=float(os.environ.get("COLLAGE_PLAYGROUND_TTL", 600.0)),
            playground_timeout=float(os.environ.get("COLLAGE_PLAYGROUND_TIMEOUT", 900.0)),
            playground_per_user=int(os.environ.get("COLLAGE_PLAYGROUND_PER_USER", 4)),
            playground_max_images=int(os.environ.get("COLLAGE_PLAYGROUND_MAX_IMAGES", 16)),
            playground_max_new_tokens=int(os.environ.get("COLLAGE_PLAYGROUND_MAX_NEW_TOKENS", 1024)),
            upload_max_bytes=int(os.environ.get("COLLAGE_UPLOAD_MAX_BYTES", 10 << 20)),
            upload_max_pixels=int(os.environ.get("COLLAGE_UPLOAD_MAX_PIXELS", 40_000_000)),
            upload_quota_mb=int(os.environ.get("COLLAGE_UPLOAD_QUOTA_MB", 200)),
            upload_budget_mb=int(os.environ.get("COLLAGE_UPLOAD_BUDGET_MB", 10240)),
            data_helper_idle=float(os.environ.get("COLLAGE_DATA_HELPER_IDLE", 600.0)),
        )


def default_model_roots(home: Path) -> tuple[Path, ...]:
    return (home / "models", home / "cache" / "models")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings.from_env()


# the command-line client's variables (`collage runs`, `collage submit`, `collage token link`): the user's, not the
# operator's, so not in ENV_VARS (a deployment never sets them)
CLIENT_ENV_VARS = ("COLLAGE_SERVER", "COLLAGE_TOKEN")


@dataclass(frozen=True)
class ClientSettings:
    """What the command-line client reads from the environment: the server to talk to and the token to send (an
    empty variable counts as unset). Read at each call, never cached: a shell (or a test) may change them between
    two calls in one process."""

    server: str | None = None
    token: str | None = field(default=None, repr=False)  # a secret: never in a log line or a traceback's locals

    @classmethod
    def from_env(cls) -> ClientSettings:
        return cls(server=os.environ.get("COLLAGE_SERVER") or None, token=os.environ.get("COLLAGE_TOKEN") or None)
