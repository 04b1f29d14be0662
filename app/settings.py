"""Settings from the environment (contract: COLLAGE_HOME, COLLAGE_DATABASE_URL, COLLAGE_BROKER_URL,
COLLAGE_ARTIFACTS). Read once per process through :func:`get_settings`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# every variable Settings.from_env reads (docker-compose.yml may set only these)
ENV_VARS = (
    "COLLAGE_HOME",
    "COLLAGE_DATABASE_URL",
    "COLLAGE_BROKER_URL",
    "COLLAGE_ARTIFACTS",
    "COLLAGE_HEARTBEAT_INTERVAL",
    "COLLAGE_HEARTBEAT_TIMEOUT",
    "COLLAGE_CANCEL_GRACE",
)


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    broker_url: str
    artifacts: Path
    max_body_bytes: int = 1_048_576  # request bodies above this are refused (413)
    heartbeat_interval: float = 5.0  # seconds between a running run's heartbeats
    heartbeat_timeout: float = 60.0  # a running run without a heartbeat for this long is marked failed
    cancel_grace: float = 60.0  # seconds a cancelled run may take to checkpoint before it is killed

    @classmethod
    def from_env(cls) -> Settings:
        home = Path(os.environ.get("COLLAGE_HOME") or Path.home() / ".collage").expanduser()
        database_url = os.environ.get("COLLAGE_DATABASE_URL") or f"sqlite:///{home / 'collage.db'}"
        broker_url = os.environ.get("COLLAGE_BROKER_URL") or f"sqla+sqlite:///{home / 'broker.db'}"
        artifacts = Path(os.environ.get("COLLAGE_ARTIFACTS") or home / "artifacts").expanduser()
        return cls(
            home=home,
            database_url=database_url,
            broker_url=broker_url,
            artifacts=artifacts,
            heartbeat_interval=float(os.environ.get("COLLAGE_HEARTBEAT_INTERVAL", 5.0)),
            heartbeat_timeout=float(os.environ.get("COLLAGE_HEARTBEAT_TIMEOUT", 60.0)),
            cancel_grace=float(os.environ.get("COLLAGE_CANCEL_GRACE", 60.0)),
        )


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings.from_env()
