"""Collage's advantages, losses and metrics agree with TRL's own trainers on the same tiny model and batch, in-process.

TRL (dev extra only; ``training/`` never imports it) prepares a generation batch through its real
``_generate_and_score_completions`` (generation itself replaced by fixed completions, so both sides see the
same tokens) and computes its loss with its real ``_compute_loss``. Collage computes the same from its own
encoder, collate and log-prob path plus ``training.algorithms``. Covered, to 1e-5 in float32 (loss values,
every parameter's gradient, and the logged metrics):

- every ``loss_type`` (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo) and their parameters,
  ``importance_sampling_level: sequence`` (GSPO), ``delta``, ``top_entropy_quantile``, ``entropy_coef``,
  ``beta`` with and without ``use_bias_correction_kl`` (and the ``kl`` metric as TRL logs it);
- advantages for ``scale_rewards`` group/batch/none, ``multi_objective_aggregation: normalize_then_sum`` (GDPO),
  RLOO with and without ``normalize_advantages`` and its KL-in-the-reward; groups of 2, 4 and 8; 1- and 2-image
  prompts and a text-only prompt in one batch; ``None`` rewards, an unscorable completion, a zero-std group;
- ``gradient_accumulation_steps > 1`` with ``steps_per_generation > 1`` through TRL's own ``_prepare_inputs``
  (shuffle, split, buffer): each micro-batch's loss and each accumulation window's gradient;
- ``sync_ref_model`` against TRL's ``SyncRefModelCallback``;

and, without TRL, Collage's trainer end to end: its shuffle and micro-batch slicing keep every row's advantage,
old and reference log-probs and pixels with it (checked against a per-sample recomputation).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
from PIL import Image

from collage.training import algorithms as alg
from collage.training.batching.batch import collate
from collage.training.batching.encoding import PromptEncoder
from collage.training.batching.logprobs import (
    _completion_logits,
    completion_logprobs,
    completion_logprobs_and_entropy,
)
from collage.training.data.rows import Sample
from collage.training.trainer import loss_metrics

TOL = 1e-5


FAMILY = "qwen2-vl"


MAX_COMPLETION = 6


WEIGHTS = [1.0, 0.5]


# the metrics Collage logs under TRL's names from the loss side; each must equal TRL's whenever TRL logs it
LOSS_METRICS = (
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "cispo_clip_ratio",
    "vespo/phi_seq_mean",
    "policy_loss",
    "entropy_coef",
)


# --------------------------------------------------------------------------------------------- batch pieces
def _images(n, seed):
    colours = [(200, 30, 30), (30, 30, 200), (30, 160, 30)]
    return [Image.new("RGB", (56, 56), colours[(seed + i) % 3]) for i in range(n)]


ONE_IMAGE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many are red?"}]}]


TWO_IMAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image"},
            {"type": "text", "text": " with "},
            {"type": "image"},
        ],
    }
]


TEXT_ONLY = [{"role": "user", "content": [{"type": "text", "text": "What is 3 plus 4?"}]}]


def _rows(n_prompts, text_only=False):
    """Prompts with 1 and 2 images alternating; with ``text_only`` the last prompt has no image."""
    rows = []
    for i in range(n_prompts):
        if text_only and i == n_prompts - 1:
            rows.append((TEXT_ONLY, []))
        else:
            rows.append((ONE_IMAGE, _images(1, i)) if i % 2 == 0 else (TWO_IMAGES, _images(2, i)))
    return rows


def _reward_table(n, G):
    """rewards[func][completion]; None = not applicable. Group 0 has equal totals (zero std), the last completion
    is unscorable (every function None), and the second function skips every third completion."""
    first, second = [], []
    for i in range(n):
        if i < G:
            first.append(1.0)
            second.append(0.5)
        else:
            first.append(None if i == n - 1 else ((i * 7) % 5) / 4)
            second.append(None if i % 3 == 0 or i == n - 1 else ((i * 3) % 4) / 3)
    return [first, second]


def _completions(tokenizer, eos, n):
    """Completions ending in EOS, or running to the full length (TRL's RLOO masks by EOS position)."""
    words = tokenizer.encode(" one two three four five six seven", add_special_tokens=False)
    out = []
    for i in range(n):
        length = 1 + i % MAX_COMPLETION
        ids = (words * 4)[i % len(words) : i % len(words) + length]
        out.append(ids + [eos] if length < MAX_COMPLETION else ids)
    return out


def _reward_funcs(table):
    def first(prompts, completions, **kwargs):
        return list(table[0])

    def second(prompts, completions, **kwargs):
        return list(table[1])

    return [first, second]


def _perturb(model, seed, scale=0.02):
    """Move the policy away from where the batch was generated, so ratios (and KL) are not trivially 1 (0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * scale)


def _build_trl(kind, model_dir, out_dir, table, G, **settings):
    import datasets
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    dataset = datasets.Dataset.from_list([{"prompt": "unused"}])
    common = dict(
        output_dir=str(out_dir / kind),
        per_device_train_batch_size=len(table[0]),
        num_generations=G,
        max_completion_length=MAX_COMPLETION,
        report_to="none",
        use_cpu=True,
        bf16=False,
        temperature=0.7,
        reward_weights=WEIGHTS,
    )
    common.update(settings)
    if kind == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(
            model=model,
            reward_funcs=_reward_funcs(table),
            args=GRPOConfig(**common),
            train_dataset=dataset,
            processing_class=processor,
        )
    else:
        from trl import RLOOConfig, RLOOTrainer

        trainer = RLOOTrainer(
            model=model,
            reward_funcs=_reward_funcs(table),
            args=RLOOConfig(**common),
            train_dataset=dataset,
            processing_class=processor,
        )
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    trainer.model.train()
    return trainer, processor


def _fake_generation(kind, trainer, prompt_ids, completion_ids, texts):
    n = len(completion_ids)
    if kind == "grpo":
        trainer._generate = lambda prompts: (prompt_ids, completion_ids, None, texts, None, {}, None, [[]] * n)
    else:
        trainer._generate = lambda prompts: (prompt_ids, completion_ids, texts)


@dataclasses.dataclass
class Setup:
    """One TRL trainer and Collage's view of the same batch (same tokens, pixels, rewards)."""

    kind: str
    G: int
    trainer: object
    family: object
    image_id: int
    batch: object  # Collage's ModelBatch, rows in TRL's order
    mask: torch.Tensor
    table: list
    inputs: list  # TRL's raw inputs (prompt + images per completion)
    gen_logps: torch.Tensor  # policy log-probs at generation time (Collage's path)

    @property
    def temperature(self):
        return self.trainer.temperature

    def rewards_per_func(self):
        return torch.tensor([[math.nan if v is None else v for v in col] for col in self.table]).T

    def logps(self, entropy_grad=False):
        """Collage's loss-time log-probs and entropies of the batch (the trainer's ``_logps_for_loss``)."""
        model = self.trainer.model
        if entropy_grad:
            logits = _completion_logits(model, self.batch, self.family, self.image_id)
            return alg.token_logps_and_entropy(logits, self.batch.completion_ids, self.temperature)
        return completion_logprobs_and_entropy(model, self.batch, self.family, self.image_id, self.temperature)


def _setup(kind, tiny_model_dir, out_dir, G, n_prompts, text_only=False, **settings):
    from collage.training.models.families import family_by_name

    torch.manual_seed(0)
    table = _reward_table(n_prompts * G, G)
    trainer, processor = _build_trl(kind, str(tiny_model_dir(FAMILY)), out_dir, table, G, **settings)
    tokenizer = processor.tokenizer
    family = family_by_name(FAMILY)
    encoder = PromptEncoder(processor, family)
    rows = _rows(n_prompts, text_only)
    encoded = [encoder.encode(Sample(i, prompt, images)) for i, (prompt, images) in enumerate(rows)]
    prompts = [e for e in encoded for _ in range(G)]
    eos = trainer.model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    completions = _completions(tokenizer, eos, len(prompts))
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
    _fake_generation(kind, trainer, [list(p.input_ids) for p in prompts], completions, texts)
    inputs = [{"prompt": prompt, "images": images} for prompt, images in rows for _ in range(G)]
    batch = collate(prompts, family, tokenizer.pad_token_id, completions)
    with torch.no_grad():
        gen_logps = completion_logprobs(trainer.model, batch, family, encoder.image_token_id, trainer.temperature)
    return Setup(
        kind, G, trainer, family, encoder.image_token_id, batch, batch.completion_mask.float(), table, inputs, gen_logps
    )


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_equal(ours, theirs):
    assert ours.keys() == theirs.keys()
    assert max(g.abs().max().item() for g in theirs.values()) > 1e-4, "a zero gradient would agree trivially"
    for name, grad in theirs.items():
        diff = (ours[name] - grad).abs().max().item()
        assert torch.allclose(ours[name], grad, atol=TOL, rtol=1e-4), (name, diff, grad.abs().max().item())


def _trl_metrics(trainer):
    return {k: v[-1] for k, v in trainer._metrics["train"].items() if k in LOSS_METRICS and v}


def _assert_metrics_equal(ours, theirs):
    ours = {k: v for k, v in ours.items() if k in LOSS_METRICS}
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    for key, value in theirs.items():
        assert abs(ours[key] - value) <= TOL, (key, ours[key], value)


# ------------------------------------------------------------------------------- advantages + loss per case
CASES = [
    ("grpo", 4, 2, False, dict(loss_type="grpo", beta=0.0, num_iterations=1, scale_rewards="group")),
    ("grpo", 4, 2, False, dict(loss_type="bnpo", beta=0.0, num_iterations=2, scale_rewards="batch")),
    ("grpo", 4, 2, False, dict(loss_type="dr_grpo", beta=0.04, num_iterations=1, scale_rewards="none")),
    ("grpo", 4, 2, False, dict(loss_type="dapo", beta=0.04, num_iterations=2, epsilon_high=0.28)),
    ("grpo", 2, 3, True, dict(loss_type="dapo", beta=0.04, num_iterations=2)),
    ("grpo", 8, 2, True, dict(loss_type="grpo", beta=0.0, num_iterations=2, scale_rewards="batch")),
    ("grpo", 4, 3, True, dict(multi_objective_aggregation="normalize_then_sum", beta=0.0, num_iterations=2)),
    ("rloo", 4, 2, False, dict(beta=0.0, num_iterations=1, normalize_advantages=False)),
    ("rloo", 4, 2, False, dict(beta=0.05, num_iterations=2, normalize_advantages=True)),
    ("rloo", 2, 3, True, dict(beta=0.05, num_iterations=1)),
    ("rloo", 8, 2, True, dict(beta=0.0, num_iterations=2)),
]


def _case_id(case):
    kind, G, n, text, s = case
    return f"{kind}-G{G}x{n}{'-text' if text else ''}-" + "-".join(f"{a}={b}" for a, b in s.items())


@pytest.mark.parametrize("kind,G,n_prompts,text_only,settings", CASES, ids=[_case_id(c) for c in CASES])
def test_advantages_and_loss_agree_with_trl(kind, G, n_prompts, text_only, settings, tiny_model_dir, tmp_path):
    s = _setup(kind, tiny_model_dir, tmp_path, G, n_prompts, text_only, **settings)
    trainer = s.trainer
    trl_batch = trainer._generate_and_score_completions(s.inputs)

    # ---- advantages from the same rewards
    rewards_per_func = s.rewards_per_func()
    weights = torch.tensor(WEIGHTS)
    rewards, _ = alg.combine_rewards(rewards_per_func, weights)
    if kind == "grpo" and settings.get("multi_objective_aggregation") == "normalize_then_sum":
        adv = alg.gdpo_advantages(rewards_per_func, weights, G).advantages
    elif kind == "grpo":
        adv = alg.grpo_advantages(rewards, G, settings.get("scale_rewards", "group")).advantages
    else:
        if settings["beta"] > 0:
            with torch.no_grad():  # TRL folds the KL into the rewards and keeps no ref log-probs: use its ref model
                ref = completion_logprobs(trainer.ref_model, s.batch, s.family, s.image_id, s.temperature)
            rewards = rewards - settings["beta"] * alg.sequence_kl_penalty(s.gen_logps, ref, s.mask)
        adv = alg.rloo_advantages(rewards, G, settings.get("normalize_advantages", False)).advantages
    assert torch.allclose(adv, trl_batch["advantages"], atol=TOL, rtol=0), (adv, trl_batch["advantages"])
    if kind == "grpo" and "multi_objective_aggregation" not in settings:
        assert adv[:G].abs().max() < TOL  # group 0: zero std, zero advantage
    assert adv[-1] == 0  # the unscorable completion

    # ---- the loss, after the policy has moved (num_iterations > 1) or with a KL term
    if settings["num_iterations"] > 1 or settings["beta"] > 0:
        _perturb(trainer.model, seed=1)
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    trl_loss = trainer._compute_loss(trainer.model, trl_batch)
    trl_loss.backward()
    trl_grads = _grads(trainer.model)
    trl_metrics = _trl_metrics(trainer)
    trainer.model.zero_grad(set_to_none=True)

    logps, entropy = s.logps()
    old = trl_batch.get("old_per_token_logps")
    if kind == "grpo":
        loss_settings = alg.GRPOLossSettings(
            loss_type=settings.get("loss_type", "dapo"),
            epsilon_low=trainer.epsilon_low,
            epsilon_high=trainer.epsilon_high,
            beta=settings["beta"],
            max_completion_length=MAX_COMPLETION,
            steps_per_generation=trainer.args.steps_per_generation,
        )
        out = alg.grpo_loss(
            logps,
            old,
            adv,
            s.mask,
            loss_settings,
            ref_logps=trl_batch.get("ref_per_token_logps"),
            num_items_in_batch=trl_batch["num_items_in_batch"],
        )
        if old is not None:  # TRL's old log-probs were computed on our exact tokens and pixels
            assert torch.allclose(old * s.mask, s.gen_logps * s.mask, atol=TOL)
    else:
        out = alg.rloo_loss(logps, s.gen_logps, adv, s.mask, trainer.epsilon_low, trainer.epsilon_high)
    assert abs(out.loss.item() - trl_loss.item()) <= TOL, (out.loss.item(), trl_loss.item())
    # the value of an on-policy surrogate is ~0 by construction; the gradient is what trains, so compare it too
    out.loss.backward()
    _assert_grads_equal(_grads(trainer.model), trl_grads)
    _assert_metrics_equal(loss_metrics(out, entropy.detach(), s.mask), trl_metrics)


# ------------------------------------------------------------------------------------ every GRPO loss option
# Each variant is applied to one TRL trainer (``_compute_loss`` reads these attributes at call time) and to
# Collage's GRPOLossSettings; the batch has old log-probs (num_iterations 2), reference log-probs (beta 0.04), a
# moved policy, a text-only prompt and groups with None rewards.
BASE_OPTIONS = dict(
    loss_type="dapo",
    importance_sampling_level="token",
    beta=0.04,
    use_bias_correction_kl=True,
    epsilon=0.2,
    epsilon_high=None,
    delta=None,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
    top_entropy_quantile=1.0,
    entropy_coef=0.0,
)


VARIANTS = {
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "cispo-epsilon_high-unset": dict(loss_type="cispo"),
    "cispo-sequence": dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.01),
    "sapo": dict(loss_type="sapo"),
    "sapo-temperatures-beta0": dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=3.0, beta=0.0),
    "sapo-sequence": dict(loss_type="sapo", importance_sampling_level="sequence"),
    "luspo-sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "luspo-token": dict(loss_type="luspo", epsilon_high=0.28),
    "vespo": dict(loss_type="vespo"),
    "vespo-k-lambda": dict(
        loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0, vespo_lambda_neg=5.0
    ),
    "gspo-grpo-sequence": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "dapo-sequence-no-bias-correction": dict(importance_sampling_level="sequence", use_bias_correction_kl=False),
    "dapo-delta": dict(delta=1.02, epsilon=0.01),
    "bnpo-delta-sequence": dict(loss_type="bnpo", delta=1.001, epsilon=0.001, importance_sampling_level="sequence"),
    "dapo-top-entropy": dict(top_entropy_quantile=0.2),
    "dr_grpo-top-entropy-zero": dict(loss_type="dr_grpo", top_entropy_quantile=0.0),
    "dapo-entropy-coef": dict(entropy_coef=0.05),
    "grpo-entropy-coef-top-entropy": dict(loss_type="grpo", entropy_coef=-0.02, top_entropy_quantile=0.5),
    "vespo-entropy-coef": dict(loss_type="vespo", entropy_coef=0.1, beta=0.0),
    "no-bias-correction-kl": dict(use_bias_correction_kl=False),
}


