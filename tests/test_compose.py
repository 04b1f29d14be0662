"""docker-compose.yml and the Dockerfile, checked by parsing (no Docker engine on the test machines)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_ENV = {"COLLAGE_HOME", "COLLAGE_DATABASE_URL", "COLLAGE_BROKER_URL", "COLLAGE_ARTIFACTS",
                "COLLAGE_HEARTBEAT_INTERVAL", "COLLAGE_HEARTBEAT_TIMEOUT", "COLLAGE_CANCEL_GRACE"}  # fmt: skip


def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_and_healthchecks():
    services = compose()["services"]
    assert {"redis", "postgres", "web", "worker-gpu0"} <= set(services)
    for name in ("redis", "postgres", "web"):
        assert services[name]["healthcheck"]["test"], name
    assert services["web"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["web"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["worker-gpu0"]["depends_on"]["web"]["condition"] == "service_healthy"


def test_the_environment_names_match_the_settings():
    settings_source = (ROOT / "app" / "settings.py").read_text()
    read = set(re.findall(r'"(COLLAGE_[A-Z_]+)"', settings_source))
    assert read == SETTINGS_ENV, "the list above must follow app/settings.py"
    services = compose()["services"]
    for name in ("web", "worker-gpu0"):
        env = services[name]["environment"]
        assert set(env) <= read, set(env) - read
        assert (
            env["COLLAGE_DATABASE_URL"].startswith("postgresql://") and "@postgres:5432/" in env["COLLAGE_DATABASE_URL"]
        )
        assert env["COLLAGE_BROKER_URL"] == "redis://redis:6379/0"


def test_volumes_and_gpu_reservation():
    doc = compose()
    services = doc["services"]
    assert "postgres-data:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert set(doc["volumes"]) >= {"postgres-data", "redis-data", "artifacts"}
    devices = services["worker-gpu0"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert services["worker-gpu0"]["command"][:2] == ["collage", "worker"]
    assert "--gpus" in services["worker-gpu0"]["command"]
    assert services["web"]["command"][:2] == ["collage", "serve"] and "--workers" in services["web"]["command"]


def test_commands_exist_in_the_cli():
    from app.cli import build_parser

    parser = build_parser()
    for name in ("web", "worker-gpu0"):
        argv = compose()["services"][name]["command"][1:]
        args = parser.parse_args(argv)
        assert callable(args.func)


def test_dockerfile_copies_every_package_and_installs_it():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for folder in ("app", "worker", "training", "templates", "migrations"):
        assert f"COPY {folder} ./{folder}" in dockerfile
    assert "pip install --no-cache-dir -e ." in dockerfile and 'CMD ["collage", "serve"' in dockerfile
