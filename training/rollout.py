"""Rollouts: a generation batch's prompts turned into a scored, shuffled :class:`GenerationBatch`.

The prompts (each repeated ``num_generations`` times, one group) are sampled from the policy, their old-policy and
reference log-probs recorded where the loss needs them, every completion scored by every reward, the rewards of all
processes turned into advantages, and the rows shuffled (and, where the loss allows, regrouped) before the trainer
cuts them into micro-batches. The step's generation metrics and the rollout rows the callbacks log come with it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from . import algorithms as alg
from .batching.batch import ModelBatch, collate
from .batching.buckets import block_micro_batches, bucket_rows, composition_invariant
from .batching.encoding import EncodedPrompt, PromptEncoder
from .callbacks import RolloutImage, RolloutRow
from .config import RunConfig, TrainSettings
from .data.rows import Sample, image_source
from .forward_passes import ForwardPasses, batch_to_device
from .generation import Completions, Sampling
from .generation import backend as generation_backend
from .generation import generate as hf_generate
from .generation import resume as resume_generation
from .generation_batch import GenerationBatch
from .models.families import Family
from .rewards import Reward, RewardBatch, score
from .sharding import gathered
from .step_metrics import float_or_none, to_float
from .tools.multiturn import MultiTurnEngine, Trajectory, TurnLimits
from .tools.report import tool_metrics, tool_stats, trajectory_turns


def reward_batch(
    repeated: list[Sample],
    texts: list[str],
    completion_ids: list[list[int]],
    trajectories: list[Trajectory] | None = None,
) -> RewardBatch:
    """What the reward functions see for these completions (each sample repeated once per completion); with
    ``trajectories`` (a run with tools) also every rollout's turns and environment."""
    columns = {k: [s.columns.get(k) for s in repeated] for k in sorted({k for s in repeated for k in s.columns})}
    return RewardBatch(
        prompts=[s.prompt for s in repeated],
        completions=texts,
        completion_ids=completion_ids,
        images=[s.images for s in repeated],
        columns=columns,
        rows=[s.row for s in repeated],
        trajectories=None if trajectories is None else [t.turns for t in trajectories],
        environments=None if trajectories is None else [t.environment for t in trajectories],
    )


def turn_limits(t: TrainSettings, evaluation: bool = False) -> TurnLimits:
    """A rollout's limits in training, or in an evaluation (``eval_max_tool_calling_iterations``)."""
    iterations = t.max_tool_calling_iterations
    if evaluation and t.eval_max_tool_calling_iterations is not None:
        iterations = t.eval_max_tool_calling_iterations
    return TurnLimits(iterations, t.max_images_per_rollout, t.max_completion_length)


def multi_turn(
    engine: MultiTurnEngine,
    policy: Any,
    samples: list[Sample],
    encoded: list[EncodedPrompt],
    prompt_batch: ModelBatch,
    num_generations: int,
    limits: TurnLimits,
    generate: Any,
    vision: Any,
    to_device: Any,
    resume: Any = None,
) -> tuple[ModelBatch, list[Trajectory]]:
    """Multi-turn rollouts of ``samples`` (``prompt_batch``: their distinct prompts on the device) and the batch the
    loss forwards take: each rollout's prompt with all its images, its whole tail as the completion, only the
    generated tokens counted (``generate(batch, num_generations, max_new_tokens, encoder_outputs)`` samples a turn,
    ``vision(batch)`` gives a batch's cached vision features; ``resume(state, rows, batch, max_new_tokens,
    encoder_outputs)``, when given, continues a turn from the cache the one before kept, and ``generate`` is then
    expected to keep it)."""
    family = engine.family
    first = generate(prompt_batch, num_generations, limits.max_completion_length, vision(prompt_batch))
    later = None if resume is None else (lambda st, rows, b, n: resume(st, rows, b, n, vision(b)))
    trajectories = engine.run(
        samples, encoded, num_generations, limits, first, lambda b, g, n: generate(b, g, n, vision(b)), to_device,
        later,
    )  # fmt: skip
    batch = collate(
        [t.as_prompt(family) for t in trajectories],
        family,
        engine.tokenizer.pad_token_id,
        [t.tail for t in trajectories],
        engine.encoder.protected,
        generated=[t.generated for t in trajectories],
        tool_images=[t.tool_image_count for t in trajectories],
    )
    return batch, trajectories


