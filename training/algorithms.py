"""GRPO and RLOO math as pure functions over tensors: rewards -> advantages -> loss.

Semantics follow TRL 1.16 (``GRPOTrainer._compute_loss`` / ``RLOOTrainer._compute_loss`` and the advantage code of
their ``_generate_and_score_completions``) so that results agree with it to float precision; the test suite checks
that against TRL itself. Shapes: ``N`` completions in groups of ``G`` consecutive rows (one prompt each), ``B``
completions in a micro-batch, ``T`` completion tokens. A "per-token" tensor is ``(B, T)``, or ``(B, 1)`` when the
importance weight is one per sequence (``importance_sampling_level="sequence"``, VESPO's weights).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

from .config import CLIPPED_LOSSES  # the PPO-style clipped surrogate losses (and ``delta``): one list, in config

STD_EPS = 1e-4  # TRL's constant in the advantage denominators

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
SEQUENCE_MEAN_LOSSES = ("grpo", "sapo")  # each sequence averaged over its tokens, then over sequences
GLOBAL_TOKEN_LOSSES = ("cispo", "dapo", "vespo")  # divided by the tokens of the generation batch
VESPO_LOG_W_MIN = math.log(1e-8)  # TRL's lower clamp of VESPO's sequence log-weight
QUANTILE_MAX_ELEMENTS = 2**24  # torch.quantile's input limit; larger pools are sorted instead


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


# ------------------------------------------------------------------------------------------------ advantages
@dataclass
class Advantages:
    advantages: torch.Tensor  # (N,)
    group_mean: torch.Tensor  # (N,) mean reward of each row's group (NaN-aware)
    group_std: torch.Tensor  # (N,) std of each row's group
    zero_std: torch.Tensor  # (N,) bool: the std used for scaling (or the group's) is ~0


def grpo_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> Advantages:
    """Reward minus its group mean, divided by the group std, the batch std, or nothing
    (``multi_objective_aggregation="sum_then_normalize"``, TRL's default)."""
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


def gdpo_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int) -> Advantages:
    """GDPO (``multi_objective_aggregation="normalize_then_sum"``): each reward function is normalised within its
    group first (mean 0, std 1, ``None`` skipped), the normalised rewards are summed with the weights, and the sum
    is standardised over the batch. ``scale_rewards`` plays no part (as in TRL).

    ``group_mean`` / ``group_std`` describe the plain weighted reward of each group (for the rollout table);
    ``zero_std`` is TRL's flag: the batch std of the aggregated reward is ~0.
    """
    k = rewards_per_func.size(1)
    grouped = rewards_per_func.view(-1, num_generations, k)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    normalised = ((grouped - mean_k) / (std_k + STD_EPS)).view(-1, k)
    summed = (normalised * weights.unsqueeze(0)).nansum(dim=1)
    summed[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan  # unscorable: no part in the batch statistics
    std = nanstd(summed).expand_as(summed) if summed.numel() > 1 else torch.zeros_like(summed)
    advantages = (summed - torch.nanmean(summed)) / (std + STD_EPS)
    plain, _ = combine_rewards(rewards_per_func, weights)
    plain_grouped = plain.view(-1, num_generations)
    group_mean = torch.nanmean(plain_grouped, dim=1).repeat_interleave(num_generations)
    group_std = nanstd(plain_grouped, dim=1).repeat_interleave(num_generations)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), group_mean, group_std, zero_std)


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


