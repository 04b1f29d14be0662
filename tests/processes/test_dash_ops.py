"""Operations (issue 13) with real processes: a worker's GPU probe reads a stand-in nvidia-smi and never fails, the
dataset helper process starts again after dying and after freezing (a timeout), and the client's values reach it as data
(JSON fields of a request, on SQLite and PostgreSQL), never as arguments."""

from __future__ import annotations

import os
import signal
import stat
import sys

import pytest

from collage.worker.registry import probe_gpus
from tests.support import API


def test_gpu_probe_reads_nvidia_smi_for_the_slot_and_never_fails(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '0, Tesla T4, 15360, 100, 5'\necho '1, Tesla T4, 15360, 9000, 88'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert probe_gpus([1]) == [
        {"index": 1, "name": "Tesla T4", "memory_total_mb": 15360, "memory_used_mb": 9000, "utilization": 88}
    ]
    assert probe_gpus([]) is None  # a CPU-only worker reports none
    fake.write_text("#!/bin/sh\nexit 9\n")  # a broken driver: no info, no exception
    assert probe_gpus([0]) is None or sys.modules.get("torch") is not None


def test_dataset_helper_restarts_after_dying_and_after_a_timeout(tmp_path):
    from fastapi import HTTPException

    from collage.app.routers.datasets import DataHelper

    (tmp_path / "train.jsonl").write_text('{"prompt": "hello"}\n{"prompt": 3}\n')
    env = {**os.environ, "COLLAGE_DATA_HELPER_IDLE": "60"}
    helper = DataHelper(env)
    job = {
        "op": "preview",
        "source": str(tmp_path),
        "rows": 5,
        "artifacts": str(tmp_path / "art"),
        "data_roots": [str(tmp_path)],  # the helper believes only the roots the web process sends
    }
    try:
        first = helper.call(job)
        assert first["ok"] and [r["row"] for r in first["result"]["rows"]] == [0, 1]
        assert first["result"]["rows"][1]["error"] and first["result"]["total_rows"] == 2
        pid = helper.proc.pid
        helper.proc.kill()
        helper.proc.wait()
        again = helper.call(job)  # a helper that died (or exited idle) is started again
        assert again == first and helper.proc.pid != pid
        missing = helper.call({**job, "source": str(tmp_path / "nope")})
        assert missing["ok"] is False and "does not exist" in missing["error"]
        os.kill(helper.proc.pid, signal.SIGSTOP)  # a frozen helper: it reads the request and never answers
        with pytest.raises(HTTPException) as timed_out:
            helper.call(job, timeout=1)
        assert timed_out.value.status_code == 504 and "longer than 1s" in timed_out.value.detail
        assert helper.proc is None  # killed; the next request starts a fresh helper
        assert helper.call(job) == first
    finally:
        helper.close()


def test_client_values_reach_the_helper_as_data_never_as_arguments(api, tmp_path, monkeypatch):
    """The dataset helper's command line is fixed; the client's values travel as JSON fields of a request, so an
    option-like source (``-h.jsonl``) is a file name, and the child runs in an empty folder."""
    import json

    from collage.app.routers import datasets

    client, _, _, _ = api
    jobs: list[dict] = []
    real = datasets.DataHelper.call
    monkeypatch.setattr(datasets.DataHelper, "call", lambda self, job, timeout=600: jobs.append(job) or real(self, job))
    (tmp_path / "-h.jsonl").write_text(json.dumps({"prompt": "dash"}) + "\n")
    source = str(tmp_path / "-h.jsonl")
    preview = client.get(API + "/datasets/preview", params={"source": source})
    assert preview.status_code == 200 and preview.json()["rows"][0]["prompt"][0]["content"][-1]["text"] == "dash"
    check = client.post(API + "/datasets/check", json={"source": source, "split": "validation"})
    assert check.status_code == 200 and check.json()["rows"] == 1, check.text  # a file has one split
    assert [(j["op"], j["source"], j["split"]) for j in jobs] == [
        ("preview", source, "train"),
        ("check", source, "validation"),
    ]
    helper = datasets.data_helper()
    assert helper.proc.args == [sys.executable, "-m", "collage.app.datasets.process"]
    assert os.listdir(helper.folder) == [] and helper.folder != os.getcwd()
