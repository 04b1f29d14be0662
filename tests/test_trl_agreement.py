"""Collage's advantages and losses agree with TRL's own trainers on the same model and batch.

TRL (dev extra only; ``training/`` never imports it) prepares a generation batch through its real
``_generate_and_score_completions`` (generation itself replaced by fixed completions, so both sides see the
same tokens) and computes its loss with its real ``_compute_loss``. Collage computes the same from its own
encoder, collate and log-prob path plus ``training.algorithms``. Multi-image prompts (1 and 2 images), a
reward function that returns ``None``, a group whose rewards are all equal, ``num_iterations > 1`` and
``beta > 0`` are all covered. Tolerance 1e-5 in float32.
"""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

from collage.training import algorithms as alg
from collage.training.batching.inputs import PromptEncoder, collate, completion_logprobs
from collage.training.data.rows import Sample

TOL = 1e-5
G = 4  # generations per prompt

# rewards[func][completion]; None = not applicable. Group 0 has all-equal totals (zero std).
REWARDS = [
    [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, None, 0.5],
    [0.5, 0.5, 0.5, 0.5, None, 0.2, None, 0.9],
]
WEIGHTS = [1.0, 0.5]


def _images(n, seed):
    colours = [(200, 30, 30), (30, 30, 200), (30, 160, 30)]
    return [Image.new("RGB", (56, 56), colours[(seed + i) % 3]) for i in range(n)]


