"""Micro-batches that hold whole groups of similar length: less padding, and each prompt computed once.

The trainer shuffles a generation batch before cutting it into micro-batches (TRL's schedule), which spreads a
group's rows, and rows of very different lengths, over many micro-batches: each micro-batch is then padded to its
longest prompt and completion, and the shared-prompt forward (:mod:`training.batching.prefix`) finds few rows of
one prompt together. :func:`bucket_rows` re-orders rows only *within* each block of micro-batches that always
falls into one optimizer step, so every optimizer step still sees exactly the rows TRL's shuffle gave it; the
loss is unchanged wherever its normaliser does not depend on which rows share a micro-batch (see
:func:`composition_invariant`).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd


def block_micro_batches(gradient_accumulation_steps: int, generation_steps: int) -> int:
    """How many consecutive micro-batches (aligned) always belong to one optimizer step: an optimizer step takes
    ``gradient_accumulation_steps`` consecutive micro-batches, cycling through the ``generation_steps`` of a
    generation batch, so aligned runs of their greatest common divisor never straddle two steps."""
    return gcd(gradient_accumulation_steps, generation_steps)


def bucket_rows(
    order: Sequence[int],
    prompt_lengths: Sequence[int],
    groups: Sequence[int],
    completion_lengths: Sequence[int],
    block: int,
) -> list[int]:
    """``order`` (a shuffle of row indices) re-ordered within each run of ``block`` positions: by prompt length,
    then group, then completion length, so that a group's rows sit together and micro-batches cut from the result
    hold rows of similar length. The set of rows in every block is unchanged."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    out: list[int] = []
    for lo in range(0, len(order), block):
        chunk = order[lo : lo + block]
        out.extend(sorted(chunk, key=lambda i: (prompt_lengths[i], groups[i], completion_lengths[i], i)))
    return out


def composition_invariant(algorithm: str, loss_type: str, entropy_coef: float, top_entropy_quantile: float) -> bool:
    """Whether the summed loss of an optimizer step is the same however its rows are cut into micro-batches of
    equal size: not for ``bnpo`` (normalised by each micro-batch's tokens), the entropy bonus (each micro-batch's
    token mean) or entropy masking (each micro-batch's quantile)."""
    if algorithm == "rloo":
        return True
    return loss_type != "bnpo" and entropy_coef == 0.0 and top_entropy_quantile >= 1.0