def turn_samplers(
    backend: Any, policy: Any, family: Any, tokenizer: Any, image_token_id: int, protected: set[int], sampling: Any
) -> tuple[Any, Any]:
    """The ``generate`` and ``resume`` that :func:`multi_turn` takes, for ``policy`` with a generation backend:
    the built-in one keeps each turn's KV cache and continues the next turn from it; another backend gets each
    later turn as a new prompt (``resume`` None)."""
    continues = backend is hf_generate
    extra = {"keep_cache": True} if continues else {}

    def generate(batch: ModelBatch, g: int, max_new: int, features: Any) -> Completions:
        return backend(policy, batch, g, family, tokenizer, image_token_id, protected, max_new, sampling, features,
                       **extra)  # fmt: skip

    def resume(state: Any, rows: list[int], batch: ModelBatch, max_new: int, features: Any) -> Completions:
        return resume_generation(policy, state, rows, batch, family, tokenizer, image_token_id, protected, max_new,
                                 sampling, features)  # fmt: skip

    return generate, (resume if continues else None)


def rollout_image(image: Any) -> RolloutImage:
    """A dataset PNG keeps the hash and bytes it was loaded with (nothing encoded or hashed here); any other
    image is PNG-encoded lazily, by whoever writes the row (the output folder's or the store's writer thread)."""
    source = image_source(image)
    if source is not None and source.png is not None:
        return RolloutImage(source.sha256, source.png, image.width, image.height)
    return RolloutImage(None, None, image.width, image.height, image=image)


def training_sampling(t: TrainSettings) -> Sampling:
    """How training completions are sampled (TRL's settings and meanings)."""
    return Sampling(t.temperature, t.top_p, t.top_k, t.min_p, t.repetition_penalty)


@dataclass
class Scores:
    """A generation batch's rewards and advantages. ``local``: this process's completions' reward values, one
    column per reward; the rest cover every process's completions (gathered, process by process)."""

    local: torch.Tensor  # (n_local, R)
    per_func: torch.Tensor  # (N, R), NaN where a reward did not score a completion
    weights: torch.Tensor  # (R,)
    unscorable: torch.Tensor  # (N,) completions no reward scored
    advantages: alg.Advantages
    kl_seq: torch.Tensor | None  # (N,) RLOO's per-sequence KL penalty, when beta > 0


