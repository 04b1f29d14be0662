"""Evaluation metrics from the scored completions of held-out prompts: pure functions (docs/training.md, Evaluation).

Keys (the contract's): ``eval/reward`` (the weighted sum of every reward, as ``reward``; a completion no reward
applies to is left out), ``eval/rewards/<fn>/mean``, ``eval/completion_length`` (tokens), ``eval/pass@1`` and
``eval/pass@<n>`` (with ``n`` completions per prompt, ``n`` > 1), ``eval/by_images/<k>/reward`` for ``k`` = 0..7
images in the prompt and ``8+``, ``eval/rows`` (held-out prompts evaluated).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

IMAGE_BUCKETS = 8  # by_images: exact counts 0..7, then one bucket "8+"


@dataclass(frozen=True)
class ScoredCompletion:
    """One held-out completion: its prompt (index in the evaluation), each reward (``None``: not applicable)."""

    prompt: int
    index: int  # the completion's index among its prompt's
    rewards: tuple[float | None, ...]  # in the run's reward order
    length: int  # completion tokens
    num_images: int  # images in the prompt


def image_bucket(num_images: int) -> str:
    return str(num_images) if num_images < IMAGE_BUCKETS else f"{IMAGE_BUCKETS}+"


def weighted_reward(rewards: Sequence[float | None], weights: Sequence[float]) -> float | None:
    """The weighted sum of the rewards that apply; ``None`` when none does (as the training reward)."""
    scored = [w * v for w, v in zip(weights, rewards, strict=True) if v is not None and not math.isnan(v)]
    return sum(scored) if scored else None


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of Chen et al. 2021 (HumanEval): the chance that ``k`` of ``n`` completions, ``c`` of
    which pass, hold at least one that passes, ``1 - C(n - c, k) / C(n, k)``. ``k = 1`` is ``c / n``; ``k = n``
    is 1 when any passes."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def eval_metric_keys(
    names: Sequence[str], pass_reward: str | None, num_generations: int, image_counts: Sequence[int]
) -> set[str]:
    """Every key :func:`eval_metrics` logs for these rewards and held-out prompts (``image_counts``: images per
    prompt), for checking ``metric_for_best_model`` before any compute."""
    keys = {"eval/reward", "eval/completion_length", "eval/rows", *(f"eval/rewards/{n}/mean" for n in names)}
    if pass_reward is not None:
        keys |= {f"eval/pass@{k}" for k in pass_ks(num_generations)}
    keys |= {f"eval/by_images/{image_bucket(n)}/reward" for n in image_counts}
    return keys


def pass_ks(num_generations: int) -> list[int]:
    return [1] if num_generations == 1 else [1, num_generations]


def eval_metrics(
    completions: Sequence[ScoredCompletion],
    names: Sequence[str],
    weights: Sequence[float],
    num_generations: int,
    pass_reward: str | None = None,
    pass_threshold: float = 1.0,
) -> dict[str, float]:
    """The evaluation's metrics. ``pass@k`` counts a completion as passing when reward ``pass_reward`` is at least
    ``pass_threshold``; a prompt none of whose completions it applies to (no answer) is left out of it. A mean over
    nothing is NaN."""
    ordered = sorted(completions, key=lambda c: (c.prompt, c.index))  # sums in one order, whatever the gathering
    rewards = [weighted_reward(c.rewards, weights) for c in ordered]
    scored = [r for r in rewards if r is not None]
    metrics: dict[str, float] = {
        "eval/reward": _mean(scored),
        "eval/completion_length": _mean([float(c.length) for c in ordered]),
        "eval/rows": float(len({c.prompt for c in ordered})),
    }
    for k, name in enumerate(names):
        column = [c.rewards[k] for c in ordered]
        metrics[f"eval/rewards/{name}/mean"] = _mean([v for v in column if v is not None and not math.isnan(v)])
    buckets: dict[str, list[float]] = {}
    for c, r in zip(ordered, rewards, strict=True):
        members = buckets.setdefault(image_bucket(c.num_images), [])
        if r is not None:
            members.append(r)
    for bucket, members in buckets.items():
        metrics[f"eval/by_images/{bucket}/reward"] = _mean(members)
    if pass_reward is not None:
        which = list(names).index(pass_reward)
        per_prompt: dict[int, list[float | None]] = {}
        for c in ordered:
            per_prompt.setdefault(c.prompt, []).append(c.rewards[which])
        judged = [
            [v is not None and not math.isnan(v) and v >= pass_threshold for v in values]
            for values in per_prompt.values()
            if any(v is not None and not math.isnan(v) for v in values)
        ]
        for k in pass_ks(num_generations):
            metrics[f"eval/pass@{k}"] = _mean([pass_at_k(len(p), sum(p), k) for p in judged if len(p) >= k])
    return metrics