def _rows():
    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many are red?"}]}]
    two = [
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
    return [(one, _images(1, 0)), (two, _images(2, 1))]


def _completions(tokenizer, eos):
    """Completions ending in EOS, or running to the full length (TRL's RLOO masks by EOS position)."""
    words = tokenizer.encode(" one two three four five six seven", add_special_tokens=False)
    full = 6
    out = []
    for i in range(2 * G):
        n = 1 + i % full
        ids = (words * 3)[i : i + n]
        out.append(ids + [eos] if n < full else (words * 3)[i : i + full])
    return out


def _reward_funcs():
    def first(prompts, completions, **kwargs):
        return list(REWARDS[0])

    def second(prompts, completions, **kwargs):
        return list(REWARDS[1])

    return [first, second]


def _perturb(model, seed):
    """Move the policy away from where the batch was generated, so ratios (and KL) are not trivially 1 (0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)


def _build_trl(kind, model_dir, tmp_path, **settings):
    import datasets
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    dataset = datasets.Dataset.from_list([{"prompt": "unused"}])
    common = dict(
        output_dir=str(tmp_path / kind),
        per_device_train_batch_size=2 * G,
        num_generations=G,
        max_completion_length=6,
        report_to="none",
        use_cpu=True,
        bf16=False,
        temperature=0.7,
        reward_weights=WEIGHTS,
        **settings,
    )
    if kind == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(
            model=model,
            reward_funcs=_reward_funcs(),
            args=GRPOConfig(**common),
            train_dataset=dataset,
            processing_class=processor,
        )
    else:
        from trl import RLOOConfig, RLOOTrainer

        trainer = RLOOTrainer(
            model=model,
            reward_funcs=_reward_funcs(),
            args=RLOOConfig(**common),
            train_dataset=dataset,
            processing_class=processor,
        )
    trainer.current_gradient_accumulation_steps = 1
    return trainer, processor


def _run_trl(kind, trainer, prompt_ids, completion_ids, texts, rows):
    n = len(completion_ids)
    if kind == "grpo":
        trainer._generate = lambda prompts: (prompt_ids, completion_ids, None, texts, None, {}, None, [[]] * n)
    else:
        trainer._generate = lambda prompts: (prompt_ids, completion_ids, texts)
    inputs = [{"prompt": prompt, "images": images} for prompt, images in rows for _ in range(G)]
    trainer.model.train()
    batch = trainer._generate_and_score_completions(inputs)
    return batch


CASES = [
    ("grpo", dict(loss_type="grpo", beta=0.0, num_iterations=1, scale_rewards="group")),
    ("grpo", dict(loss_type="bnpo", beta=0.0, num_iterations=2, scale_rewards="batch")),
    ("grpo", dict(loss_type="dr_grpo", beta=0.04, num_iterations=1, scale_rewards="none")),
    ("grpo", dict(loss_type="dapo", beta=0.04, num_iterations=2, scale_rewards="group", epsilon_high=0.28)),
    ("rloo", dict(beta=0.0, num_iterations=1, normalize_advantages=False)),
    ("rloo", dict(beta=0.05, num_iterations=2, normalize_advantages=True)),
]


@pytest.mark.parametrize(
    "kind,settings", CASES, ids=[f"{k}-{'-'.join(f'{a}={b}' for a, b in s.items())}" for k, s in CASES]
)
def test_advantages_and_loss_agree_with_trl(kind, settings, tiny_model_dir, tmp_path):
    model_dir = str(tiny_model_dir("qwen2-vl"))
    torch.manual_seed(0)
    trainer, processor = _build_trl(kind, model_dir, tmp_path, **settings)
    tokenizer = processor.tokenizer
    from collage.training.models.families import family_by_name

    family = family_by_name("qwen2-vl")
    encoder = PromptEncoder(processor, family)
    rows = _rows()
    encoded = [encoder.encode(Sample(i, prompt, images)) for i, (prompt, images) in enumerate(rows)]
    prompts = [e for e in encoded for _ in range(G)]
    eos = trainer.model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    completions = _completions(tokenizer, eos)
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]

    trl_batch = _run_trl(kind, trainer, [list(p.input_ids) for p in prompts], completions, texts, rows)

    # ---- advantages from the same rewards
    rewards_per_func = torch.tensor([[math.nan if v is None else v for v in col] for col in REWARDS]).T
    rewards, _ = alg.combine_rewards(rewards_per_func, torch.tensor(WEIGHTS))
    ours_batch = collate(prompts, family, tokenizer.pad_token_id, completions)
    mask = ours_batch.completion_mask.float()
    image_id = encoder.image_token_id
    temperature = trainer.temperature
    with torch.no_grad():
        gen_logps = completion_logprobs(trainer.model, ours_batch, family, image_id, temperature)
    if kind == "grpo":
        adv = alg.grpo_advantages(rewards, G, settings["scale_rewards"]).advantages
    else:
        if settings["beta"] > 0:
            with torch.no_grad():  # TRL folds the KL into the rewards and keeps no ref log-probs: use its ref model
                ref_logps_gen = completion_logprobs(trainer.ref_model, ours_batch, family, image_id, temperature)
            rewards = rewards - settings["beta"] * alg.sequence_kl_penalty(gen_logps, ref_logps_gen, mask)
        adv = alg.rloo_advantages(rewards, G, settings["normalize_advantages"]).advantages
    assert torch.allclose(adv, trl_batch["advantages"], atol=TOL, rtol=0), (adv, trl_batch["advantages"])
    assert adv[:G].abs().max() < TOL or kind == "rloo"  # group 0: zero std, zero advantage in GRPO

    # ---- the loss, after the policy has moved (num_iterations > 1) or with a KL term
    if settings["num_iterations"] > 1 or settings["beta"] > 0:
        _perturb(trainer.model, seed=1)
    trainer.model.zero_grad(set_to_none=True)
    trl_loss = trainer._compute_loss(trainer.model, trl_batch)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)

    logps = completion_logprobs(trainer.model, ours_batch, family, image_id, temperature)
    old = trl_batch.get("old_per_token_logps")
    if kind == "grpo":
        out = alg.grpo_loss(
            logps,
            old,
            adv,
            mask,
            settings["loss_type"],
            epsilon_low=trainer.epsilon_low,
            epsilon_high=trainer.epsilon_high,
            beta=settings["beta"],
            ref_logps=trl_batch.get("ref_per_token_logps"),
            max_completion_length=6,
            num_items_in_batch=trl_batch["num_items_in_batch"],
            gradient_accumulation_steps=1,
            steps_per_generation=trainer.args.steps_per_generation,
        )
        if old is not None:  # TRL's old log-probs were computed on our exact tokens and pixels
            assert torch.allclose(old * mask, gen_logps * mask, atol=TOL)
    else:
        out = alg.rloo_loss(logps, gen_logps, adv, mask, trainer.epsilon_low, trainer.epsilon_high)
    assert abs(out.loss.item() - trl_loss.item()) <= TOL, (out.loss.item(), trl_loss.item())
    # the value of an on-policy surrogate is ~0 by construction; the gradient is what trains, so compare it too
    out.loss.backward()
    ours = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert ours.keys() == trl_grads.keys()
    assert max(g.abs().max().item() for g in trl_grads.values()) > 1e-4, "a zero gradient would agree trivially"
    for name, grad in trl_grads.items():
        diff = (ours[name] - grad).abs().max().item()
        assert torch.allclose(ours[name], grad, atol=TOL, rtol=1e-4), (name, diff, grad.abs().max().item())