class Rollouts:
    """Generates and scores the generation batches of a run.

    ``model``: the policy as the accelerator prepared it; ``ref_model``: the separate reference model when
    ``beta > 0`` without LoRA (with LoRA the reference is the policy with its adapters disabled). ``num_tokens``:
    the prompt and completion tokens of every generation batch so far (logged, and kept by checkpoints).
    """

    def __init__(
        self,
        config: RunConfig,
        accelerator: Any,
        model: Any,
        ref_model: Any | None,
        uses_lora: bool,
        encoder: PromptEncoder,
        tokenizer: Any,
        family: Family,
        rewards: list[Reward],
        passes: ForwardPasses,
        engine: MultiTurnEngine | None = None,
    ):
        self.config = config
        self.accelerator = accelerator
        self.model = model
        self.ref_model = ref_model
        self.uses_lora = uses_lora
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.family = family
        self.rewards = rewards
        self.passes = passes
        self.engine = engine  # multi-turn rollouts (a run with tools or an environment); None: one turn each
        self.rank = accelerator.process_index
        self.num_tokens = 0.0

    def generate_and_score(self, samples: list[Sample], step: int, timings: dict[str, float]) -> GenerationBatch:
        """The generation batch of ``samples`` (this process's prompts), drawn at optimizer step ``step``; the time
        spent sampling and scoring is added to ``timings`` (``timing/generation``, ``timing/rewards``)."""
        t = self.config.train
        repeated: list[Sample] = [s for s in samples for _ in range(t.num_generations)]
        with gathered(self.model):  # sharded: the full policy once for the whole generation batch, not per token
            batch, completions, truncated, trajectories = self._generate(samples, timings)
            old_logps = self._old_logps(batch)
        ref_logps = self._reference_logps(batch)  # after the policy's weights are sharded again
        if trajectories is None:
            texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completions.ids]
        else:
            texts = [traj.completion_text for traj in trajectories]
        mask = batch.completion_mask.float()
        scores = self._score(repeated, texts, completions, mask, old_logps, ref_logps, timings, trajectories)
        n_local = len(texts)
        mine = slice(self.rank * n_local, (self.rank + 1) * n_local)
        num_items = self.accelerator.gather(mask.sum().reshape(1)).sum()

        lengths = torch.tensor([len(ids) for ids in completions.ids], device=self.accelerator.device)
        metrics = self._generation_metrics(scores, batch, lengths, truncated, mask)
        if trajectories is not None:
            metrics.update(self._tool_metrics(trajectories, scores.per_func))
        rows = self._rollout_rows(repeated, texts, completions, scores.per_func[mine], scores.advantages, mine, step)
        if trajectories is not None and rows:
            cache: dict[int, RolloutImage] = {}
            for row, traj in zip(rows, trajectories, strict=True):
                row.trajectory = trajectory_turns(traj, lambda im: cache.setdefault(id(im), rollout_image(im)))
        order = self._micro_batch_order(batch, lengths)
        pick = torch.as_tensor(order, device=self.accelerator.device)
        return GenerationBatch(
            batch=batch.select(order, self.family.layout),
            advantages=scores.advantages.advantages[mine].to(self.accelerator.device)[pick],
            old_logps=None if old_logps is None else old_logps[pick],
            ref_logps=None if ref_logps is None else ref_logps[pick],
            num_items=num_items,
            metrics=metrics,
            rows=rows,
        )

    def _to_device(self, batch: ModelBatch) -> ModelBatch:
        return batch_to_device(batch, self.accelerator.device, next(self.model.parameters()).dtype)

    def _tool_metrics(self, trajectories: list[Trajectory], per_func: torch.Tensor) -> dict[str, float]:
        assert self.engine is not None
        names = self.engine.tool_names
        stats = self.accelerator.gather(tool_stats(trajectories, names).to(self.accelerator.device))
        return tool_metrics(stats.cpu(), names, per_func.cpu(), [r.name for r in self.rewards])

    def _generate_multi_turn(
        self, samples: list[Sample], encoded: list[EncodedPrompt], prompt_batch: ModelBatch, policy: Any
    ) -> tuple[ModelBatch, Completions, torch.Tensor, list[Trajectory]]:
        assert self.engine is not None
        t = self.config.train
        generate, resume = turn_samplers(
            generation_backend(t.generation_backend), policy, self.family, self.tokenizer,
            self.encoder.image_token_id, self.encoder.protected, training_sampling(t),
        )  # fmt: skip
        batch, trajectories = multi_turn(
            self.engine, policy, samples, encoded, prompt_batch, t.num_generations, turn_limits(t), generate,
            lambda b: self.passes.encoder_outputs(policy, b, self.passes.scope("policy")), self._to_device,
            resume,
        )  # fmt: skip
        completions = Completions([traj.tail for traj in trajectories], [traj.truncated for traj in trajectories])
        truncated = torch.tensor(completions.truncated)
        masked = truncated.clone() if t.mask_truncated_completions else torch.zeros_like(truncated)
        if t.mask_capped_trajectories:
            masked |= torch.tensor([traj.capped for traj in trajectories])
        batch.completion_mask[masked] = 0
        batch.attention_mask[masked, batch.prompt_length :] = 0
        return self._to_device(batch), completions, truncated, trajectories

    def _generate(
        self, samples: list[Sample], timings: dict[str, float]
    ) -> tuple[ModelBatch, Completions, torch.Tensor, list[Trajectory] | None]:
        """Sample ``num_generations`` completions for each prompt: the prompts and their completions as one batch
        on the device, the completions, which of them were truncated (no EOS within the length limit), and with
        tools each rollout's trajectory (the completions are then every token after the prompt)."""
        t = self.config.train
        pad = self.tokenizer.pad_token_id
        encoded = [self.encoder.encode(s) for s in samples]  # each prompt encoded once, then repeated
        prompts: list[EncodedPrompt] = [e for e in encoded for _ in range(t.num_generations)]
        policy = self.accelerator.unwrap_model(self.model)
        self.passes.vision.clear()  # features live for one generation batch (the policy moves between batches)
        tic = time.perf_counter()
        prompt_batch = self._to_device(collate(encoded, self.family, pad))
        if self.engine is not None:
            out = self._generate_multi_turn(samples, encoded, prompt_batch, policy)
            timings["timing/generation"] += time.perf_counter() - tic
            return out
        completions = generation_backend(t.generation_backend)(
            policy,
            prompt_batch,
            t.num_generations,
            self.family,
            self.tokenizer,
            self.encoder.image_token_id,
            self.encoder.protected,
            t.max_completion_length,
            training_sampling(t),
            self.passes.encoder_outputs(policy, prompt_batch, self.passes.scope("policy")),
        )
        timings["timing/generation"] += time.perf_counter() - tic
        batch = collate(prompts, self.family, pad, completions.ids, self.encoder.protected)
        truncated = torch.tensor(completions.truncated)
        if t.mask_truncated_completions:
            batch.completion_mask[truncated] = 0
            batch.attention_mask[truncated, batch.prompt_length :] = 0
        return self._to_device(batch), completions, truncated, None

    def _old_logps(self, batch: ModelBatch) -> torch.Tensor | None:
        """The policy's log-probs at generation time, when the policy moves before the batch is used up (or for
        RLOO's KL penalty); None where not needed."""
        cfg, t = self.config, self.config.train
        generate_every = t.generation_steps * t.num_iterations
        if t.gradient_accumulation_steps % generate_every != 0 or (cfg.algorithm == "rloo" and t.beta > 0):
            return self.passes.batched_logps(self.model, batch, self.passes.scope("policy"))
        return None

    def _reference_logps(self, batch: ModelBatch) -> torch.Tensor | None:
        """The reference's log-probs (when ``beta > 0``): the policy with its adapters off under LoRA, else the
        frozen copy; each gathered once for the batch when sharded."""
        if self.config.train.beta <= 0:
            return None
        if self.uses_lora:
            with gathered(self.model), self.accelerator.unwrap_model(self.model).disable_adapter():
                return self.passes.batched_logps(self.model, batch, self.passes.scope("reference"))
        with gathered(self.ref_model):
            return self.passes.batched_logps(self.ref_model, batch, self.passes.scope("reference"))

    def _score(
        self,
        repeated: list[Sample],
        texts: list[str],
        completions: Completions,
        mask: torch.Tensor,
        old_logps: torch.Tensor | None,
        ref_logps: torch.Tensor | None,
        timings: dict[str, float],
        trajectories: list[Trajectory] | None = None,
    ) -> Scores:
        """Every reward on this process's completions, gathered from all processes, combined into advantages."""
        cfg, t = self.config, self.config.train
        device = self.accelerator.device
        if trajectories is None:
            batch = reward_batch(repeated, texts, completions.ids)
        else:  # rewards see the tokens the model generated, and the whole trajectory
            batch = reward_batch(repeated, texts, [traj.generated_ids for traj in trajectories], trajectories)
        tic = time.perf_counter()
        local = torch.tensor(score(self.rewards, batch), dtype=torch.float32, device=device)
        timings["timing/rewards"] += time.perf_counter() - tic
        if local.dim() == 1:
            local = local.view(len(texts), len(self.rewards))
        weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float32, device=device)
        rewards_per_func = self.accelerator.gather(local)
        rewards, unscorable = alg.combine_rewards(rewards_per_func, weights)
        kl_seq = None
        if cfg.algorithm == "rloo" and t.beta > 0:
            assert old_logps is not None and ref_logps is not None  # computed whenever beta > 0
            kl_seq = self.accelerator.gather(alg.sequence_kl_penalty(old_logps, ref_logps, mask))
            rewards = rewards - t.beta * kl_seq
        if cfg.algorithm == "grpo" and t.multi_objective_aggregation == "normalize_then_sum":
            adv = alg.gdpo_advantages(rewards_per_func, weights, t.num_generations)
        elif cfg.algorithm == "grpo":
            adv = alg.grpo_advantages(rewards, t.num_generations, t.scale_rewards)
        else:
            adv = alg.rloo_advantages(rewards, t.num_generations, t.normalize_advantages)
        return Scores(local, rewards_per_func, weights, unscorable, adv, kl_seq)

    def _generation_metrics(
        self, scores: Scores, batch: ModelBatch, lengths: torch.Tensor, truncated: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """The generation batch's metrics under TRL's names, over every process's completions."""
        metrics: dict[str, float] = {}
        for k, reward in enumerate(self.rewards):
            column = scores.per_func[:, k]
            metrics[f"rewards/{reward.name}/mean"] = to_float(torch.nanmean(column))
            metrics[f"rewards/{reward.name}/std"] = to_float(alg.nanstd(column))
        logged = (scores.per_func * scores.weights.unsqueeze(0)).nansum(dim=1)
        logged[scores.unscorable] = torch.nan
        metrics["reward"] = to_float(torch.nanmean(logged))
        metrics["reward_std"] = to_float(alg.nanstd(logged))
        metrics["frac_reward_zero_std"] = to_float(scores.advantages.zero_std.float().mean())
        lengths = self.accelerator.gather(lengths)
        trunc = self.accelerator.gather(truncated.to(lengths.device).long())
        metrics["completions/mean_length"] = to_float(lengths.float().mean())
        metrics["completions/max_length"] = to_float(lengths.float().max())
        metrics["completions/clipped_ratio"] = to_float(trunc.float().mean())
        tokens = self.accelerator.gather(batch.attention_mask.sum().reshape(1)).sum()
        self.num_tokens += float(tokens)
        metrics["num_tokens"] = self.num_tokens
        images = self.accelerator.gather(torch.tensor([sum(batch.num_images)], device=lengths.device)).sum()
        metrics["num_images"] = to_float(images)
        if scores.kl_seq is not None:
            gathered_mask = self.accelerator.gather(mask.sum(-1))
            metrics["kl"] = to_float(scores.kl_seq.sum() / gathered_mask.sum().clamp(min=1.0))
        return metrics

    def _rollout_rows(
        self,
        repeated: list[Sample],
        texts: list[str],
        completions: Completions,
        rewards_per_func: torch.Tensor,
        adv: alg.Advantages,
        mine: slice,
        step: int,
    ) -> list[RolloutRow]:
        """This process's completions as rollout rows of step ``step + 1``, every ``logging.samples_every`` steps
        (``rewards_per_func``: this process's rows; ``adv``: every process's, ``mine`` the slice of this one's)."""
        t = self.config.train
        if not self.config.logging.samples_every or (step + 1) % self.config.logging.samples_every:
            return []
        names = [r.name for r in self.rewards]
        weights = [r.weight for r in self.rewards]
        cache: dict[int, RolloutImage] = {}
        rows = []
        per_process_groups = len(texts) // t.num_generations
        for i, sample in enumerate(repeated):
            images = []
            for image in sample.images:
                key = id(image)
                if key not in cache:
                    cache[key] = rollout_image(image)
                images.append(cache[key])
            values = [None if math.isnan(v) else v for v in rewards_per_func[i].tolist()]
            scored = [w * v for w, v in zip(weights, values, strict=True) if v is not None]
            gi = mine.start + i
            rows.append(
                RolloutRow(
                    step=step + 1,
                    group=self.rank * per_process_groups + i // t.num_generations,
                    index=i % t.num_generations,
                    prompt=sample.prompt,
                    completion=texts[i],
                    images=images,
                    rewards=dict(zip(names, values, strict=True)),
                    reward=sum(scored) if scored else None,
                    advantage=float(adv.advantages[gi]),
                    completion_length=len(completions.ids[i]),
                    truncated=completions.truncated[i],
                    row=sample.row,
                    columns=sample.columns,  # the dataset row's scalar columns (RolloutRow keeps only those)
                    group_mean=float_or_none(adv.group_mean[gi]),
                    group_std=float_or_none(adv.group_std[gi]),
                )
            )
        return rows

    def _micro_batch_order(self, batch: ModelBatch, lengths: torch.Tensor) -> list[int]:
        """The order of the batch's rows for cutting micro-batches: shuffled so each mixes prompts (and image
        counts), as TRL does; then, where the loss allows, rows regrouped within what one optimizer step takes
        (training.batching.buckets)."""
        cfg, t = self.config, self.config.train
        n_local = batch.batch_size
        order = torch.randperm(n_local).tolist()
        if composition_invariant(cfg.algorithm, t.loss_type, t.entropy_coef, t.top_entropy_quantile):
            block = block_micro_batches(t.gradient_accumulation_steps, t.generation_steps)
            prompt_lengths = batch.attention_mask[:, : batch.prompt_length].sum(-1).tolist()
            order = bucket_rows(order, prompt_lengths, [i // t.num_generations for i in range(n_local)],
                                lengths.tolist(), block * t.per_device_train_batch_size)  # fmt: skip
        return order
