"""Operations (issue 13) without a server: nvidia-smi's lines become a worker's GPU info, and the launch form's GPU
default is what the live workers of the default queue have."""

from __future__ import annotations

from collage.app.web.fields import form_fields, gpus_default
from collage.worker.registry import parse_nvidia_smi


def test_nvidia_smi_lines_become_gpu_info():
    out = "0, NVIDIA H100 80GB HBM3, 81559, 1024, 37\n1, NVIDIA A10, 23028, [N/A], [Not Supported]\ngarbage\n"
    assert parse_nvidia_smi(out) == [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_mb": 81559, "memory_used_mb": 1024,
         "utilization": 37},
        {"index": 1, "name": "NVIDIA A10", "memory_total_mb": 23028, "memory_used_mb": None, "utilization": None},
    ]  # fmt: skip


def test_gpus_default_is_what_the_live_workers_have():
    cpu = {"queues": ["default"], "gpu_slots": []}
    one = {"queues": ["default"], "gpu_slots": [0]}
    two = {"queues": ["default"], "gpu_slots": [1, 2]}
    big = {"queues": ["big"], "gpu_slots": [0, 1, 2, 3]}
    assert gpus_default([]) is None
    assert gpus_default([cpu]) == 0
    assert gpus_default([two, one]) == 1  # the fewest: the run must fit whichever worker takes it
    assert gpus_default([two, big]) == 2  # other queues' workers do not count
    assert gpus_default([big]) == 4  # ... unless nobody serves the default queue
    field = next(f for f in form_fields(gpus=0) if f.path == "resources.gpus")
    assert field.default == 0
    assert next(f for f in form_fields() if f.path == "resources.gpus").default == 1
