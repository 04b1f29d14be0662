"""What a multi-turn rollout leaves behind: its trajectory as a rollout row shows it, and the step's tool metrics.

Metrics (the contract's keys; under ``eval/`` for an evaluation): ``tools/call_frequency`` (tool calls per
rollout), ``tools/failure_frequency`` (the share of calls that gave a tool error), ``tools/<name>/calls`` (calls of
that tool per rollout), ``turns/mean`` (assistant turns per rollout), ``images/added_mean`` (tool images per
rollout), ``tools/used_fraction`` (rollouts with at least one call), ``tools/capped_fraction`` (rollouts that still
called a tool when the limit ran out), and, per reward, ``tools/with_call/<reward>`` and
``tools/without_call/<reward>``: its mean over rollouts that did and did not call a tool (accuracy with and without
a zoom).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..callbacks import RolloutImage, TrajectoryTurn
from .multiturn import Trajectory

STATS = ("calls", "errors", "turns", "images_added", "capped")


def tool_stats(trajectories: Sequence[Trajectory], tool_names: Sequence[str]) -> torch.Tensor:
    """``(n, len(STATS) + len(tool_names))``: per rollout its counts, then its calls of each named tool."""
    rows = []
    for t in trajectories:
        turns = sum(1 for turn in t.turns if turn.role == "assistant")
        base = [t.tool_calls, t.tool_errors, turns, t.tool_image_count, int(t.capped)]
        rows.append([float(v) for v in base] + [float(t.calls_by_tool.get(n, 0)) for n in tool_names])
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(STATS) + len(tool_names))


def _mean(values: torch.Tensor) -> float:
    return float(values.mean()) if values.numel() else math.nan


def tool_metrics(
    stats: torch.Tensor, tool_names: Sequence[str], rewards: torch.Tensor, reward_names: Sequence[str], prefix: str = ""
) -> dict[str, float]:
    """The metrics of every process's rollouts (``stats`` from :func:`tool_stats`, gathered; ``rewards``: ``(n, R)``
    reward values, NaN where a reward did not apply)."""
    calls, errors = stats[:, 0], stats[:, 1]
    used = calls > 0
    total_calls = float(calls.sum())
    out = {
        f"{prefix}tools/call_frequency": _mean(calls),
        f"{prefix}tools/failure_frequency": float(errors.sum()) / total_calls if total_calls else 0.0,
        f"{prefix}turns/mean": _mean(stats[:, 2]),
        f"{prefix}images/added_mean": _mean(stats[:, 3]),
        f"{prefix}tools/used_fraction": _mean(used.float()),
        f"{prefix}tools/capped_fraction": _mean(stats[:, 4]),
    }
    for k, name in enumerate(tool_names):
        out[f"{prefix}tools/{name}/calls"] = _mean(stats[:, len(STATS) + k])
    for k, name in enumerate(reward_names):
        column = rewards[:, k]
        for key, rows in (("with_call", used), ("without_call", ~used)):
            picked = column[rows.to(column.device)]
            picked = picked[~torch.isnan(picked)]
            out[f"{prefix}tools/{key}/{name}"] = _mean(picked)
    return out


def trajectory_turns(trajectory: Trajectory, image: Callable[[Any], RolloutImage]) -> list[TrajectoryTurn]:
    """The trajectory as a rollout row stores it (``image``: a PIL image to its :class:`RolloutImage`)."""
    out = []
    for turn in trajectory.turns:
        call = turn.tool_call.to_json() if turn.tool_call is not None and not turn.tool_call.error else None
        if turn.tool_call is not None and turn.tool_call.error:
            call = None
        out.append(
            TrajectoryTurn(
                role=turn.role,
                text=turn.text,
                tool_call=call,
                images=[image(im.image) for im in turn.images],
                sources=[im.source for im in turn.images],
                error=turn.error,
            )
        )
    return out


def eval_tool_metrics(rows: Sequence[Any], tool_names: Sequence[str], reward_names: Sequence[str]) -> dict[str, float]:
    """An evaluation's tool metrics (``eval/`` keys) from its gathered rollout rows' trajectories."""
    stats, values = [], []
    for row in rows:
        tool_turns = [t for t in row.trajectory if t.role == "tool"]
        calls = len(tool_turns)
        last = row.trajectory[-1] if row.trajectory else None
        capped = bool(last is not None and last.role == "assistant" and last.tool_call is not None)
        counts = [sum(1 for t in tool_turns if t.tool_call and t.tool_call.get("name") == n) for n in tool_names]
        stats.append([calls, sum(1 for t in tool_turns if t.error is not None),
                      sum(1 for t in row.trajectory if t.role == "assistant"),
                      sum(len(t.images) for t in tool_turns), int(capped), *counts])  # fmt: skip
        values.append([math.nan if row.rewards.get(n) is None else row.rewards[n] for n in reward_names])
    width = len(STATS) + len(tool_names)
    stats_t = torch.tensor(stats, dtype=torch.float32).reshape(len(stats), width)
    values_t = torch.tensor(values, dtype=torch.float32).reshape(len(values), len(reward_names))
    return tool_metrics(stats_t, tool_names, values_t, reward_names, prefix="eval/")
