"""The pure math of ``training.algorithms``, each function alone, on small hand-checkable tensors (no model).

Agreement with TRL on real models and batches is ``tests/test_trl_agreement.py``; these pin down the definitions:
what each advantage, surrogate, weight, mask and normaliser is, with the numbers worked out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from collage.training import algorithms as alg

nan = math.nan


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


# ---------------------------------------------------------------------------------------------- advantages
def test_nanstd_is_bessel_corrected_and_skips_nan():
    x = torch.tensor([[1.0, 3.0, nan], [2.0, nan, nan]])
    std = alg.nanstd(x, dim=1)
    assert close(std[0], math.sqrt(2.0)) and torch.isnan(std[1])  # one value: no spread to estimate
    assert close(alg.nanstd(torch.tensor([1.0, 2.0, 3.0, 4.0])), torch.tensor([1.0, 2.0, 3.0, 4.0]).std())


def test_combine_rewards_skips_none_and_marks_unscorable():
    per_func = torch.tensor([[1.0, nan], [nan, nan], [0.5, 2.0]])
    rewards, unscorable = alg.combine_rewards(per_func, torch.tensor([1.0, 0.5]))
    assert close(rewards[[0, 2]], [1.0, 1.5]) and torch.isnan(rewards[1])
    assert unscorable.tolist() == [False, True, False]


def test_grpo_advantages_group_batch_and_none():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0])
    group = alg.grpo_advantages(rewards, 2, "group")
    s = math.sqrt(2.0)
    assert close(group.advantages, [-1 / (s + 1e-4), 1 / (s + 1e-4), 0.0, 0.0])
    assert group.zero_std.tolist() == [False, False, True, True]
    none = alg.grpo_advantages(rewards, 2, "none")
    assert close(none.advantages, [-1.0, 1.0, 0.0, 0.0])
    batch = alg.grpo_advantages(rewards, 2, "batch")
    assert close(batch.advantages, torch.tensor([-1.0, 1.0, 0.0, 0.0]) / (rewards.std() + 1e-4))
    with pytest.raises(ValueError):
        alg.grpo_advantages(rewards, 2, "both")


def test_gdpo_normalises_each_reward_in_its_group_then_the_sum_over_the_batch():
    # two functions on very different scales: GDPO gives each the same say before weighting
    per_func = torch.tensor([[0.0, 100.0], [1.0, 300.0], [1.0, nan], [0.0, nan], [nan, nan], [nan, nan]])
    weights = torch.tensor([1.0, 1.0])
    out = alg.gdpo_advantages(per_func, weights, 2)
    z1 = 0.5 / (math.sqrt(0.5) + 1e-4)  # each function in each group of two: (x - mean) / (std + 1e-4)
    z2 = 100.0 / (math.sqrt(20_000.0) + 1e-4)  # ~ z1: the scale is gone
    summed = torch.tensor([-z1 - z2, z1 + z2, z1, -z1])  # the second function has no values in group 1: skipped
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    assert close(out.advantages[:4], expected, tol=1e-5)
    assert out.advantages[4:].tolist() == [0.0, 0.0]  # unscorable rows
    assert close(out.group_mean[:2], [200.5, 200.5]) and not out.zero_std.any()  # the plain weighted reward


def test_rloo_advantages_leave_one_out_and_skip_unscorable():
    rewards = torch.tensor([1.0, 2.0, 6.0, nan])
    out = alg.rloo_advantages(rewards, 4)
    assert close(out.advantages, [1 - 4.0, 2 - 3.5, 6 - 1.5, 0.0])
    normalised = alg.rloo_advantages(rewards, 4, normalize=True).advantages
    raw = torch.tensor([-3.0, -1.5, 4.5])
    assert close(normalised[:3], (raw - raw.mean()) / (raw.std() + 1e-4), tol=1e-5)


def test_sequence_kl_penalty_sums_the_masked_log_ratio():
    old, ref = torch.tensor([[-1.0, -2.0, -9.0]]), torch.tensor([[-1.5, -1.0, 0.0]])
    assert close(alg.sequence_kl_penalty(old, ref, torch.tensor([[1.0, 1.0, 0.0]])), [0.5 - 1.0])


# ------------------------------------------------------------------------------------- ratios and surrogates
def test_importance_log_weights_token_and_sequence():
    logps = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.5, -1.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert close(alg.importance_log_weights(logps, old, mask, "token"), [[0.5, -1.0, 4.0]])
    seq = alg.importance_log_weights(logps, old, mask, "sequence")
    assert seq.shape == (1, 1) and close(seq, [[-0.25]])  # mean over the two real tokens (GSPO)
    with pytest.raises(ValueError):
        alg.importance_log_weights(logps, old, mask, "batch")


def test_k3_kl_is_zero_at_equality_and_positive_otherwise():
    logps = torch.tensor([-1.0, -2.0, -0.5])
    assert close(alg.k3_kl(logps, logps), [0.0, 0.0, 0.0])
    kl = alg.k3_kl(logps, torch.tensor([-2.0, -1.0, -0.5]))
    assert (kl[:2] > 0).all() and close(kl[0], math.exp(-1) + 1 - 1)


def test_clipped_surrogate_and_delta():
    ratio = torch.tensor([0.5, 1.0, 1.5, 3.0])
    pos, neg = torch.ones(4), -torch.ones(4)
    loss, capped = alg.clipped_surrogate(ratio, pos, 0.2, 0.28)
    assert close(loss, [-0.5, -1.0, -1.28, -1.28]) and torch.equal(capped, ratio)
    loss, _ = alg.clipped_surrogate(ratio, neg, 0.2, 0.28)
    assert close(loss, [0.8, 1.0, 1.5, 3.0])  # negative advantage: a large ratio is not clipped...
    loss, capped = alg.clipped_surrogate(ratio, neg, 0.2, 0.28, delta=2.0)
    assert close(loss, [0.8, 1.0, 1.5, 2.0]) and close(capped, [0.5, 1.0, 1.5, 2.0])  # ...unless delta caps it


def test_cispo_caps_the_detached_weight_and_keeps_every_gradient():
    logps = torch.tensor([-1.0, -2.0], requires_grad=True)
    ratio = torch.tensor([0.5, 10.0])
    adv = torch.tensor([2.0, 1.0])
    loss = alg.cispo_surrogate(ratio, adv, logps, epsilon_high=5.0)
    assert close(loss, [-0.5 * 2 * -1.0, -5.0 * 1 * -2.0])
    loss.sum().backward()
    assert close(logps.grad, [-1.0, -5.0])  # -clip(r) * A: a capped token still trains


def test_sapo_gate_has_slope_one_at_ratio_one_and_saturates():
    ratio = torch.tensor([1.0, 1.0, 5.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss = alg.sapo_surrogate(ratio, adv, temperature_pos=1.0, temperature_neg=1.05)
    assert close(loss[:2], [-2.0 / 1.0, 2.0 / 1.05])  # sigmoid(0) * 4 / tau * -A
    loss.sum().backward()
    assert close(ratio.grad[:2], [-1.0, 1.0])  # same gradient as the unclipped surrogate at r = 1
    assert abs(ratio.grad[2].item()) < 0.1  # far off-policy: attenuated, not cut


def test_vespo_weight_is_one_on_policy_and_decays_off_policy():
    mask = torch.ones(2, 3)
    adv = torch.tensor([[1.0], [-1.0]])
    on = alg.vespo_weights(adv, torch.zeros(2, 3), mask)
    assert on.shape == (2, 1) and close(on, [[1.0], [1.0]])  # phi(1) = e^lambda e^-lambda = 1
    log_ratio = torch.full((2, 3), 0.2)  # w = e^0.6 for both
    w = math.exp(0.6)
    phi = alg.vespo_weights(adv, log_ratio, mask, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
    assert close(phi, [[math.exp(3 + 2 * 0.6 - 3 * w)], [math.exp(2 + 3 * 0.6 - 2 * w)]], tol=1e-5)
    assert not phi.requires_grad


def test_high_entropy_mask_keeps_the_top_quantile_of_real_tokens():
    entropies = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    kept = alg.high_entropy_mask(entropies, mask, 0.5)
    assert kept.tolist() == [[False, True, True, False], [False, True, False, False]]  # padding never kept
    assert alg.high_entropy_mask(entropies, mask, 1.0).sum() == 6
    assert alg.high_entropy_mask(entropies, mask, 0.0).tolist() == [[False, True, False, False], [False] * 4]
    pool = torch.tensor([0.0, 10.0])  # other processes' tokens move the threshold (median 5.0)
    assert not alg.high_entropy_mask(entropies, mask, 0.5, pool).any()


def test_entropy_quantile_beyond_torch_quantiles_limit(monkeypatch):
    values = torch.rand(1001, generator=torch.Generator().manual_seed(0))
    expected = torch.quantile(values, 0.8)
    monkeypatch.setattr(alg, "QUANTILE_MAX_ELEMENTS", 10)
    assert close(alg.entropy_quantile(values, 0.8), expected)


def test_token_logps_and_entropy_are_differentiable():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    ids = torch.tensor([[0, 1, 2], [3, 4, 0]])
    logps, entropy = alg.token_logps_and_entropy(logits, ids, temperature=0.5)
    logp_all = torch.log_softmax(logits / 0.5, dim=-1)
    assert close(logps, logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1))
    assert close(entropy, -(logp_all.exp() * logp_all).sum(-1))
    entropy.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------- normalisation
def _settings(loss_type, **kw):
    return alg.GRPOLossSettings(loss_type=loss_type, max_completion_length=4, **kw)


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "loss_type,expected",
    [
        ("grpo", (6 / 3 + 4 / 1) / 2),
        ("sapo", (6 / 3 + 4 / 1) / 2),
        ("bnpo", 10 / 4),
        ("dr_grpo", 10 / (2 * 4)),
        ("luspo", (6 + 4) / 2),
        ("dapo", 10 / (20 / 1 * 1 / 1)),
        ("cispo", 10 / 20),
        ("vespo", 10 / 20),
    ],
)
def test_aggregate_loss_normalisers(loss_type, expected):
    loss, logged = alg.aggregate_loss(PER_TOKEN, MASK, _settings(loss_type), num_items_in_batch=20)
    assert close(loss, expected) and close(logged, expected)


def test_accumulation_scaling_and_the_generation_batch_normaliser():
    # grpo-style losses are divided by the accumulation steps; the logged value is not
    loss, logged = alg.aggregate_loss(PER_TOKEN, MASK, _settings("bnpo", gradient_accumulation_steps=4))
    assert close(loss, 10 / 4 / 4) and close(logged, 10 / 4)
    # dapo: tokens of the generation batch (all processes) rescaled to one accumulation window
    s = _settings("dapo", gradient_accumulation_steps=2, steps_per_generation=4, num_processes=2)
    loss, _ = alg.aggregate_loss(PER_TOKEN, MASK, s, num_items_in_batch=40)
    assert close(loss, 10 / (40 / 2 * 2 / 4))
    with pytest.raises(ValueError, match="num_items_in_batch"):
        alg.aggregate_loss(PER_TOKEN, MASK, _settings("dapo"))
    with pytest.raises(ValueError, match="unknown loss_type"):
        alg.aggregate_loss(PER_TOKEN, MASK, _settings("ppo"))


def test_entropy_bonus_is_a_mean_per_token_whatever_the_loss_type():
    entropies = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])
    assert close(alg.entropy_bonus(entropies, MASK), 10 / 4)
    assert close(alg.entropy_bonus(entropies, MASK, gradient_accumulation_steps=2), 10 / 4 / 2)


# ------------------------------------------------------------------------------------------- whole losses
def _batch():
    g = torch.Generator().manual_seed(0)
    logps = (-torch.rand(2, 4, generator=g) - 0.5).requires_grad_()
    old = logps.detach() + 0.3 * torch.randn(2, 4, generator=g)
    ref = logps.detach() + 0.2 * torch.randn(2, 4, generator=g)
    return logps, old, ref, torch.tensor([1.0, -0.5]), MASK


def test_grpo_loss_is_surrogate_plus_weighted_kl_then_normalised():
    logps, old, ref, adv, mask = _batch()
    s = _settings("bnpo", beta=0.1, epsilon_low=0.2, epsilon_high=0.2)
    out = alg.grpo_loss(logps, old, adv, mask, s, ref_logps=ref)
    ratio = torch.exp(logps - old)
    surrogate, _ = alg.clipped_surrogate(ratio, adv.unsqueeze(1), 0.2, 0.2)
    kl = alg.k3_kl(logps, ref) * ratio
    assert close(out.loss, ((surrogate + 0.1 * kl) * mask).sum() / mask.sum())
    assert close(out.kl, kl)  # logged as TRL logs it: ratio-weighted
    plain = alg.grpo_loss(logps, old, adv, mask, _settings("bnpo", beta=0.1, use_bias_correction_kl=False), ref)
    assert close(plain.kl, alg.k3_kl(logps, ref))
    assert out.is_low_clipped is not None and out.is_high_clipped is not None
    with pytest.raises(ValueError, match="reference"):
        alg.grpo_loss(logps, old, adv, mask, s)


def test_grpo_loss_on_policy_has_unit_ratio_and_the_policy_gradient():
    logps, _, _, adv, mask = _batch()
    out = alg.grpo_loss(logps, None, adv, mask, _settings("grpo"))
    assert close(out.ratio, torch.ones(2, 4)) and close(out.loss, -adv.mean())
    out.loss.backward()
    expected = -adv.unsqueeze(1) * mask / mask.sum(-1, keepdim=True) / 2
    assert close(logps.grad, expected)


def test_entropy_mask_and_bonus_in_the_loss():
    logps, old, ref, adv, mask = _batch()
    entropies = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]], requires_grad=True)
    keep = torch.tensor([[False, True, True, False], [True, False, False, False]])
    s = _settings("bnpo", entropy_coef=0.5)
    out = alg.grpo_loss(logps, old, adv, mask, s, entropies=entropies, entropy_mask=keep)
    masked = alg.grpo_loss(logps, old, adv, mask * keep, _settings("bnpo"))
    surrogate = masked.loss * (mask * keep).sum() / mask.sum()  # masked tokens count in bnpo's denominator
    assert close(out.policy_loss, surrogate)
    assert close(out.entropy_bonus, (2 + 3 + 4) / 3)  # over the tokens the mask keeps
    assert close(out.loss, surrogate - 0.5 * 3.0) and close(out.logged_loss, out.loss)
    out.loss.backward()
    assert entropies.grad is not None and close(entropies.grad[0, 1], -0.5 / 3)
    with pytest.raises(ValueError, match="entropies"):
        alg.grpo_loss(logps, old, adv, mask, s)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo"])
def test_losses_without_a_clip_region_report_their_own_metrics(loss_type):
    logps, old, _, adv, mask = _batch()
    out = alg.grpo_loss(logps, old, adv, mask, _settings(loss_type, epsilon_high=1.1), num_items_in_batch=4)
    assert out.is_low_clipped is None and out.is_high_clipped is None
    names = {"cispo": {"cispo_clip_ratio"}, "sapo": set(), "vespo": {"vespo/phi_seq_mean"}}[loss_type]
    assert set(out.extra) == names
    out.loss.backward()
    assert logps.grad is not None and logps.grad.abs().sum() > 0


def test_sequence_level_ratio_is_one_per_sequence():
    logps, old, _, adv, mask = _batch()
    out = alg.grpo_loss(logps, old, adv, mask, _settings("grpo", importance_sampling_level="sequence"))
    assert out.ratio.shape == (2, 1)
    assert close(out.ratio[:, 0], torch.exp(((logps - old) * mask).sum(-1) / mask.sum(-1)))
    assert out.is_low_clipped is not None and out.is_low_clipped.shape == (2, 1)


def test_rloo_loss_uses_the_sequence_ratio():
    logps, old, _, adv, mask = _batch()
    out = alg.rloo_loss(logps, old, adv, mask, 0.2, 0.2, gradient_accumulation_steps=2)
    ratio = torch.exp(((logps - old) * mask).sum(1))
    clipped = torch.clamp(ratio, 0.8, 1.2)
    expected = -torch.min(ratio * adv, clipped * adv).mean()
    assert close(out.policy_loss, expected) and close(out.loss, expected / 2)


# ------------------------------------------------------------------------------------- reference, metrics
def test_mix_into_reference_is_tr_dpos_soft_update():
    ref = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])]
    policy = [torch.tensor([3.0, 0.0], requires_grad=True), torch.tensor([[10.0]])]
    alg.mix_into_reference(ref, policy, 0.25)
    assert close(ref[0], [1.5, 1.5]) and close(ref[1], [[2.5]])
    with pytest.raises(ValueError):
        alg.mix_into_reference(ref, policy[:1], 0.5)


def test_masked_mean_per_token_and_per_sequence():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert close(alg.masked_mean(x, mask), 3.0)
    assert close(alg.masked_mean(torch.tensor([[1.0], [0.0]]), mask), 0.5)  # one value per sequence (GSPO)
    assert close(alg.masked_mean(torch.tensor([2.0, 4.0]), mask), 3.0)  # RLOO's per-sequence flags
