"""The multi-image GRPO / RLOO trainer.

One optimizer step = ``gradient_accumulation_steps`` micro-batches of ``per_device_train_batch_size``
completions. Every ``steps_per_generation x num_iterations`` micro-batches a new *generation batch* is
sampled: ``per_device_train_batch_size x steps_per_generation / num_generations`` prompts per process, each
repeated ``num_generations`` times (one group), scored by every reward, turned into advantages, shuffled and
cut into ``steps_per_generation`` micro-batches that are each used ``num_iterations`` times. This is TRL's
schedule, so TRL settings mean the same here.

The trainer sets a run up (data, checks, model, rewards), runs that schedule, evaluates on held-out rows, and
reports to the callbacks. It hands the parts of a step to collaborators: :class:`~training.data_order.DataOrder`
draws each generation batch's prompts, :class:`~training.rollout.Rollouts` generates and scores them,
:class:`~training.optimization.Optimization` runs the micro-steps and the optimizer step, and
:class:`~training.checkpointing.Checkpointer` saves and restores the run (the model passes they share are
:class:`~training.forward_passes.ForwardPasses`).
"""

from __future__ import annotations

import hashlib
import math
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from . import algorithms as alg
from .batching.batch import ModelBatch, collate
from .batching.encoding import PromptEncoder
from .batching.forward import base_model
from .batching.vision import POLICY, VisionFeatures
from .callbacks import Callback, CallbackList, RolloutImage, RolloutRow
from .checkpoint import rng_state, set_rng_state
from .checkpointing import Checkpointer, TrainerState
from .config import AUTO_FULL_CHECK_ROWS, CHECK_SAMPLE_ROWS, RunConfig, TrainSettings
from .data.check import sample_view
from .data.errors import DatasetError
from .data.heldout import HeldOut, load_heldout, training_rows
from .data.loader import LoadedDataset, load_dataset
from .data.mapping import RowMapping
from .data.rows import Sample
from .data.rowsource import row_ids
from .data_order import DataOrder, DrawCheck
from .evaluation import ScoredCompletion, eval_metric_keys, eval_metrics, weighted_reward
from .forward_passes import ForwardPasses, batch_to_device
from .generation import Completions, Sampling, eos_ids
from .generation import backend as generation_backend
from .generation_batch import GenerationBatch
from .modeling import prepare_policy, reference_model, trainable_vision_params
from .models.loading import load_model, load_processor
from .optimization import Optimization, loss_metrics, loss_settings
from .rewards import Reward, RewardError, resolve_reward, score
from .rollout import Rollouts, multi_turn, reward_batch, rollout_image, turn_limits, turn_samplers
from .sharding import broadcast_from_first, gathered, shard
from .step_metrics import mean_dicts, to_float
from .step_timing import RecentStepTime
from .tools.multiturn import MultiTurnEngine, resolve_run_tools
from .tools.report import eval_tool_metrics, trajectory_turns
from .training_error import TrainingError

# GenerationBatch and TrainingError are part of this module's interface too: checkpoints name the buffer's class
# collage.training.trainer.GenerationBatch (see training.generation_batch), and callers catch TrainingError from here
__all__ = [
    "Evaluation",
    "GenerationBatch",
    "TrainResult",
    "Trainer",
    "TrainingError",
    "loss_metrics",
    "option_warnings",
]


@dataclass
class Evaluation:
    """One evaluation's metrics (keys ``eval/...`` and ``timing/eval``) and its rollout rows (``split = eval``)."""

    metrics: dict[str, float]
    rows: list[RolloutRow]


@dataclass
class TrainResult:
    status: Literal["succeeded", "cancelled"]
    step: int
    metrics: list[dict[str, float]] = field(default_factory=list)


def _zero_timings() -> dict[str, float]:
    return {"timing/generation": 0.0, "timing/rewards": 0.0, "timing/train": 0.0}