# --------------------------------------------------------------------------------------- log-probs, entropy
def token_logps_and_entropy(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of ``ids`` under ``softmax(logits / temperature)`` and the entropy of that
    distribution, both ``(B, T)`` and both differentiable (the entropy bonus, ``entropy_coef``, trains through it)."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logps = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps, entropy


def entropy_quantile(values: torch.Tensor, quantile: float) -> torch.Tensor:
    """The ``quantile`` of a 1-D tensor with linear interpolation (``torch.quantile``'s method, without its
    16M-element limit)."""
    values = values.float()
    if values.numel() <= QUANTILE_MAX_ELEMENTS:
        return torch.quantile(values, quantile)
    ordered = values.sort().values
    position = quantile * (ordered.numel() - 1)
    lo, hi = math.floor(position), math.ceil(position)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def high_entropy_mask(
    entropies: torch.Tensor, mask: torch.Tensor, top_quantile: float, pool: torch.Tensor | None = None
) -> torch.Tensor:
    """``top_entropy_quantile`` (Beyond the 80/20 Rule): the completion tokens whose entropy is at or above the
    ``1 - top_quantile`` quantile of ``pool`` (the entropies of every completion token of the micro-batch on every
    process; by default this micro-batch's own). ``(B, T)`` bool; padding is never kept."""
    valid = mask.bool()
    pool = entropies[valid].float() if pool is None else pool.float()
    if pool.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    threshold = entropy_quantile(pool, 1.0 - top_quantile)
    return ((entropies * mask.float()) >= threshold) & valid


# -------------------------------------------------------------------------------------------- GRPO pieces
def importance_log_weights(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """``log(pi / pi_old)`` per token ``(B, T)``, or (GSPO, ``level="sequence"``) its mean over each sequence's
    tokens ``(B, 1)``."""
    log_ratio = logps - old_logps
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level must be token or sequence; got {level!r}")


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(pi || pi_ref)``: ``exp(r) - r - 1`` with ``r = log pi_ref - log pi``."""
    diff = ref_logps - logps
    return torch.exp(diff) - diff - 1


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``; with ``delta`` (two-sided clipping, INTELLECT-2)
    the unclipped ratio is also capped at ``delta``, which bounds the update when ``A < 0`` and ``r`` is large.

    Returns ``(per_token_loss, ratio)``, the ratio after the ``delta`` cap (what TRL's clip metrics look at)."""
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    return -torch.min(ratio * advantages, clipped * advantages), ratio


def cispo_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, logps: torch.Tensor, epsilon_high: float
) -> torch.Tensor:
    """CISPO (MiniMax-M1): the importance weight itself is capped at ``epsilon_high`` (ScaleRL's eps_max, not
    ``1 + epsilon_high``) and detached, and multiplies ``A * log pi``: every token keeps a gradient."""
    return -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logps


def sapo_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float, temperature_neg: float
) -> torch.Tensor:
    """SAPO: a smooth gate ``sigmoid(tau (r - 1)) * 4 / tau`` replaces the hard clip, with temperature ``tau`` =
    ``temperature_pos`` where ``A > 0`` and ``temperature_neg`` elsewhere (its slope at ``r = 1`` is 1)."""
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(temperature_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(temperature_neg, dtype=ratio.dtype, device=ratio.device),
    )
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


@torch.no_grad()
def vespo_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """VESPO's gamma weight per sequence, ``(B, 1)``, no gradient: ``phi(w) = e^lambda w^k e^(-lambda w)``
    (``phi(1) = 1``), ``w`` the sequence's importance weight ``exp(sum_t log pi/pi_old)``; ``(k, lambda)`` are
    ``(k_pos, lambda_pos)`` where ``A >= 0``, ``(k_neg, lambda_neg)`` elsewhere."""
    seq_log_ratio = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, VESPO_LOG_W_MIN, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@dataclass(frozen=True)
