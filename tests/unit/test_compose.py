"""docker-compose.yml, the Dockerfile and the nginx config of the `replicas` profile, checked by parsing them and
running what they would run (no Docker engine on the test machines): the compose environment through Settings, the
service commands through the CLI's parser, the Dockerfile's install step against the wheel's extras, the proxy's
routes against the app's own."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx" / "collage.conf"
# read by boto3 itself on the web nodes and the workers (and by SeaweedFS for its admin identity), not by Settings
AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
WEB_REPLICAS = ("web-a", "web-b")


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


def with_defaults(value) -> str:
    """A compose value as compose would set it when none of its ${VAR:-default} variables is set."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", str(value))


def web_nodes(services) -> list[str]:
    return [name for name in services if name == "web" or name in WEB_REPLICAS]


def workers(services) -> list[str]:
    return [name for name, service in services.items() if service.get("command", [None, None])[1:2] == ["worker"]]


def mounts(service) -> list[tuple[str, str, bool]]:
    """A service's volumes as (source, target, read-only)."""
    out = []
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        out.append((source, target, "ro" in mode))
    return out


def test_services_and_healthchecks():
    services = compose()["services"]
    assert {"redis", "postgres", "s3", "web", "worker-gpu0"} <= set(services)
    for name in ("redis", "postgres", "s3", "web"):
        assert services[name]["healthcheck"]["test"], name
    assert services["web"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["web"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["worker-gpu0"]["depends_on"]["web"]["condition"] == "service_healthy"
    for name in ("web", *workers(services)):  # the replicas wait for web, which waits for s3
        assert services[name]["depends_on"]["s3"]["condition"] == "service_healthy", name


def test_the_s3_service_is_seaweedfs_with_a_healthcheck_and_the_clients_credentials():
    services = compose()["services"]
    s3 = services["s3"]
    assert s3["image"].split(":")[0] == "chrislusf/seaweedfs"
    assert s3["command"][0] == "server" and "-s3" in s3["command"], "master, volume, filer and the S3 gateway"
    assert any(v.startswith("s3-data:/data") for v in s3["volumes"]), "its objects outlive the container"
    check = " ".join(s3["healthcheck"]["test"])
    assert ":8333/" in check and ("wget" in check or "curl" in check), check
    assert "ports" not in s3, "only the web nodes and the workers reach it"
    for name in ("web", *workers(services)):
        assert "s3" in services[name]["build"]["args"]["EXTRAS"].split(","), f"{name} needs boto3 (the s3 extra)"
    for name in [*web_nodes(services), *workers(services)]:
        env = services[name]["environment"]
        assert env["COLLAGE_S3_ENDPOINT_URL"] == "http://s3:8333", name
        assert env["COLLAGE_ARTIFACTS"].startswith("s3://"), name
        # S3 is not published, so a presigned URL (http://s3:8333/...) would be useless to a browser
        assert str(env["COLLAGE_S3_PRESIGN"]) == "0", name
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[key] == s3["environment"][key] and env[key].startswith("${"), (name, key)


@pytest.mark.parametrize("service", ["web", "worker-gpu0", *WEB_REPLICAS])
def test_the_compose_environment_is_what_settings_read(service, monkeypatch):
    from collage.app.core.settings import ENV_VARS, Settings

    assert {"COLLAGE_ARTIFACTS", "COLLAGE_S3_ENDPOINT_URL", "COLLAGE_S3_PRESIGN"} <= set(ENV_VARS)
    env = compose()["services"][service]["environment"]
    assert set(env) <= set(ENV_VARS) | set(AWS_VARS), set(env) - set(ENV_VARS) - set(AWS_VARS)
    for key in (*ENV_VARS, *AWS_VARS):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, with_defaults(value))
    settings = Settings.from_env()
    assert settings.home == Path("/home-worker" if service.startswith("worker") else "/home-web")
    # the artifacts are the bucket; this container's disk holds only its cache of them, under its own home
    assert settings.artifacts_url == "s3://collage/artifacts" and settings.remote_artifacts
    assert settings.s3_endpoint_url == "http://s3:8333" and settings.s3_presign == 0
    assert settings.artifacts.is_relative_to(settings.home), settings.artifacts
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
    assert set(doc["volumes"]) >= {"postgres-data", "redis-data", "s3-data"}
    assert "artifacts" not in doc["volumes"], "the artifacts are in the bucket, not a shared volume"
    for name, service in services.items():
        assert all(target != "/artifacts" for _, target, _ in mounts(service)), name


def test_no_volume_is_shared_between_a_web_node_and_a_worker():
    """Hosts share nothing but the store, the broker and the bucket: no volume a web node writes is mounted in a
    worker. The read-only datasets and models are the only exception: inputs each host has its own copy of (on one
    machine, one volume), at the paths COLLAGE_DATA_ROOTS and COLLAGE_MODEL_ROOTS name on both sides."""
    services = compose()["services"]
    assert web_nodes(services) and workers(services)
    for web in web_nodes(services):
        for worker in workers(services):
            web_mounts, worker_mounts = mounts(services[web]), mounts(services[worker])
            shared = {source for source, _, _ in web_mounts} & {source for source, _, _ in worker_mounts}
            for source, target, read_only in [*web_mounts, *worker_mounts]:
                if source in shared:
                    assert read_only, f"{source} is shared by {web} and {worker} and writable"
                    roots = (
                        services[web]["environment"]["COLLAGE_DATA_ROOTS"],
                        services[web]["environment"]["COLLAGE_MODEL_ROOTS"],
                    )
                    assert target in roots, f"{source} ({target}) is shared by {web} and {worker}"
    devices = services["worker-gpu0"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]


def test_service_commands_parse_and_match_their_roles():
    from collage.app.cli.main import build_parser

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
    assert chosen["web"] == default, f"the plain `docker build` is the web image: Dockerfile ARG EXTRAS={default}"
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


def nginx_blocks(text: str) -> list:
    """nginx's configuration as nested (directive, args, children) tuples; children is None for a simple
    directive. Enough for this file: comments, quoted strings, blocks."""
    tokens = re.findall(r'"[^"]*"|[{};]|[^\s{};"]+', re.sub(r"#[^\n]*", "", text))

    def parse(i: int) -> tuple[list, int]:
        out, words = [], []
        while i < len(tokens):
            token = tokens[i]
            i += 1
            if token == ";":
                out.append((words[0], words[1:], None))
                words = []
            elif token == "{":
                children, i = parse(i)
                out.append((words[0], words[1:], children))
                words = []
            elif token == "}":
                assert not words, words
                return out, i
            else:
                words.append(token.strip('"'))
        assert not words, words
        return out, i

    blocks, _ = parse(0)
    return blocks


def directives(blocks, name: str) -> list:
    return [b for b in blocks if b[0] == name]


def test_the_replicas_profile_runs_two_web_replicas_of_the_same_image_and_command():
    from collage.app.cli.main import build_parser

    services = compose()["services"]
    profiled = {name for name, service in services.items() if "replicas" in service.get("profiles", [])}
    assert profiled == {*WEB_REPLICAS, "proxy"}
    assert all("profiles" not in services[name] for name in ("redis", "postgres", "s3", "web", "worker-gpu0"))
    web = services["web"]
    web_home = next(s for s, t, _ in mounts(web) if t == web["environment"]["COLLAGE_HOME"])
    for name in WEB_REPLICAS:
        replica = services[name]
        assert replica["image"] == web["image"] and replica["build"] == web["build"], name
        assert replica["command"] == web["command"], name
        args = build_parser().parse_args(replica["command"][1:])
        assert args.command == "serve" and args.workers == 0 and args.host == "0.0.0.0", name
        assert replica["healthcheck"]["test"], name
        # `collage serve` applies migrations at start: the replicas start once `web` is healthy (migrated), so theirs
        # find the store at the newest revision and change nothing
        assert replica["depends_on"]["web"]["condition"] == "service_healthy", name
        # web's token file: a `collage serve` that finds none revokes the live serve token and makes its own
        home = replica["environment"]["COLLAGE_HOME"]
        assert (web_home, home, False) in mounts(replica), f"{name} does not share web's home"
        assert "ports" not in replica, f"{name} is reached through the proxy only"
        assert replica["environment"]["COLLAGE_FORWARDED_ALLOW_IPS"] not in ("", "127.0.0.1"), "the proxy is trusted"


def test_the_proxy_mounts_its_config_read_only_and_waits_for_the_replicas():
    services = compose()["services"]
    proxy = services["proxy"]
    assert proxy["image"].split(":")[0] == "nginx"
    (config,) = [m for m in mounts(proxy) if m[1].startswith("/etc/nginx/")]
    source, target, read_only = config
    assert read_only and target.endswith(".conf")
    assert (ROOT / source).resolve() == NGINX_CONF, source
    assert NGINX_CONF.is_file()
    for name in WEB_REPLICAS:
        assert proxy["depends_on"][name]["condition"] == "service_healthy", name
    (port,) = proxy["ports"]
    assert with_defaults(port).startswith("127.0.0.1:"), "published on loopback unless COLLAGE_BIND says otherwise"
    assert proxy["healthcheck"]["test"]


def nginx_server() -> tuple[list, list]:
    blocks = nginx_blocks(NGINX_CONF.read_text())
    (server,) = directives(blocks, "server")
    return blocks, server[2]


def test_the_proxy_round_robins_over_both_replicas():
    blocks, server = nginx_server()
    (upstream,) = directives(blocks, "upstream")
    servers = [args[0] for _, args, _ in directives(upstream[2], "server")]
    assert sorted(servers) == sorted(f"{name}:8000" for name in WEB_REPLICAS)
    for balancing in ("ip_hash", "hash", "sticky", "least_conn", "random"):
        assert not directives(upstream[2], balancing), f"{balancing}: round-robin needs none"
    locations = directives(server, "location")
    assert locations and any(args == ["/"] for _, args, _ in locations)
    for _, args, children in locations:
        assert [a for _, a, _ in directives(children, "proxy_pass")] == [[f"http://{upstream[1][0]}"]], args
    (listen,) = directives(server, "listen")
    assert listen[1][0].endswith(compose()["services"]["proxy"]["ports"][0].rsplit(":", 1)[1])


def test_the_proxy_passes_the_forwarded_headers_and_the_browsers_host():
    _, server = nginx_server()
    headers = {args[0].lower(): args[1] for _, args, _ in directives(server, "proxy_set_header")}
    assert headers["x-forwarded-for"] == "$proxy_add_x_forwarded_for"
    assert headers["x-forwarded-proto"].startswith("$")
    # with its port: a form post's Origin (http://127.0.0.1:8080) is compared with it; $host would drop the port
    assert headers["host"] == "$http_host"
    for _, args, children in directives(server, "location"):  # a location that sets any header drops these
        assert not directives(children, "proxy_set_header"), args


def location_for(server, path: str):
    """The location nginx picks for ``path``: the first regex location that matches, else the longest prefix."""
    for _, args, children in directives(server, "location"):
        if args[0] == "~" and re.search(args[1], path):
            return children
    prefixes = [(args[0], children) for _, args, children in directives(server, "location") if len(args) == 1]
    return max((p for p in prefixes if path.startswith(p[0])), key=lambda p: len(p[0]))[1]


def example_path(route: str) -> str:
    from collage.app.main import API

    return API + re.sub(r"\{[^}]+\}", "x1", route)


def test_the_run_stream_and_downloads_are_not_buffered_by_the_proxy():
    from collage.app.routers import checkpoints, exports, runs, samples

    (stream,) = [r.path for r in runs.router.routes if r.path.endswith("/stream")]
    children = location_for(nginx_server()[1], example_path(stream))
    assert [args for _, args, _ in directives(children, "proxy_buffering")] == [["off"]], stream
    (timeout,) = directives(children, "proxy_read_timeout")
    assert timeout[1][0].endswith(("m", "h")), "a queued run's stream is silent for longer than nginx's 60 s"
    downloads = [r.path for m in (checkpoints, exports) for r in m.router.routes if r.path.endswith("/download")]
    downloads += [r.path for r in samples.router.routes if r.path.endswith("/export")]
    assert len(downloads) == 3
    for route in downloads:
        children = location_for(nginx_server()[1], example_path(route))
        assert [args for _, args, _ in directives(children, "proxy_buffering")] == [["off"]], route
    assert not directives(location_for(nginx_server()[1], example_path("/runs")), "proxy_buffering")


def test_the_proxy_takes_the_largest_upload_the_app_takes():
    from collage.app.core.settings import Settings
    from collage.app.routers.playground import upload_body_limit

    _, server = nginx_server()
    (size,) = directives(server, "client_max_body_size")
    number, unit = re.fullmatch(r"(\d+)([kKmMgG]?)", size[1][0]).groups()
    allowed = int(number) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit.lower()]
    settings = Settings(home=Path("/h"), database_url="sqlite://", broker_url="memory://", artifacts=Path("/a"))
    largest = max([settings.max_body_bytes, *upload_body_limit(settings).values()])
    # at least the app's largest (so the app answers its own 413s), and not far above it
    assert largest <= allowed <= 2 * largest, (allowed, largest)