@pytest.fixture(scope="module")
def options_setup(tiny_model_dir, tmp_path_factory):
    s = _setup("grpo", tiny_model_dir, tmp_path_factory.mktemp("options"), 4, 3, True, beta=0.04, num_iterations=2)
    batch = s.trainer._generate_and_score_completions(s.inputs)
    assert "old_per_token_logps" in batch and "ref_per_token_logps" in batch
    _perturb(s.trainer.model, seed=3, scale=0.05)
    return s, batch


def _configure_trl(trainer, options):
    """Point TRL's trainer at these options (what its ``__init__`` copies out of ``GRPOConfig``)."""
    args = trainer.args
    for key, value in options.items():
        setattr(args, key, value)
    trainer.loss_type = options["loss_type"]
    trainer.importance_sampling_level = options["importance_sampling_level"]
    trainer.beta = options["beta"]
    trainer.epsilon_low = options["epsilon"]
    trainer.epsilon_high = options["epsilon_high"] if options["epsilon_high"] is not None else options["epsilon"]
    trainer.top_entropy_quantile = options["top_entropy_quantile"]
    trainer.entropy_coef = options["entropy_coef"]
    trainer._entropy_bonus_enabled = options["entropy_coef"] != 0.0


def _collage_settings(options, trainer):
    return alg.GRPOLossSettings(
        loss_type=options["loss_type"],
        epsilon_low=options["epsilon"],
        epsilon_high=options["epsilon_high"] if options["epsilon_high"] is not None else options["epsilon"],
        delta=options["delta"],
        beta=options["beta"],
        use_bias_correction_kl=options["use_bias_correction_kl"],
        importance_sampling_level=options["importance_sampling_level"],
        sapo_temperature_pos=options["sapo_temperature_pos"],
        sapo_temperature_neg=options["sapo_temperature_neg"],
        vespo_k_pos=options["vespo_k_pos"],
        vespo_lambda_pos=options["vespo_lambda_pos"],
        vespo_k_neg=options["vespo_k_neg"],
        vespo_lambda_neg=options["vespo_lambda_neg"],
        entropy_coef=options["entropy_coef"],
        max_completion_length=MAX_COMPLETION,
        gradient_accumulation_steps=trainer.current_gradient_accumulation_steps,
        steps_per_generation=trainer.args.steps_per_generation,
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_grpo_loss_option_agrees_with_trl(variant, options_setup):
    s, batch = options_setup
    trainer = s.trainer
    options = {**BASE_OPTIONS, **VARIANTS[variant]}
    _configure_trl(trainer, options)
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    trl_loss = trainer._compute_loss(trainer.model, batch)
    trl_loss.backward()
    trl_grads = _grads(trainer.model)
    trl_metrics = _trl_metrics(trainer)
    trainer.model.zero_grad(set_to_none=True)

    settings = _collage_settings(options, trainer)
    logps, entropy = s.logps(entropy_grad=settings.entropy_coef != 0.0)
    entropy_mask = None
    if options["top_entropy_quantile"] < 1.0:
        entropy_mask = alg.high_entropy_mask(entropy.detach(), s.mask, options["top_entropy_quantile"])
        kept = int(entropy_mask.sum())
        assert 0 < kept < int(s.mask.sum())  # the mask does select
    out = alg.grpo_loss(
        logps,
        batch["old_per_token_logps"],
        batch["advantages"],
        s.mask,
        settings,
        ref_logps=batch["ref_per_token_logps"],
        num_items_in_batch=batch["num_items_in_batch"],
        entropies=entropy,
        entropy_mask=entropy_mask,
    )
    if options["delta"] is not None:  # the cap binds somewhere, or the case would test nothing
        assert bool((out.ratio.detach() >= options["delta"] - 1e-7).any())
    assert abs(out.loss.item() - trl_loss.item()) <= TOL, (out.loss.item(), trl_loss.item())
    out.loss.backward()
    _assert_grads_equal(_grads(trainer.model), trl_grads)
    _assert_metrics_equal(loss_metrics(out, entropy.detach(), s.mask, settings.entropy_coef), trl_metrics)


# ----------------------------------------------------------- accumulation window x steps_per_generation
@pytest.mark.parametrize("loss_types", [("dapo", "grpo", "cispo")])
def test_accumulation_window_agrees_with_trl(loss_types, tiny_model_dir, tmp_path, monkeypatch):
    """gradient_accumulation_steps 2, steps_per_generation 4: one generation batch of 8 completions (2 prompts x 4)
    shuffled and cut by TRL's own ``_prepare_inputs`` into 4 micro-batches of 2, i.e. 2 accumulation windows; the
    policy moves after generation, so old log-probs are in play. dapo/cispo divide by the generation batch's tokens
    rescaled to one window; grpo divides by the accumulation steps."""
    import trl.trainer.grpo_trainer as grpo_module

    shuffle_seed = 11
    real_shuffle = grpo_module.shuffle_sequence_dict

    def seeded_shuffle(d):
        torch.manual_seed(shuffle_seed)
        return real_shuffle(d)

    monkeypatch.setattr(grpo_module, "shuffle_sequence_dict", seeded_shuffle)
    gas, spg, size = 2, 4, 2
    s = _setup(
        "grpo",
        tiny_model_dir,
        tmp_path,
        4,
        2,
        False,
        beta=0.04,
        per_device_train_batch_size=size,
        gradient_accumulation_steps=gas,
        steps_per_generation=spg,
    )
    trainer = s.trainer
    trainer._buffered_inputs = None
    trainer._step = 0
    trainer._prepare_inputs(s.inputs)  # generation, scoring, shuffle, split into steps_per_generation parts
    micro_batches = list(trainer._buffered_inputs)
    assert len(micro_batches) == spg and all(len(mb["advantages"]) == size for mb in micro_batches)
    _perturb(trainer.model, seed=5)

    # Collage's side: its own shuffle and slicing of the same generation batch (the trainer's code path)
    torch.manual_seed(shuffle_seed)
    order = torch.randperm(s.batch.batch_size).tolist()
    shuffled = s.batch.select(order, s.family.layout)
    rewards, _ = alg.combine_rewards(s.rewards_per_func(), torch.tensor(WEIGHTS))
    adv = alg.grpo_advantages(rewards, 4).advantages[order]
    old_all = s.gen_logps[order]
    with torch.no_grad():
        ref_all = completion_logprobs(trainer.ref_model, shuffled, s.family, s.image_id, s.temperature)
    num_items = s.mask.sum()
    assert num_items == micro_batches[0]["num_items_in_batch"]

    for loss_type in loss_types:
        _configure_trl(trainer, {**BASE_OPTIONS, "loss_type": loss_type})
        settings = dataclasses.replace(
            _collage_settings({**BASE_OPTIONS, "loss_type": loss_type}, trainer),
            gradient_accumulation_steps=gas,
            steps_per_generation=spg,
        )
        for window in range(spg // gas):
            ks = range(window * gas, (window + 1) * gas)
            trl_losses, trl_grads = _trl_window(trainer, micro_batches, ks)
            for i, k in enumerate(ks):
                lo, hi = k * size, (k + 1) * size
                part = shuffled.slice(lo, hi, s.family.layout)
                mask = part.completion_mask.float()
                assert torch.equal(part.completion_ids, micro_batches[k]["completion_ids"])
                assert torch.allclose(adv[lo:hi], micro_batches[k]["advantages"], atol=TOL)
                assert torch.allclose(old_all[lo:hi] * mask, micro_batches[k]["old_per_token_logps"] * mask, atol=TOL)
                logps, _ = completion_logprobs_and_entropy(trainer.model, part, s.family, s.image_id, s.temperature)
                out = alg.grpo_loss(logps, old_all[lo:hi], adv[lo:hi], mask, settings, ref_logps=ref_all[lo:hi],
                                    num_items_in_batch=num_items)  # fmt: skip
                assert abs(out.loss.item() - trl_losses[i]) <= TOL, (loss_type, k, out.loss.item(), trl_losses[i])
                out.loss.backward()
            _assert_grads_equal(_grads(trainer.model), trl_grads)
            trainer.model.zero_grad(set_to_none=True)


def _trl_window(trainer, micro_batches, ks) -> tuple[list[float], dict]:
    """TRL's losses and summed gradients over one accumulation window (micro-batches ``ks``); grads zeroed after."""
    trainer.model.zero_grad(set_to_none=True)
    losses = []
    for k in ks:
        loss = trainer._compute_loss(trainer.model, micro_batches[k])
        loss.backward()
        losses.append(loss.item())
    grads = _grads(trainer.model)
    trainer.model.zero_grad(set_to_none=True)
    return losses, grads


# ----------------------------------------------------------------------------------------- sync_ref_model
def _train_config(tmp_path, rows, **train):
    from collage.training.config import parse_config

    data = tmp_path / "data"
    (data / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for k, count in enumerate(rows):
        content, names = [], []
        for i in range(count):
            name = f"images/r{k}-{i}.png"
            _images(1, k + i)[0].save(data / name)
            names.append(name)
            content.append({"type": "image"})
        content.append({"type": "text", "text": f"Row {k}: how many of these are red? ({count} images)"})
        lines.append(json.dumps({"prompt": [{"role": "user", "content": content}], "images": names, "key": k}))
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    base = dict(
        max_steps=1,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_prompt_length=256,
        max_completion_length=MAX_COMPLETION,
        temperature=0.9,
    )
    return parse_config(
        {
            "model": {"path": f"tiny:{FAMILY}", "dtype": "float32"},
            "dataset": {"source": str(data / "train.jsonl")},
            "rewards": [
                {"name": "tests.training.test_trl_agreement:keyed_reward"},
                {"name": "tests.training.test_trl_agreement:sometimes_none", "weight": 0.5},
            ],
            "train": {**base, **train},
            "logging": {"samples_every": 0},
            "resources": {"gpus": 0},
        }
    )


def keyed_reward(completions, completion_ids, key, **kwargs):
    """Depends on the row (``key`` column) and the exact completion tokens: a row that travels with another row's
    reward, or a reward read back for the wrong row, shows."""
    return [((sum(ids) * 7 + k * 13) % 11) / 10 for ids, k in zip(completion_ids, key, strict=True)]


def sometimes_none(completions, completion_ids, key, **kwargs):
    return [None if (len(ids) + k) % 3 == 0 else (len(ids) % 4) / 3 for ids, k in zip(completion_ids, key, strict=True)]


def test_sync_ref_model_matches_trls_callback(tmp_path):
    """TR-DPO: with ref_model_sync_steps 2 the reference mixes in the policy after steps 2 and 4, never after 1
    and 3, exactly as TRL's ``SyncRefModelCallback`` updates it."""
    from trl.trainer.callbacks import SyncRefModelCallback

    from collage.training.callbacks import Callback
    from collage.training.trainer import Trainer

    config = _train_config(
        tmp_path, [1, 0, 2, 1], max_steps=4, beta=0.1, sync_ref_model=True, ref_model_sync_steps=2,
        ref_model_mixup_alpha=0.3,
    )  # fmt: skip
    policies = []

    class Record(Callback):
        def on_metrics(self, step, metrics):
            policy = trainer.accelerator.unwrap_model(trainer.model)
            policies.append({n: p.detach().clone() for n, p in policy.named_parameters()})

    trainer = Trainer(config, None, [Record()])
    trainer.setup()
    assert trainer.ref_model is not None
    expected = copy.deepcopy(trainer.ref_model)  # the initial policy
    initial = {n: p.detach().clone() for n, p in expected.named_parameters()}
    trainer.train()
    for step, state in enumerate(policies, start=1):
        if step % 2 == 0:
            policy = copy.deepcopy(expected)
            policy.load_state_dict(state, strict=False)
            SyncRefModelCallback._sync_target_model(policy, expected, 0.3)
    moved = 0
    for (name, ours), (_, theirs) in zip(
        trainer.ref_model.named_parameters(), expected.named_parameters(), strict=True
    ):
        assert torch.allclose(ours, theirs, atol=1e-7, rtol=0), name
        moved += int(not torch.equal(ours, initial[name]))
    assert moved > 0


# ------------------------------------------------------------- Collage's trainer, end to end, per sample
def test_trainer_shuffle_and_slices_keep_each_rows_advantage_logps_and_pixels(tmp_path):
    """One generation batch of Collage's trainer (4 prompts x 4 completions: 0, 1 and 2 images, shuffled and cut
    into 4 micro-batches, old and reference log-probs recorded) checked row by row against a recomputation of that
    row alone: its reward from the reward functions, its advantage from its group, its old and reference
    log-probs from a forward of the row by itself, and the first micro-batch's loss gradient from the sum of its
    rows' separate losses."""
    from collage.training.trainer import Trainer

    config = _train_config(tmp_path, [0, 1, 2, 1, 0, 2], steps_per_generation=4, beta=0.04, loss_type="dapo")
    trainer = Trainer(config, None, [])
    trainer.setup()
    gen = trainer._generate_and_score()
    batch = gen.batch
    t = config.train
    assert gen.old_logps is not None and gen.ref_logps is not None  # generation spans several optimizer steps
    assert batch.batch_size == t.generation_batch_size == 16
    assert len(set(batch.rows)) == 4 and batch.rows != sorted(batch.rows)  # 4 prompts, shuffled
    assert 0 in batch.num_images  # a text-only prompt is in the mix

    prompt_len = batch.prompt_length
    completions, samples = [], []
    for j in range(batch.batch_size):
        keep = batch.attention_mask[j, prompt_len:].bool()
        completions.append(batch.input_ids[j, prompt_len:][keep].tolist())
        samples.append(trainer.dataset.rows[batch.rows[j]].to_sample())

    _assert_advantages_by_hand(gen, completions, [s.columns["key"] for s in samples], t.num_generations)

    # old and reference log-probs: each row forwarded alone (its own pixels, no padding)
    pad = trainer.tokenizer.pad_token_id
    singles = [
        collate([trainer.encoder.encode(samples[j])], trainer.family, pad, [completions[j]], trainer.encoder.protected)
        for j in range(batch.batch_size)
    ]

    def alone(model, j):
        return completion_logprobs(model, singles[j], trainer.family, trainer.image_token_id, t.temperature)

    policy = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        old_alone = [alone(policy, j) for j in range(batch.batch_size)]
        ref_alone = [alone(trainer.ref_model, j) for j in range(batch.batch_size)]
    assert gen.num_items.item() == sum(int(single.completion_mask.sum()) for single in singles)
    for j, single in enumerate(singles):
        n = len(completions[j])
        mask = single.completion_mask[0].bool()
        assert torch.equal(batch.completion_mask[j, :n].bool(), mask), j
        assert torch.allclose(gen.old_logps[j, :n][mask], old_alone[j][0][mask], atol=TOL), j
        assert torch.allclose(gen.ref_logps[j, :n][mask], ref_alone[j][0][mask], atol=TOL), j

    # the first micro-batch's gradient = the sum of its rows' own dapo losses
    policy.zero_grad(set_to_none=True)
    metrics = trainer.optimization.micro_step(gen, 0, sync=True)
    ours = _grads(policy)
    policy.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for j in range(t.per_device_train_batch_size):
        advantage = torch.tensor([gen.advantages[j].item()])
        out = alg.grpo_loss(alone(policy, j), old_alone[j], advantage, singles[j].completion_mask.float(),
                            trainer.loss_settings, ref_logps=ref_alone[j], num_items_in_batch=gen.num_items.item())  # fmt: skip
        total = total + out.loss
    total.backward()
    _assert_grads_equal(ours, _grads(policy))
    assert abs(metrics["loss"] - total.item()) <= TOL


def _assert_advantages_by_hand(gen, completions, keys, num_generations) -> None:
    """Each row's reward from the reward functions and its advantage from its group (the rows of its prompt)."""
    batch = gen.batch
    first = keyed_reward(None, completions, keys)
    second = sometimes_none(None, completions, keys)
    totals = [a + 0.5 * b if b is not None else a for a, b in zip(first, second, strict=True)]
    for j in range(batch.batch_size):
        group = [totals[i] for i in range(batch.batch_size) if batch.rows[i] == batch.rows[j]]
        assert len(group) == num_generations
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        expected = (totals[j] - mean) / (std + alg.STD_EPS)
        assert abs(gen.advantages[j].item() - expected) <= TOL, (j, gen.advantages[j].item(), expected)
