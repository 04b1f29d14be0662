"""GRPO and RLOO math as pure functions over tensors: rewards -> advantages -> loss.

Semantics follow TRL (``GRPOTrainer`` / ``RLOOTrainer``, 1.x) so that results agree with it to float
precision; the test suite checks that against TRL itself. Shapes: ``N`` completions in groups of ``G``
consecutive rows (one prompt each), ``T`` completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4  # TRL's constant in the advantage denominators


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Sample standard deviation (Bessel-corrected) ignoring NaNs; NaN where fewer than two values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dim is not None else torch.nanmean(x)
    sq = (x - mean) ** 2
    var = torch.nanmean(sq, dim=dim, keepdim=True) if dim is not None else torch.nanmean(sq)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True) if dim is not None else (~torch.isnan(x)).sum()
    correction = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.full_like(var, float("nan")))
    std = torch.sqrt(var * correction)
    if dim is not None and not keepdim:
        std = std.squeeze(dim)
    return std


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted sum over reward functions, NaN (``None``) entries skipped.

    Returns ``(rewards, unscorable)``; a completion for which every function returned ``None`` is unscorable:
    its reward is NaN so it takes no part in any baseline, and its advantage ends up 0.
    """
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    return rewards, unscorable


@dataclass
class Advantages:
    advantages: torch.Tensor  # (N,)
    group_mean: torch.Tensor  # (N,) mean reward of each row's group (NaN-aware)
    group_std: torch.Tensor  # (N,) std of each row's group
    zero_std: torch.Tensor  # (N,) bool: the std used for scaling (or the group's) is ~0


def grpo_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> Advantages:
    """Reward minus its group mean, divided by the group std, the batch std, or nothing."""
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    group_std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards in ("group", "none"):
        std = group_std
    elif scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"scale_rewards must be group, batch or none; got {scale_rewards!r}")
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), mean, group_std, zero_std)


def rloo_advantages(rewards: torch.Tensor, num_generations: int, normalize: bool = False) -> Advantages:
    """Reward minus the mean of the *other* scorable completions of the same prompt (leave-one-out)."""
    grouped = rewards.view(-1, num_generations)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    baselines = ((total - grouped) / (counts - 1)).view(-1)
    advantages = rewards - baselines
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + STD_EPS)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), mean, std, zero_std)


def sequence_kl_penalty(old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """RLOO's KL estimate per sequence: the summed first-order log ratio to the reference (can be negative)."""
    return ((old_logps - ref_logps) * mask).sum(-1)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to backpropagate (already normalised for gradient accumulation)
    policy_loss: torch.Tensor  # detached scalar for logging
    kl: torch.Tensor | None  # (B, T) per-token k3 KL (GRPO, beta > 0)
    is_low_clipped: torch.Tensor  # (B, T) or (B,)
    is_high_clipped: torch.Tensor
    ratio: torch.Tensor


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    num_processes: int = 1,
    use_bias_correction_kl: bool = True,
) -> LossOutput:
    """Token-level clipped surrogate plus, with ``beta > 0``, the k3 KL to the reference.

    Normalisations (TRL's): ``grpo`` averages each sequence over its tokens, then over sequences; ``bnpo``
    averages over all tokens of the micro-batch; ``dr_grpo`` divides by ``B * max_completion_length``;
    ``dapo`` divides by the tokens of the whole generation batch (``num_items_in_batch``), rescaled to one
    accumulation window. All but ``dapo`` are divided by ``gradient_accumulation_steps``. The logged ``kl`` is
    the plain k3 estimate.
    """
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probabilities")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        # weighting by the (differentiable) ratio makes the KL gradient the unbiased reverse-KL gradient even
        # on-policy, where the ratio's value is 1 (TRL's default since DeepSeek-V3.2)
        per_token = per_token + beta * (kl * ratio if use_bias_correction_kl else kl)
    masked = (per_token * mask).sum
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        policy = loss.detach()
        loss = loss / gradient_accumulation_steps
    elif loss_type == "bnpo":
        loss = masked() / mask.sum().clamp(min=1.0)
        policy = loss.detach()
        loss = loss / gradient_accumulation_steps
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo needs max_completion_length")
        loss = masked() / (per_token.size(0) * max_completion_length)
        policy = loss.detach()
        loss = loss / gradient_accumulation_steps
    elif loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError("dapo needs num_items_in_batch (completion tokens in the generation batch)")
        items = torch.as_tensor(num_items_in_batch, dtype=logps.dtype).clamp(min=1.0)
        normaliser = items / num_processes * gradient_accumulation_steps / steps_per_generation
        loss = masked() / normaliser
        policy = loss.detach()
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    is_low = (ratio < 1 - epsilon_low) & (adv < 0)
    is_high = (ratio > 1 + epsilon_high) & (adv > 0)
    return LossOutput(loss, policy, kl, is_low, is_high, ratio)


def rloo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    gradient_accumulation_steps: int = 1,
) -> LossOutput:
    """Sequence-level clipped surrogate: the ratio is of whole-sequence probabilities (summed log-probs)."""
    mask = mask.to(logps.dtype)
    seq = (logps * mask).sum(1)
    old = seq.detach() if old_logps is None else (old_logps * mask).sum(1)
    ratio = torch.exp(seq - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages).mean()
    is_low = (ratio < 1 - epsilon_low) & (advantages < 0)
    is_high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return LossOutput(loss / gradient_accumulation_steps, loss.detach(), None, is_low, is_high, ratio)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.dim() == 1:
        return x.float().mean()
    mask = mask.to(x.dtype) if x.is_floating_point() else mask.float()
    return (x.float() * mask).sum() / mask.sum().clamp(min=1.0)