class GRPOLossSettings:
    """The GRPO loss options, TRL's names and defaults (``GRPOConfig``)."""

    loss_type: str = "dapo"
    epsilon_low: float = 0.2  # TRL: epsilon
    epsilon_high: float = 0.2  # TRL: epsilon_high, or epsilon when unset
    delta: float | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    entropy_coef: float = 0.0
    max_completion_length: int | None = None  # dr_grpo's constant
    gradient_accumulation_steps: int = 1
    steps_per_generation: int = 1
    num_processes: int = 1


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to backpropagate (already normalised for gradient accumulation)
    policy_loss: torch.Tensor  # detached scalar: the surrogate (+ KL) before the accumulation scaling
    kl: torch.Tensor | None  # per-token KL term as TRL logs it (ratio-weighted with use_bias_correction_kl)
    is_low_clipped: torch.Tensor | None  # (B, T) / (B, 1) / (B,); None for losses without a clip region
    is_high_clipped: torch.Tensor | None
    ratio: torch.Tensor
    entropy_bonus: torch.Tensor | None = None  # detached mean entropy of the tokens the bonus acts on
    logged_loss: torch.Tensor | None = None  # detached: policy_loss - entropy_coef * entropy_bonus
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # loss-type metrics, per token or per sequence


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    settings: GRPOLossSettings,
    num_items_in_batch: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``loss_type`` normalisation: ``(loss to backpropagate, detached loss before accumulation scaling)``.

    ``grpo``/``sapo`` average each sequence over its tokens, then over sequences; ``bnpo`` averages over all tokens
    of the micro-batch; ``dr_grpo`` divides by ``B * max_completion_length``; ``luspo`` sums each sequence and
    averages the sums (each sequence weighted by its length); ``dapo``/``cispo``/``vespo`` divide by the tokens of
    the whole generation batch (``num_items_in_batch``, all processes), rescaled to one accumulation window, and
    are not divided again. The others are divided by ``gradient_accumulation_steps``.
    """
    s = settings
    loss_type = s.loss_type
    if loss_type in GLOBAL_TOKEN_LOSSES:
        if num_items_in_batch is None:
            raise ValueError(f"{loss_type} needs num_items_in_batch (completion tokens in the generation batch)")
        items = torch.as_tensor(num_items_in_batch, dtype=per_token_loss.dtype, device=per_token_loss.device)
        normaliser = items.clamp(min=1.0) / s.num_processes * s.gradient_accumulation_steps / s.steps_per_generation
        loss = (per_token_loss * mask).sum() / normaliser
        return loss, loss.detach()
    if loss_type in SEQUENCE_MEAN_LOSSES:
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if s.max_completion_length is None:
            raise ValueError("dr_grpo needs max_completion_length")
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * s.max_completion_length)
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean()
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return loss / s.gradient_accumulation_steps, loss.detach()


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, gradient_accumulation_steps: int = 1) -> torch.Tensor:
    """The mean per-token entropy of the tokens in ``mask`` (not rescaled by ``loss_type``), divided by the
    accumulation steps; the loss subtracts ``entropy_coef`` times it."""
    mask = mask.to(entropies.dtype)
    return (entropies * mask).sum() / mask.sum().clamp(min=1.0) / gradient_accumulation_steps


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: GRPOLossSettings,
    ref_logps: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    entropies: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
) -> LossOutput:
    """TRL's GRPO loss for one micro-batch: importance weights (per token, or per sequence for GSPO), the
    ``loss_type`` surrogate, the ``top_entropy_quantile`` mask (``entropy_mask``), ``beta`` times the k3 KL to the
    reference (ratio-weighted with ``use_bias_correction_kl``), the ``loss_type`` normalisation, and with
    ``entropy_coef != 0`` minus the entropy bonus (``entropies`` must then carry gradients).

    ``old_logps`` is None when the batch is used on-policy (its ratio is 1, its gradient that of ``log pi``).
    """
    s = settings
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = logps - old
    ratio = torch.exp(importance_log_weights(logps, old, mask, s.importance_sampling_level))

    kl = None
    if s.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probabilities")
        kl = k3_kl(logps, ref_logps)
        if s.use_bias_correction_kl:
            # weighting by the (differentiable) ratio makes the KL gradient the unbiased reverse-KL gradient even
            # on-policy, where the ratio's value is 1 (DeepSeek-V3.2; TRL's default)
            kl = kl * ratio

    is_low = is_high = None
    extra: dict[str, torch.Tensor] = {}
    if s.loss_type in CLIPPED_LOSSES:
        per_token, capped = clipped_surrogate(ratio, adv, s.epsilon_low, s.epsilon_high, s.delta)
        is_low = (capped < 1 - s.epsilon_low) & (adv < 0)
        is_high = (capped > 1 + s.epsilon_high) & (adv > 0)
    elif s.loss_type == "cispo":
        per_token = cispo_surrogate(ratio, adv, logps, s.epsilon_high)
        extra["cispo_clip_ratio"] = ((ratio > s.epsilon_high) & (adv > 0)).float()
    elif s.loss_type == "sapo":
        per_token = sapo_surrogate(ratio, adv, s.sapo_temperature_pos, s.sapo_temperature_neg)
    elif s.loss_type == "vespo":
        phi = vespo_weights(adv, log_ratio, mask, s.vespo_k_pos, s.vespo_lambda_pos, s.vespo_k_neg, s.vespo_lambda_neg)
        per_token = -phi * adv * logps
        extra["vespo/phi_seq_mean"] = phi
    else:
        raise ValueError(f"unknown loss_type {s.loss_type!r}")

    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if kl is not None:
        per_token = per_token + s.beta * kl
    loss, policy = aggregate_loss(per_token, mask, s, num_items_in_batch)

    bonus = None
    logged = policy
    if s.entropy_coef != 0.0:
        if entropies is None:
            raise ValueError("entropy_coef != 0 needs the per-token entropies")
        effective = mask if entropy_mask is None else mask * entropy_mask
        term = entropy_bonus(entropies, effective, s.gradient_accumulation_steps)
        loss = loss - s.entropy_coef * term
        bonus = (term * s.gradient_accumulation_steps).detach()
        logged = policy - s.entropy_coef * bonus
    return LossOutput(loss, policy, kl, is_low, is_high, ratio, bonus, logged, extra)


# --------------------------------------------------------------------------------------------------- RLOO
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
    policy = loss.detach()
    return LossOutput(loss / gradient_accumulation_steps, policy, None, is_low, is_high, ratio, logged_loss=policy)


# ------------------------------------------------------------------------------------- reference model
@torch.no_grad()
def mix_into_reference(reference: Iterable[torch.Tensor], policy: Iterable[torch.Tensor], alpha: float) -> None:
    """TR-DPO's soft update, in place: ``ref = alpha * policy + (1 - alpha) * ref`` (``sync_ref_model``)."""
    for ref, new in zip(reference, policy, strict=True):
        ref.mul_(1.0 - alpha).add_(new.detach().to(ref.dtype), alpha=alpha)


# --------------------------------------------------------------------------------------------------- metrics
def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the completion tokens in ``mask``; a per-sequence tensor (``(B,)``, or ``(B, 1)`` against a
    wider mask) is averaged over its sequences, as TRL logs it."""
    if x.dim() == 1 or (x.dim() == 2 and x.size(1) == 1 and mask.size(-1) != 1):
        return x.float().mean()
    mask = mask.to(x.dtype) if x.is_floating_point() else mask.float()
    return (x.float() * mask).sum() / mask.sum().clamp(min=1.0)
