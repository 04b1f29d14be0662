"""docker-compose.yml and the Dockerfile, checked by parsing them and running what they would run (no Docker
engine on the test machines): the compose environment through Settings, the service commands through the
CLI's parser, the Dockerfile's install step against the wheel's extras."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]


def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_services_and_healthchecks():
    services = compose()["services"]
    assert {"redis", "postgres", "web", "worker-gpu0"} <= set(services)
    for name in ("redis", "postgres", "web"):
        assert services[name]["healthcheck"]["test"], name
    assert services["web"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["web"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["worker-gpu0"]["depends_on"]["web"]["condition"] == "service_healthy"


@pytest.mark.parametrize("service", ["web", "worker-gpu0"])
def test_the_compose_environment_is_what_settings_read(service, monkeypatch):
    from collage.app.settings import ENV_VARS, Settings

    env = compose()["services"][service]["environment"]
    assert set(env) <= set(ENV_VARS), set(env) - set(ENV_VARS)
    for key in ENV_VARS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", str(value)))  # compose's defaults
    settings = Settings.from_env()
    assert settings.home == Path("/home-web" if service == "web" else "/home-worker")
    assert settings.artifacts == Path("/artifacts")
    assert settings.allowed_data_roots() == (Path("/datasets"),) and settings.allowed_model_roots() == (
        Path("/models"),
    )
    assert settings.database_url == "postgresql://collage:collage@postgres:5432/collage"
    assert settings.broker_url == "redis://redis:6379/0"
    assert settings.heartbeat_timeout == float(env["COLLAGE_HEARTBEAT_TIMEOUT"])


def test_volumes_and_gpu_reservation():
    doc = compose()
    services = doc["services"]
    assert "postgres-data:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert set(doc["volumes"]) >= {"postgres-data", "redis-data", "artifacts"}
    devices = services["worker-gpu0"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]


def test_service_commands_parse_and_match_their_roles():
    from collage.app.cli import build_parser

    parser = build_parser()
    services = compose()["services"]
    web = parser.parse_args(services["web"]["command"][1:])
    assert services["web"]["command"][0] == "collage" and web.command == "serve" and web.workers == 0
    worker = parser.parse_args(services["worker-gpu0"]["command"][1:])
    assert worker.command == "worker" and worker.gpus == "0"
    cmd = [i for i, a in dockerfile() if i == "CMD"]
    assert cmd, "the image has a default command"


def test_each_image_installs_the_wheel_with_the_extras_of_its_role():
    """The web image installs no torch (web extra only); the worker image installs the worker extra."""
    steps = dockerfile()
    installs = [a for i, a in steps if i == "RUN" and "pip install" in a]
    assert len(installs) == 1 and "-e" not in shlex.split(installs[0]), "the image installs the built wheel"
    assert ".whl)[${EXTRAS}]" in installs[0]
    wheel_build = [a for i, a in steps if i == "RUN" and "pip wheel" in a]
    assert wheel_build and "--no-deps" in wheel_build[0]
    default = next(a for i, a in steps if i == "ARG" and a.startswith("EXTRAS=")).split("=", 1)[1]
    known = extras()
    services = compose()["services"]
    chosen = {name: services[name]["build"]["args"]["EXTRAS"] for name in ("web", "worker-gpu0")}
    assert chosen["web"] == default, "the plain `docker build` is the web image"
    for name, value in chosen.items():
        assert set(value.split(",")) <= set(known), (name, value)
    assert "worker" not in chosen["web"].split(",") and "all" not in chosen["web"].split(",")
    torchy = [d for d in known["worker"] if d.startswith(("torch", "transformers"))]
    assert torchy and not any(d.startswith(("torch", "transformers")) for d in known["web"])
    assert "worker" in chosen["worker-gpu0"].split(",")


def test_the_image_copies_every_package_folder_and_runs_as_a_user():
    steps = dockerfile()
    copied = {a.split()[0] for i, a in steps if i == "COPY" and not a.startswith("--from")}
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert set(package_dirs.values()) <= copied, set(package_dirs.values()) - copied
    for source in copied:
        assert (ROOT / source).exists(), source
    users = [a for i, a in steps if i == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_the_web_port_is_local_and_workers_never_see_the_web_nodes_secrets():
    services = compose()["services"]
    (port,) = services["web"]["ports"]
    published = re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", port)
    assert published == "127.0.0.1:8000:8000", "published on loopback unless COLLAGE_BIND says otherwise"
    web_home = services["web"]["environment"]["COLLAGE_HOME"]
    web_volume = next(v.split(":")[0] for v in services["web"]["volumes"] if v.split(":")[1] == web_home)
    worker = services["worker-gpu0"]
    assert worker["environment"]["COLLAGE_HOME"] != web_home
    assert not any(v.split(":")[0] == web_volume for v in worker["volumes"]), "no token or secret in workers"
    assert worker["user"].split(":")[0] not in ("0", "root")
    # code and paths: the web node and the workers must enforce the same allowlist and roots
    for key in ("COLLAGE_REWARD_MODULES", "COLLAGE_DATA_ROOTS", "COLLAGE_MODEL_ROOTS"):
        assert services["web"]["environment"][key] == worker["environment"][key], key
    for mount in ("/datasets", "/models"):
        assert any(v.endswith(f":{mount}:ro") for v in worker["volumes"]), mount