class Trainer:
    """A GRPO / RLOO run of ``config``: :meth:`setup` checks and loads everything, :meth:`train` runs it."""

    def __init__(
        self,
        config: RunConfig,
        output_dir: str | Path | None = None,
        callbacks: list[Callback] | None = None,
        resume: bool = False,
        reward_modules: Sequence[str] | None = None,
        data_roots: Sequence[Path] | None = None,
        tool_modules: Sequence[str] | None = None,
    ):
        """``reward_modules``: the operator's allowlist for import-path rewards, for a config an API client sent
        (see :func:`~training.rewards.registry.resolve_reward`); ``None`` trusts the config (local ``collage train``).
        ``tool_modules``: the same for import-path tools and the environment (the operator's COLLAGE_TOOL_MODULES, a
        list of its own; see :mod:`training.tools.registry`); ``None`` trusts the config.
        ``data_roots``: the folders every image path inside a dataset row must lie under (the operator's
        COLLAGE_DATA_ROOTS); ``None`` leaves them unconfined (local ``collage train`` without COLLAGE_DATA_ROOTS).
        """
        self.config = config
        self.reward_modules = tuple(reward_modules) if reward_modules is not None else None
        self.tool_modules = tuple(tool_modules) if tool_modules is not None else None
        self.data_roots = tuple(data_roots) if data_roots is not None else None
        self.out = Path(output_dir) if output_dir is not None else None
        self.callbacks = CallbackList(callbacks or [])
        self.resume = resume
        if resume and self.out is None:
            raise TrainingError("resume needs the output folder that holds the checkpoints")
        self.ready = False
        # warnings found during set-up, reported once the callbacks' run has started (on_start)
        self._pending_events: list[tuple[str, str]] = []
        # where the current step's time goes: sampling, scoring, forward+backward (seconds)
        self.timings: dict[str, float] = _zero_timings()

    def setup(self) -> None:
        """Load data, model, rewards and optimizer, and validate everything; ``train`` calls it if needed."""
        if not self.ready:
            self._setup()
            self.ready = True

    # ---------------------------------------------------------------- set-up
    def _setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        cfg, t = self.config, self.config.train
        cpu = cfg.resources.gpus == 0 or not torch.cuda.is_available()
        self.accelerator = Accelerator(cpu=cpu)
        self.is_main = self.accelerator.is_main_process
        self.world = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        if self.world != cfg.resources.world_size:
            self._pending_events.append(("warning", (
                f"resources asks for {cfg.resources.world_size} training processes but this run has {self.world}: "
                "a worker launches them itself; with collage train, start it under accelerate launch --multi_gpu "
                f"--num_processes {cfg.resources.world_size} (docs/training.md)")))  # fmt: skip
        set_seed(t.seed, device_specific=True)  # sampling differs per process; the data order below does not

        split = self._load_data()  # the whole training split; eval_fraction's rows are taken out below
        self.heldout = self._load_heldout(split)
        held = self.heldout.held_rows if self.heldout is not None else None
        self.dataset = training_rows(split, held) if held else split
        # each host's main process first: `tiny:` models are built into the host's cache on first use, and a process
        # that read the model while another was building it failed ("Unrecognized model"); the others then load it
        # as built (a run on several hosts: each host has its own cache, so per host, not once for the run)
        with self.accelerator.local_main_process_first():
            self.processor, self.family = load_processor(cfg.model.path)
        self.tokenizer = self.processor.tokenizer
        if self.tokenizer.pad_token_id is None:
            raise TrainingError(f"model.path: the tokenizer of {cfg.model.path} has no pad token")
        self.encoder = PromptEncoder(self.processor, self.family, t.max_prompt_length)
        self.image_token_id = self.encoder.image_token_id
        # tools first: their schemas are part of every prompt the row check encodes
        self.run_tools = resolve_run_tools(cfg, self.encoder, self.family, self.tool_modules)
        draw_check = self._validate_rows(split)
        self.data_order = DataOrder(
            self.dataset, t.seed, t.generation_batch_size // t.num_generations, self.world, self.rank, draw_check
        )
        self.rewards = self._load_rewards()
        self._check_best_metric()
        self._load_policy()
        self._build_collaborators()

        self.step = 0
        self.micro = 0
        self.buffer: GenerationBatch | None = None
        self.last_eval_step = -1  # the step of the newest finished evaluation (kept in checkpoints)
        self._best_checked = False
        self.resumed_from = 0
        if self.resume:
            self._restore()

    def _load_policy(self) -> None:
        """The policy (LoRA-wrapped, vision frozen as configured), its reference, optimizer and schedule."""
        cfg, t = self.config, self.config.train
        model = load_model(cfg.model.path, cfg.model.dtype)
        model.generation_config.top_k = None  # sampling is plain temperature sampling unless configured
        self.uses_lora = cfg.model.lora is not None
        self.ref_model = reference_model(model, self.uses_lora) if t.beta > 0 else None
        self.loss_settings = loss_settings(t, self.world)
        self._pending_events.extend(("warning", message) for message in option_warnings(cfg))
        model = prepare_policy(model, cfg.model, t.gradient_checkpointing)
        # FSDP2 (resources.strategy: fsdp) shards before the optimizer is built: it replaces the parameters
        self.sharded = cfg.resources.strategy == "fsdp" and self.world > 1
        if self.sharded:
            fsdp = cfg.resources.fsdp
            if self.uses_lora:  # the adapters start at random, the base weights as read from disk on every process
                broadcast_from_first([p for p in model.parameters() if p.requires_grad], self.accelerator.device)
            shard(base_model(model), fsdp.reshard_after_forward, fsdp.cpu_offload, self.accelerator.device)
            if self.ref_model is not None:
                shard(self.ref_model, True, fsdp.cpu_offload, self.accelerator.device)
        params = [p for p in model.parameters() if p.requires_grad]
        decay = t.weight_decay
        self.optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=decay)
        from transformers import get_scheduler

        self.scheduler = get_scheduler(
            t.lr_scheduler_type, self.optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps
        )
        if self.sharded:  # already placed and sharded: accelerate must not wrap it in DDP as well
            self.model, self.optimizer = model, self.accelerator.prepare(self.optimizer)
        else:
            self.model, self.optimizer = self.accelerator.prepare(model, self.optimizer)
            if self.ref_model is not None:
                self.ref_model.to(self.accelerator.device)
        self.vision_params = trainable_vision_params(self.accelerator.unwrap_model(self.model))

    def _build_collaborators(self) -> None:
        """The collaborators a step is handed to, each given what it works with (they share the model passes)."""
        cfg, t = self.config, self.config.train
        self.passes = ForwardPasses(
            self.family,
            self.image_token_id,
            temperature=t.temperature,
            micro_batch_size=t.per_device_train_batch_size,
            vision_trainable=bool(self.vision_params),
            gradient_checkpointing=t.gradient_checkpointing,
            world=self.world,
        )
        self.engine = None
        if cfg.uses_tools:
            stop = eos_ids(self.accelerator.unwrap_model(self.model), self.tokenizer)
            self.engine = MultiTurnEngine(self.encoder, self.tokenizer, self.family, *self.run_tools, stop)
        self.rollouts = Rollouts(
            cfg,
            self.accelerator,
            self.model,
            ref_model=self.ref_model,
            uses_lora=self.uses_lora,
            encoder=self.encoder,
            tokenizer=self.tokenizer,
            family=self.family,
            rewards=self.rewards,
            passes=self.passes,
            engine=self.engine,
        )
        self.optimization = Optimization(
            cfg,
            self.accelerator,
            self.model,
            self.optimizer,
            self.scheduler,
            settings=self.loss_settings,
            passes=self.passes,
            vision_params=self.vision_params,
            ref_model=self.ref_model,
        )
        self.checkpoints = Checkpointer(
            self.out,
            t,
            self.accelerator,
            self.model,
            self.processor,
            uses_lora=self.uses_lora,
            callbacks=self.callbacks,
            optimizer=self.optimizer,
            ref_model=self.ref_model if t.sync_ref_model else None,
            sharded=self.sharded,
            state_dict_type=cfg.resources.fsdp.state_dict_type,
        )
        # an evaluation's own feature cache: training's (which a generation batch may still need) is never touched
        self.eval_vision = VisionFeatures(self.family)

    def _load_data(self) -> LoadedDataset:
        d = self.config.dataset
        synth = {}
        if d.source.startswith("synth:"):
            synth = dict(rows=d.rows, min_images=d.min_images, max_images=d.max_images, seed=d.seed)
        try:
            dataset = load_dataset(d.source, d.split, data_roots=self.data_roots, mapping=RowMapping.of(d),
                                   config_name=d.config_name, **synth)  # fmt: skip
        except DatasetError as exc:
            raise TrainingError(f"dataset.source: {exc}") from exc
        if len(dataset) == 0:
            raise TrainingError(f"dataset.source: {d.source} split {d.split!r} has no rows")
        return dataset

    def _load_heldout(self, split: LoadedDataset) -> HeldOut | None:
        """The held-out rows (``dataset.eval_split`` / ``eval_source`` / ``eval_fraction``), read and confined like
        the training rows; None when the config names none."""
        d, t = self.config.dataset, self.config.train
        if t.eval_strategy == "no" and not t.eval_on_start and d.eval_fraction is None:
            return None  # held-out data named but never evaluated: nothing to read (eval_fraction still holds out)
        try:
            heldout = load_heldout(d, split, t.eval_max_rows, self.data_roots)
        except (DatasetError, ValueError) as exc:  # a synthetic task's bad options are ValueErrors (SynthError)
            named = [k for k in ("eval_fraction", "eval_source", "eval_split") if getattr(d, k) is not None]
            raise TrainingError(f"dataset.{named[0]}: {exc}") from exc
        if heldout is not None and heldout.held_rows is not None and len(heldout.held_rows) >= len(split):
            raise TrainingError(
                f"dataset.eval_fraction: {d.eval_fraction} of {len(split)} rows holds out every row: nothing is left "
                "to train on"
            )
        return heldout

    def _validate_rows(self, split: LoadedDataset) -> DrawCheck | None:
        """The checks of ``collage data check`` before any compute is spent: on every row (``dataset.check: full``,
        cached per dataset fingerprint, so a start or resume on an unchanged dataset does not decode and encode
        every row again), or on a seeded sample of the split (``sample``: every other row is checked when a batch
        draws it, by the :class:`~training.data_order.DrawCheck` returned; None after a full check)."""
        from .data.check import cached_check, run_check

        cfg, d = self.config, self.config.dataset
        full = d.check == "full" or (d.check == "auto" and len(split) <= AUTO_FULL_CHECK_ROWS)
        self.draw_check = not full
        if full:
            checked = split
            report = cached_check(split, cfg.model.path, cfg.train.max_prompt_length, lambda: self.encoder)
            scope = f"{len(split)} rows"
        else:
            checked = sample_view(split, CHECK_SAMPLE_ROWS, d.seed)
            report = run_check(checked, cfg.model.path, cfg.train.max_prompt_length, self.encoder)
            scope = (
                f"a sample of {len(checked)} of {len(split)} rows (dataset.check: {d.check}; the others are checked "
                "when drawn)"
            )
        bad = report.errors
        if bad and (d.bad_rows == "fail" or len(bad) == len(checked)):
            why = "no row is usable" if len(bad) == len(checked) else "dataset.bad_rows: fail"
            message = f"dataset {split.source}: {len(bad)} of {scope} fail `collage data check` ({why})"
            raise TrainingError(str(DatasetError(message, bad)))
        skipped = {error.row for error in bad}
        good = [r for r in map(int, row_ids(checked.rows)) if r not in skipped]
        counts = dict(zip(good, report.images_per_row, strict=True))
        if bad:  # dataset.bad_rows: skip: the others are used, and each skipped row is named
            self.dataset = training_rows(self.dataset, sorted(skipped))
            shown = "; ".join(str(error) for error in bad[:20]) + ("; ..." if len(bad) > 20 else "")
            self._pending_events.append(
                (
                    "warning",
                    f"dataset {split.source}: {len(bad)} of {scope} skipped (dataset.bad_rows: "
                    f"skip; `collage data check` lists them all): {shown}",
                )  # fmt: skip
            )
        # the image count of each checked training row (every training row after a full check)
        held_out = set(self.heldout.held_rows or []) if self.heldout is not None else set()
        self.images_per_row: list[int] = [n for r, n in counts.items() if r not in held_out]
        self.eval_images_per_row: list[int] = []
        if self.heldout is not None:
            self.eval_images_per_row = self._validate_heldout(self.heldout, counts, skipped)
        needed = self.config.train.generation_batch_size // self.config.train.num_generations * 1
        if len(self.dataset) < needed:
            held = f" once the {len(split) - len(self.dataset)} held-out rows are taken out" if self.heldout else ""
            raise TrainingError(
                f"dataset: {len(self.dataset)} rows{held}, fewer than the {needed} prompts one generation needs"
            )
        if full:
            return None
        # rows a batch may draw without checking them again, and rows known to be bad (skipped above)
        return DrawCheck(self.encoder, set(good), set(skipped), d.bad_rows, self.dataset.source)

    def _validate_heldout(self, heldout: HeldOut, counts: dict[int, int], bad: set[int]) -> list[int]:
        """The data check on the evaluated held-out rows (eval_fraction's were checked with the split when the check
        covered it); their image counts. Held-out rows are never skipped: the evaluation would measure other rows
        than it says."""
        from .data.check import cached_check, run_check

        cfg, t = self.config, self.config.train
        if heldout.held_rows is not None:
            ids = heldout.row_ids
            if t.eval_strategy == "no" and not t.eval_on_start and not all(r in counts or r in bad for r in ids):
                return []  # held out but never evaluated (a sample check): nothing to check them for
            if all(r in counts or r in bad for r in ids):
                unusable = [r for r in ids if r not in counts]
                if unusable:
                    rows = ", ".join(map(str, unusable[:20]))
                    raise TrainingError(f"{heldout.key}: held-out rows fail `collage data check` (rows {rows})")
                return [counts[r] for r in ids]
            evaluated = LoadedDataset(heldout.loaded.source, heldout.loaded.split, heldout.rows,
                                      mapping=heldout.loaded.mapping)  # fmt: skip
            report = run_check(evaluated, cfg.model.path, cfg.train.max_prompt_length, self.encoder)
            if report.errors:
                rows = ", ".join(str(e.row) for e in report.errors[:20])
                raise TrainingError(
                    f"{heldout.key}: held-out rows fail `collage data check` (rows {rows}): {report.errors[0]}"
                )
            return report.images_per_row
        report = cached_check(heldout.loaded, cfg.model.path, cfg.train.max_prompt_length, lambda: self.encoder)
        if report.errors:
            loaded = heldout.loaded
            message = (
                f"{loaded.source} split {loaded.split!r}: {len(report.errors)} of {len(loaded)} held-out rows fail "
                "`collage data check`"
            )
            raise TrainingError(f"{heldout.key}: {DatasetError(message, report.errors)}")
        return [report.images_per_row[p] for p in heldout.positions]

    def _check_best_metric(self) -> None:
        """``metric_for_best_model`` naming an evaluation metric this run never logs is refused before any compute
        (a training metric is checked against the first step's record)."""
        t = self.config.train
        name = t.metric_for_best_model
        if name is None or not name.startswith("eval/"):
            return
        keys = eval_metric_keys(
            [r.name for r in self.rewards], self._pass_reward(), t.eval_num_generations, self.eval_images_per_row
        )
        if name not in keys:
            raise TrainingError(
                f"train.metric_for_best_model: this run logs no {name!r}; its evaluation metrics are "
                + ", ".join(sorted(keys))
            )

    def _pass_reward(self) -> str | None:
        """The reward ``eval/pass@k`` judges by: ``eval_pass_reward``, else ``accuracy`` when the run has it."""
        names = [r.name for r in self.config.rewards]  # as the config names them (an import path, a folder)
        chosen = self.config.train.eval_pass_reward
        chosen = chosen if chosen is not None else ("accuracy" if "accuracy" in names else None)
        return None if chosen is None else self.rewards[names.index(chosen)].name  # as its metrics name it

    def _load_rewards(self) -> list[Reward]:
        rewards = []
        has_images = any(self.images_per_row) or any(self.eval_images_per_row)  # every reward scores both
        for k, spec in enumerate(self.config.rewards):
            try:
                reward = resolve_reward(
                    spec.name,
                    spec.weight,
                    spec.args,
                    reward_modules=self.reward_modules,
                    on_images=spec.on_images_for_text_reward,
                )
            except ValueError as exc:
                raise TrainingError(f"rewards[{k}].name: {exc}") from exc
            if spec.name == "length":
                reward.args.setdefault("max_completion_length", self.config.train.max_completion_length)
            if reward.text_model is not None and has_images:
                rows = sum(1 for n in [*self.images_per_row, *self.eval_images_per_row] if n)
                if spec.on_images_for_text_reward == "error":
                    raise TrainingError(
                        f"rewards[{k}]: {spec.name} is a text reward model and cannot see images, but {rows} dataset "
                        "rows have images. Set on_images_for_text_reward: drop to score their text alone."
                    )
                self._pending_events.append(
                    (
                        "warning",
                        f"rewards[{k}]: images dropped for text reward model {spec.name}: it scores the text of "
                        f"{rows} rows with images without seeing them (on_images_for_text_reward: drop)",
                    )
                )
            rewards.append(reward)
        return rewards

    # ------------------------------------------------------- generate + score
    def _prompts_for_generation(self) -> list[Sample]:
        """This process's prompts for the next generation batch, in the run's seeded data order."""
        return self.data_order.next_prompts()

    def _generate_and_score(self) -> GenerationBatch:
        """The next generation batch: its prompts drawn, sampled, scored and shuffled (training.rollout)."""
        return self.rollouts.generate_and_score(self._prompts_for_generation(), self.step, self.timings)

    def _flush_draw_warnings(self, callbacks: CallbackList) -> None:
        """The bad rows this step's batches drew, from every process, as warning events."""
        if not self.draw_check:
            return
        warnings = self.data_order.take_draw_warnings()
        if self.world > 1:
            from accelerate.utils import gather_object

            warnings = gather_object(warnings)
        for message in warnings:
            callbacks.on_event("warning", message)

    def _to_device(self, batch: ModelBatch) -> ModelBatch:
        return batch_to_device(batch, self.accelerator.device, next(self.model.parameters()).dtype)

    # ------------------------------------------------------------ evaluation
    def _eval_due(self, step: int) -> bool:
        """Whether ``step`` is evaluated: step 0 with ``eval_on_start``; with ``eval_strategy: steps`` every
        ``eval_steps`` steps and after the last step."""
        t = self.config.train
        if self.heldout is None:
            return False
        if step == 0:
            return t.eval_on_start
        return t.eval_strategy == "steps" and (step % t.eval_every == 0 or step == t.max_steps)

    def _eval_sampling(self) -> Sampling:
        """Greedy with one completion per prompt and no ``eval_temperature``; else sampling at ``eval_temperature``
        (or the training ``temperature``) with the training run's other sampling settings."""
        t = self.config.train
        if t.eval_greedy:
            return Sampling(repetition_penalty=t.repetition_penalty, greedy=True)
        temperature = t.eval_temperature if t.eval_temperature is not None else t.temperature
        return Sampling(temperature, t.top_p, t.top_k, t.min_p, t.repetition_penalty)

    def _eval_seed(self) -> int:
        """An evaluation's own seed (per step and process): a sampled evaluation is repeatable, and the training
        stream, saved before and put back after, never sees it."""
        return (self.config.train.seed * 1_000_003 + self.step * 7_919 + self.rank) % 2**32

    def _evaluate(self, callbacks: CallbackList) -> Evaluation | None:
        """Score the held-out prompts with the policy as it is now: this process's share of each batch of
        ``per_device_eval_batch_size`` completions, gathered from every process. None when a cancel came between
        two batches (the evaluation is abandoned: nothing of it is logged)."""
        from accelerate.utils import gather_object, set_seed

        assert self.heldout is not None  # _eval_due
        t = self.config.train
        tic = time.perf_counter()
        rows = self.heldout.rows
        per_process = t.eval_batch_size // t.eval_num_generations
        per_batch = per_process * self.world
        saved = rng_state()
        set_seed(self._eval_seed())
        was_training = self.model.training
        self.model.eval()
        local: list[tuple[RolloutRow, ScoredCompletion]] = []
        try:
            for lo in range(0, len(rows), per_batch):
                if self._stop_requested(callbacks):  # every process asks at the same points (a collective)
                    return None
                first = lo + self.rank * per_process
                mine = list(range(first, min(first + per_process, len(rows))))
                if mine:  # the last batch may leave a process without prompts: it only waits
                    local.extend(self._evaluate_batch(mine, [rows[p] for p in mine]))
        finally:
            set_rng_state(saved)
            self.model.train(was_training)
            self.eval_vision.clear()
        scored = gather_object(local) if self.world > 1 else local
        scored.sort(key=lambda item: (item[1].prompt, item[1].index))
        metrics = eval_metrics(
            [c for _, c in scored],
            [r.name for r in self.rewards],
            [r.weight for r in self.rewards],
            t.eval_num_generations,
            self._pass_reward(),
            t.eval_pass_threshold,
        )
        if self.engine is not None:
            rows_scored = [row for row, _ in scored]
            metrics.update(eval_tool_metrics(rows_scored, self.engine.tool_names, [r.name for r in self.rewards]))
        metrics["timing/eval"] = time.perf_counter() - tic
        self.last_eval_step = self.step
        self.checkpoints.moved_on()  # the state moved on: a checkpoint must record this evaluation
        return Evaluation(metrics, [row for row, _ in scored])

    def _evaluate_batch(self, positions: list[int], raws: list[Any]) -> list[tuple[RolloutRow, ScoredCompletion]]:
        """Generate and score ``eval_num_generations`` completions for each of these held-out rows (at
        ``positions`` in the evaluation); no gradients, the policy in eval mode."""
        t = self.config.train
        g = t.eval_num_generations
        samples = [raw.to_sample() for raw in raws]
        encoded = [self.encoder.encode(s) for s in samples]
        policy = self.accelerator.unwrap_model(self.model)
        sampling = self._eval_sampling()
        backend = generation_backend(t.generation_backend)

        trajectories = None
        with torch.no_grad(), gathered(self.model):  # sharded: the full weights once for the whole batch
            prompts = self._to_device(collate(encoded, self.family, self.tokenizer.pad_token_id))
            self.eval_vision.clear()
            if self.engine is None:
                completions = backend(policy, prompts, g, self.family, self.tokenizer, self.image_token_id,
                                      self.encoder.protected, t.max_completion_length, sampling,
                                      self.eval_vision.encoder_outputs(policy, prompts, POLICY))  # fmt: skip
            else:  # the same turn loop as training, with the evaluation's own turn limit
                generate, resume = turn_samplers(backend, policy, self.family, self.tokenizer, self.image_token_id,
                                                 self.encoder.protected, sampling)  # fmt: skip
                _, trajectories = multi_turn(
                    self.engine, policy, samples, encoded, prompts, g, turn_limits(t, evaluation=True), generate,
                    lambda b: self.eval_vision.encoder_outputs(policy, b, POLICY), self._to_device, resume,
                )  # fmt: skip
                completions = Completions([x.tail for x in trajectories], [x.truncated for x in trajectories])
        repeated = [s for s in samples for _ in range(g)]
        if trajectories is None:
            texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completions.ids]
            values = score(self.rewards, reward_batch(repeated, texts, completions.ids))
        else:
            texts = [x.completion_text for x in trajectories]
            values = score(self.rewards, reward_batch(repeated, texts, [x.generated_ids for x in trajectories],
                                                      trajectories))  # fmt: skip
        names = [r.name for r in self.rewards]
        weights = [r.weight for r in self.rewards]
        images: dict[int, RolloutImage] = {}
        out = []
        for i, sample in enumerate(repeated):
            rewards = tuple(None if math.isnan(v) else float(v) for v in values[i])
            for image in sample.images:
                images.setdefault(id(image), rollout_image(image))
            row = RolloutRow(
                step=self.step,
                group=positions[i // g],
                index=i % g,
                prompt=sample.prompt,
                completion=texts[i],
                images=[images[id(image)] for image in sample.images],
                rewards=dict(zip(names, rewards, strict=True)),
                reward=weighted_reward(rewards, weights),
                advantage=0.0,
                completion_length=len(completions.ids[i]),
                truncated=completions.truncated[i],
                row=sample.row,
                columns=sample.columns,
                split="eval",
            )
            if trajectories is not None:
                row.trajectory = trajectory_turns(
                    trajectories[i], lambda im: images.setdefault(id(im), rollout_image(im))
                )
            scored = ScoredCompletion(positions[i // g], i % g, rewards, row.completion_length, len(sample.images))
            out.append((row, scored))
        return out

    def _evaluate_alone(self, callbacks: CallbackList) -> bool:
        """An evaluation outside a training step (eval_on_start's step 0, or the one a cancel interrupted at the
        checkpoint this run resumed from), logged as a record of its own for the step; False when a cancel came
        during it (the newest checkpoint already holds this state, else one is saved)."""
        evaluation = self._evaluate(callbacks)
        if evaluation is None:
            self.checkpoints.save_if_changed(self.step, self._state)
            callbacks.on_event(
                "info",
                f"stopped at step {self.step} on request, during its evaluation; checkpoint saved (the evaluation "
                "runs again on resume)",
            )
            return False
        self.checkpoints.note_metrics(self.step, evaluation.metrics)
        callbacks.on_metrics(self.step, evaluation.metrics)
        callbacks.on_samples(self.step, evaluation.rows)
        if self.resume and self.step < self.config.train.max_steps:
            self.checkpoints.save(
                self.step, self._state
            )  # the resumed checkpoint did not hold this evaluation: now one does (never repeated)
        return True

    def _announce_heldout(self, callbacks: CallbackList) -> None:
        """Say what the evaluation scores; eval_fraction's held-out row ids go to ``eval_rows.json`` too."""
        h = self.heldout
        if h is None:
            return
        if self.config.train.eval_strategy != "no" or self.config.train.eval_on_start:
            callbacks.on_event(
                "info", f"{h.key}: evaluation data is {h.description}; {len(h)} rows evaluated each time"
            )
        if h.dropped:
            callbacks.on_event(
                "info",
                f"{h.key}: {len(h.dropped)} generated rows equal a training row and are left out of the evaluation "
                f"(rows {_id_list(h.dropped)})",
            )
        if h.held_rows is None:
            return
        where = ""
        if self.is_main and self.out is not None:
            import json

            record = {
                "source": self.config.dataset.source,
                "split": self.config.dataset.split,
                "eval_fraction": self.config.dataset.eval_fraction,
                "seed": self.config.dataset.seed,
                "held_out_rows": h.held_rows,  # never trained on
                "evaluated_rows": [raw.row for raw in h.rows],  # the first eval_max_rows of them
            }
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "eval_rows.json").write_text(json.dumps(record), encoding="utf-8")
            where = " (all in eval_rows.json)"
        callbacks.on_event(
            "info",
            f"dataset.eval_fraction: {len(h.held_rows)} rows of split {self.config.dataset.split!r} are held out for "
            f"evaluation and never trained on{where}: rows {_id_list(h.held_rows)}",
        )

    def _check_best_metric_logged(self, metrics: dict[str, float]) -> None:
        """A training metric named by ``metric_for_best_model`` must be among those the first step logged."""
        name = self.config.train.metric_for_best_model
        if self._best_checked or name is None or name.startswith("eval/"):
            return
        self._best_checked = True
        if name not in metrics:
            raise TrainingError(
                f"train.metric_for_best_model: this run logs no {name!r}; its training metrics are "
                + ", ".join(sorted(metrics))
            )

    # ------------------------------------------------------------ checkpoint
    def _state(self) -> TrainerState:
        """What a checkpoint keeps of this run beyond the model's weights and the random state."""
        return TrainerState(
            step=self.step,
            micro=self.micro,
            position=self.data_order.position,
            num_tokens=self.rollouts.num_tokens,
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(),
            buffer=self.buffer,
            world=self.world,
            ref_model=self.optimization.reference_state(),
            last_eval_step=self.last_eval_step,
        )

    def _restore(self) -> None:
        """Take the run up where its newest checkpoint left it."""
        state = self.checkpoints.resume(self.world, self.rank)  # the policy's weights and the random state too
        if not self.checkpoints.from_shards:  # else the shards already hold the optimizer state (and the reference)
            self.optimizer.load_state_dict(state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)
        self.step, self.micro, self.data_order.position = state.step, state.micro, state.position
        self.rollouts.num_tokens = state.num_tokens
        self.last_eval_step = state.last_eval_step
        self.buffer = state.buffer
        if self.buffer is not None:
            self.buffer.batch = self._to_device(self.buffer.batch)
        self.resumed_from = self.step
        if state.world != self.world:  # only a sharded checkpoint gets here (training.checkpointing)
            t = self.config.train
            self._pending_events.append(("warning", (
                f"resumed on {self.world} process(es) from a checkpoint of {state.world}: each step now draws "
                f"{t.generation_batch_size * self.world // t.num_generations} prompts (it drew "
                f"{t.generation_batch_size * state.world // t.num_generations}); to keep the batch, scale "
                "train.per_device_train_batch_size or steps_per_generation by the same factor")))  # fmt: skip
        if not self.checkpoints.from_shards:
            self.optimization.restore_reference(state.ref_model, self.step)

    # ------------------------------------------------------------------ loop
    def train(self) -> TrainResult:
        self.setup()
        history: list[dict[str, float]] = []
        t = self.config.train
        callbacks = self.callbacks if self.is_main else CallbackList()
        self._announce_start(callbacks)
        step_time = RecentStepTime()
        stopped = False
        try:
            if self._eval_due(self.step) and self.last_eval_step != self.step:
                # eval_on_start's baseline, or the evaluation a cancel interrupted at the step this run resumed from
                stopped = not self._evaluate_alone(callbacks)
            while not stopped and self.step < t.max_steps:
                if self._stop_requested(callbacks):
                    self.checkpoints.save_if_changed(self.step, self._state)
                    callbacks.on_event("info", f"stopped at step {self.step} on request; checkpoint saved")
                    stopped = True
                    break
                metrics, rows = self._train_step()
                evaluation = None
                if self._eval_due(self.step):
                    # after the step, before its record: the step's metrics and its evaluation are one record
                    evaluation = self._evaluate(callbacks)
                    stopped = evaluation is None  # a cancel came during the evaluation: it is abandoned
                    if evaluation is not None:
                        metrics.update(evaluation.metrics)
                history.append(metrics)
                self._log_step(callbacks, metrics, rows, evaluation)
                callbacks.on_progress(self.step, t.max_steps, step_time.step_done())
                if stopped:
                    self.checkpoints.save(self.step, self._state)
                    callbacks.on_event(
                        "info",
                        f"stopped at step {self.step} on request, during its evaluation; checkpoint saved (the "
                        "evaluation runs again on resume)",
                    )
                    break
                if t.save_steps and self.step % t.save_steps == 0 and self.step < t.max_steps:
                    self.checkpoints.save(self.step, self._state)
            if not stopped:
                self.checkpoints.save_if_changed(self.step, self._state)
                self._check_replicas(callbacks)
        except RewardError as exc:
            callbacks.on_event("error", str(exc))
            callbacks.on_end("failed", str(exc))
            raise TrainingError(str(exc)) from exc
        except Exception as exc:
            tb = traceback.format_exc()
            callbacks.on_event("error", tb)
            callbacks.on_end("failed", str(exc))
            raise
        status: Literal["succeeded", "cancelled"] = "cancelled" if stopped else "succeeded"
        callbacks.on_end(status)
        self._end_processes()
        return TrainResult(status, self.step, history)

    def _end_processes(self) -> None:
        """With several processes: each waits for the others to reach the end, then closes the process group. A
        process that exited with its group still open could abort in the group's C++ teardown ("terminate called
        without an active exception", SIGABRT, seen in CI) while another was still writing its last records."""
        if self.world == 1:
            return
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()

    def _announce_start(self, callbacks: CallbackList) -> None:
        """The run's start for the callbacks, with what set-up found to say (a resume, warnings, held-out data)."""
        callbacks.on_start(self.config, self.resumed_from)
        if self.resumed_from:
            callbacks.on_event("info", f"resumed from checkpoint at step {self.resumed_from}")
        for level, message in self._pending_events:
            callbacks.on_event(level, message)
        self._announce_heldout(callbacks)

    def _train_step(self) -> tuple[dict[str, float], list[RolloutRow]]:
        """One optimizer step: its micro-batches (with the generation batches the schedule calls for), the update,
        and the step's metrics (the same on every process) and rollout rows (this process's)."""
        tic = time.monotonic()
        lr = self.optimization.learning_rate()
        self.timings = _zero_timings()
        self.passes.images_encoded = 0
        self.model.train()
        gen_metrics, step_loss_metrics, rows = self._accumulate()
        grad_norm = self.optimization.apply_gradients()
        self.step += 1
        self.checkpoints.moved_on()
        self.optimization.sync_reference(self.step)
        metrics = mean_dicts(step_loss_metrics)
        if gen_metrics:
            metrics.update({k: v for k, v in mean_dicts(gen_metrics).items() if k != "kl" or "kl" not in metrics})
        metrics["learning_rate"] = lr
        metrics["grad_norm"] = to_float(grad_norm)
        metrics["step_time"] = time.monotonic() - tic
        metrics.update(self.timings)  # where the step's time went: sampling, scoring, forward+backward
        metrics["vision/images_encoded"] = self._global_sum(self.passes.images_encoded)
        metrics = self._reduce_metrics(metrics)
        if gen_metrics:
            self._check_best_metric_logged(metrics)
        return metrics, rows

    def _accumulate(self) -> tuple[list[dict[str, float]], list[dict[str, float]], list[RolloutRow]]:
        """The ``gradient_accumulation_steps`` micro-steps of one optimizer step, each on micro-batch ``micro %
        generation_steps`` of the current generation batch, a new one every ``generation_steps x num_iterations``
        micro-batches; the generation batches' metrics, the micro-batches' loss metrics, and the rollout rows."""
        t = self.config.train
        generate_every = t.generation_steps * t.num_iterations
        gen_metrics: list[dict[str, float]] = []
        step_loss_metrics: list[dict[str, float]] = []
        rows: list[RolloutRow] = []
        for a in range(t.gradient_accumulation_steps):
            if self.micro % generate_every == 0 or self.buffer is None:
                self.buffer = self._generate_and_score()
                gen_metrics.append(self.buffer.metrics)
                rows.extend(self.buffer.rows)
            index = self.micro % t.generation_steps
            sync = a == t.gradient_accumulation_steps - 1
            micro_tic = time.perf_counter()
            step_loss_metrics.append(self.optimization.micro_step(self.buffer, index, sync))
            self.timings["timing/train"] += time.perf_counter() - micro_tic
            self.micro += 1
        return gen_metrics, step_loss_metrics, rows

    def _log_step(
        self,
        callbacks: CallbackList,
        metrics: dict[str, float],
        rows: list[RolloutRow],
        evaluation: Evaluation | None,
    ) -> None:
        """The step's record to the callbacks: its metrics, every process's rollout rows, its evaluation's rows, and
        the bad rows its batches drew."""
        self.checkpoints.note_metrics(self.step, metrics)
        callbacks.on_metrics(self.step, metrics)
        if rows:
            from accelerate.utils import gather_object

            all_rows = gather_object(rows) if self.world > 1 else rows
            callbacks.on_samples(self.step, all_rows)
        if evaluation is not None:
            callbacks.on_samples(self.step, evaluation.rows)  # a call of its own: the store keeps splits apart
        self._flush_draw_warnings(callbacks)

    def _global_sum(self, value: float) -> float:
        if self.world == 1:
            return float(value)
        total = torch.tensor([float(value)], device=self.accelerator.device)
        return float(self.accelerator.reduce(total, reduction="sum").item())

    def _stop_requested(self, callbacks: CallbackList) -> bool:
        flag = torch.tensor([1.0 if callbacks.should_stop() else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)

    def _reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Loss-side metrics are per process; average them so every process logs the same numbers."""
        if self.world == 1:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.accelerator.device)
        values = self.accelerator.reduce(values, reduction="mean")
        return dict(zip(keys, values.tolist(), strict=True))

    def _check_replicas(self, callbacks: CallbackList) -> None:
        """With several processes, confirm every replica holds the same parameters at the end."""
        if self.world == 1 or self.sharded:  # a sharded run's processes hold different shards by design
            return
        digest = hashlib.sha256()
        for _, p in sorted(self.accelerator.unwrap_model(self.model).named_parameters()):
            digest.update(p.detach().float().cpu().numpy().tobytes())
        from accelerate.utils import gather_object

        digests = gather_object([digest.hexdigest()])
        if self.is_main and self.out is not None:
            import json

            (self.out / "replicas.json").write_text(json.dumps({"parameter_sha256": digests}, indent=1))
        if len(set(digests)) != 1:
            message = f"replicas diverged: parameter hashes differ across {self.world} processes"
            callbacks.on_event("error", message)
            raise TrainingError(message)
        callbacks.on_event("info", f"parameters identical across {self.world} processes")


def option_warnings(config: RunConfig) -> list[str]:
    """Settings TRL accepts but that do not do what they look like (TRL logs the first three as warnings too)."""
    t = config.train
    if config.algorithm != "grpo":
        return []
    out = []
    if t.loss_type == "luspo" and t.importance_sampling_level != "sequence":
        out.append("train.loss_type: luspo is meant for importance_sampling_level: sequence (the LUSPO paper's setup)")
    if t.loss_type == "vespo" and t.importance_sampling_level != "token":
        out.append("train.importance_sampling_level: vespo computes its own sequence-level weights; leave it at token")
    if t.importance_sampling_level == "sequence" and t.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        out.append(
            f"train.importance_sampling_level: with sequence, loss_type {t.loss_type} sums per-token terms, which "
            "weights each sequence by its length; the GSPO paper's setup is loss_type: grpo"
        )
    if t.loss_type == "cispo" and t.epsilon_high is None:
        out.append(
            f"train.epsilon_high: with loss_type cispo it is the cap of the importance weight itself (ScaleRL "
            f"recommends 5.0); unset it falls back to epsilon = {t.epsilon}, capping the weight below 1"
        )
    if t.delta is not None and t.loss_type not in alg.CLIPPED_LOSSES:
        out.append(f"train.delta: has no effect with loss_type {t.loss_type} (only with the clipped losses)")
    defaults = TrainSettings.model_fields
    for prefix, loss_type in (("sapo_", "sapo"), ("vespo_", "vespo")):
        changed = [k for k in defaults if k.startswith(prefix) and getattr(t, k) != defaults[k].default]
        if changed and t.loss_type != loss_type:
            out.append(f"train.{changed[0]}: has no effect with loss_type {t.loss_type} (only with {loss_type})")
    if t.multi_objective_aggregation == "normalize_then_sum" and t.scale_rewards != "group":
        out.append(
            "train.scale_rewards: has no effect with multi_objective_aggregation: normalize_then_sum (GDPO "
            "standardises the summed rewards over the batch)"
        )
    return out


def _id_list(ids: Sequence[int], most: int = 200) -> str:
    """Row ids for an event message: every one, or the first ``most`` and how many more."""
    shown = ", ".join(str(i) for i in ids[:most])
    return shown if len(ids) <= most else f"{shown}, ... and {len(ids) - most} more"
