"""How a worker turns a run's resources into a training command for its GPU slot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from collage.app.store.tables import Run
from collage.worker.supervisor import Slot, SlotTooSmall, child_command


def _run(gpus: int) -> Run:
    return Run(id="r1", name="n", algorithm="grpo", attempt=3, config={"resources": {"gpus": gpus, "queue": "default"}})


def test_cpu_runs_see_no_gpu():
    cmd, env, warning = child_command(_run(0), Slot(gpus=[0, 1]))
    assert cmd == [sys.executable, "-m", "collage.worker.child", "r1", "3"]  # the run and the attempt it runs
    assert env["CUDA_VISIBLE_DEVICES"] == "" and warning is None


def test_one_gpu_runs_on_the_first_gpu_of_the_slot():
    cmd, env, _ = child_command(_run(1), Slot(gpus=[3, 4]))
    assert cmd[-3:] == ["collage.worker.child", "r1", "3"] and env["CUDA_VISIBLE_DEVICES"] == "3"


def test_several_gpus_run_under_accelerate_launch():
    cmd, env, _ = child_command(_run(2), Slot(gpus=[2, 5]))
    # under collage.worker.launch, which dies with its worker before it runs accelerate's launcher
    assert cmd[:4] == [sys.executable, "-m", "collage.worker.launch", "accelerate.commands.launch"]
    assert cmd[cmd.index("--num_processes") + 1] == "2" and "--multi_gpu" in cmd
    assert cmd[-4:] == ["-m", "collage.worker.child", "r1", "3"] and env["CUDA_VISIBLE_DEVICES"] == "2,5"


def test_a_slot_too_small_is_a_clear_error():
    with pytest.raises(SlotTooSmall, match="needs 4 GPUs but this worker's slot has 2"):
        child_command(_run(4), Slot(gpus=[0, 1]))


def test_a_gpu_run_on_a_cpu_worker_trains_on_cpu_with_a_warning():
    cmd, env, warning = child_command(_run(1), Slot(gpus=[]))
    assert env["CUDA_VISIBLE_DEVICES"] == "" and "no GPU slot: training on the CPU" in warning


def test_the_training_nice_value_defaults_by_kind_of_worker():
    """(The child running at it, autogroup included, is checked with real processes in test_shutdown.)"""
    from collage.app.core.settings import Settings

    settings = Settings(home=Path("/h"), database_url="sqlite://", broker_url="memory://", artifacts=Path("/a"))
    assert settings.training_nice(embedded=True) == 10, "under collage serve the web app keeps its CPU share"
    assert settings.training_nice(embedded=False) == 0, "collage worker: a training host of its own"
    pinned = Settings(home=Path("/h"), database_url="sqlite://", broker_url="memory://", artifacts=Path("/a"),
                      train_nice=3)  # fmt: skip
    assert pinned.training_nice(embedded=True) == pinned.training_nice(embedded=False) == 3


def test_cpu_processes_run_under_accelerate_launch_with_no_gpu_visible():
    run = Run(id="r1", name="n", algorithm="grpo", attempt=1, config={"resources": {"gpus": 0, "processes": 3}})
    cmd, env, warning = child_command(run, Slot(gpus=[0, 1]))
    assert cmd[:4] == [sys.executable, "-m", "collage.worker.launch", "accelerate.commands.launch"]
    assert "--multi_gpu" in cmd
    assert cmd[cmd.index("--num_processes") + 1] == "3" and cmd[-4:] == ["-m", "collage.worker.child", "r1", "1"]
    assert env["CUDA_VISIBLE_DEVICES"] == "" and warning is None


def test_processes_of_a_gpu_run_must_be_one_per_gpu():
    from collage.training.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="one process per GPU"):
        parse_config({"resources": {"gpus": 2, "processes": 4}})
    assert parse_config({"resources": {"gpus": 2, "processes": 2}}).resources.world_size == 2
    assert parse_config({"resources": {"gpus": 0, "processes": 4}}).resources.world_size == 4
    assert parse_config({"resources": {"gpus": 0}}).resources.world_size == 1


def test_a_host_of_a_run_on_several_hosts_runs_torchrun_at_the_leader_s_rendezvous():
    from collage.app.store.nodes import Node

    run = Run(id="r1", name="n", algorithm="grpo", attempt=2, config={"resources": {"gpus": 2, "nodes": 3}})
    leader, _, _ = child_command(run, Slot(gpus=[4, 5]), Node(rank=0, nodes=3, endpoint="h0:29500"), "10.0.0.1")
    follower, env, _ = child_command(run, Slot(gpus=[0, 1]), Node(rank=2, nodes=3, endpoint="h0:29500"), "10.0.0.3")
    assert leader[:4] == [sys.executable, "-m", "collage.worker.launch", "torch.distributed.run"]

    def option(cmd, name):
        return cmd[cmd.index(name) + 1]

    for cmd in (leader, follower):
        assert option(cmd, "--nnodes") == "3" and option(cmd, "--nproc-per-node") == "2"
        assert option(cmd, "--rdzv-backend") == "c10d" and option(cmd, "--rdzv-endpoint") == "h0:29500"
        assert option(cmd, "--rdzv-id") == "r1-2" and option(cmd, "--max-restarts") == "0"
        assert cmd[-4:] == ["-m", "collage.worker.child", "r1", "2"]
    # only the leader's torchrun hosts the rendezvous store; each host names the address the others reach it at
    assert option(leader, "--rdzv-conf") == "is_host=1" and option(follower, "--rdzv-conf") == "is_host=0"
    assert option(leader, "--local-addr") == "10.0.0.1" and option(follower, "--local-addr") == "10.0.0.3"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    cpu = Run(id="r1", name="n", algorithm="grpo", attempt=1, config={"resources": {"gpus": 0, "nodes": 2}})
    cmd, env, _ = child_command(cpu, Slot(gpus=[]), Node(rank=1, nodes=2, endpoint="h0:1"), "")
    assert option(cmd, "--nproc-per-node") == "1" and env["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(SlotTooSmall, match="no GPU"):
        child_command(run, Slot(gpus=[]), Node(rank=1, nodes=3, endpoint="h0:1"), "")


def test_fsdp_across_hosts_is_refused_at_the_config():
    from collage.training.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="nodes: a run on 2 hosts trains with strategy: ddp"):
        parse_config({"resources": {"gpus": 2, "nodes": 2, "strategy": "fsdp"}})
    assert parse_config({"resources": {"gpus": 0, "processes": 2, "nodes": 3}}).resources.world_size == 6
