"""The multi-image GRPO / RLOO trainer.

One optimizer step = ``gradient_accumulation_steps`` micro-batches of ``per_device_train_batch_size``
completions. Every ``steps_per_generation x num_iterations`` micro-batches a new *generation batch* is
sampled: ``per_device_train_batch_size x steps_per_generation / num_generations`` prompts per process, each
repeated ``num_generations`` times (one group), scored by every reward, turned into advantages, shuffled and
cut into ``steps_per_generation`` micro-batches that are each used ``num_iterations`` times. This is TRL's
schedule, so TRL settings mean the same here.
"""

from __future__ import annotations

import hashlib
import io
import math
import random
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from . import algorithms as alg
from .batching.batch import ModelBatch, collate
from .batching.buckets import block_micro_batches, bucket_rows, composition_invariant
from .batching.encoding import EncodedPrompt, PromptEncoder
from .batching.logprobs import completion_logprobs_and_entropy
from .batching.vision import POLICY, REFERENCE, SHARED, VisionFeatures
from .callbacks import Callback, CallbackList, CheckpointInfo, RolloutImage, RolloutRow
from .checkpoint import (
    checkpoints_to_remove,
    latest_checkpoint,
    list_checkpoints,
    load_model_weights,
    load_state,
    read_info,
    remove_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .config import AUTO_FULL_CHECK_ROWS, CHECK_SAMPLE_ROWS, RunConfig, TrainSettings
from .data.check import sample_view
from .data.heldout import HeldOut, load_heldout, training_rows
from .data.loader import DatasetError, LoadedDataset, load_dataset
from .data.mapping import RowMapping
from .data.rows import RowError, Sample, image_source
from .data.rowsource import row_ids
from .errors import CollageError
from .evaluation import ScoredCompletion, eval_metric_keys, eval_metrics, weighted_reward
from .generation import Sampling
from .generation import backend as generation_backend
from .modeling import prepare_policy, reference_model, trainable_vision_params
from .models.loading import load_model, load_processor
from .rewards import Reward, RewardBatch, RewardError, resolve_reward, score

MAX_REDRAWS = 100  # a drawn row that fails its check is replaced; this many bad in a row stops the run


class TrainingError(CollageError, RuntimeError):
    """A run that cannot start or cannot go on; the message says why in the user's terms."""

    exit_code = 1


@dataclass
class GenerationBatch:
    """A scored generation batch, shuffled, ready to be cut into micro-batches."""

    batch: ModelBatch
    advantages: torch.Tensor  # (N,) local rows
    old_logps: torch.Tensor | None  # (N, C) when the policy moves between generation and use
    ref_logps: torch.Tensor | None  # (N, C) when beta > 0 (GRPO)
    num_items: torch.Tensor  # completion tokens in the global generation batch (dapo normaliser)
    metrics: dict[str, float]
    rows: list[RolloutRow]


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


def _png(image: Any) -> tuple[str, bytes]:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    data = buf.getvalue()
    return hashlib.sha256(data).hexdigest(), data


def _rollout_image(image: Any) -> RolloutImage:
    """A dataset PNG keeps the hash and bytes it was loaded with (nothing encoded or hashed here); any other
    image is PNG-encoded lazily, by whoever writes the row (the output folder's or the store's writer thread)."""
    source = image_source(image)
    if source is not None and source.png is not None:
        return RolloutImage(source.sha256, source.png, image.width, image.height)
    return RolloutImage(None, None, image.width, image.height, image=image)


class Trainer:
    def __init__(
        self,
        config: RunConfig,
        output_dir: str | Path | None = None,
        callbacks: list[Callback] | None = None,
        resume: bool = False,
        reward_modules: Sequence[str] | None = None,
        data_roots: Sequence[Path] | None = None,
    ):
        """``reward_modules``: the operator's allowlist for import-path rewards, for a config an API client sent
        (see :func:`~training.rewards.registry.resolve_reward`); ``None`` trusts the config (local ``collage train``).
        ``data_roots``: the folders every image path inside a dataset row must lie under (the operator's
        COLLAGE_DATA_ROOTS); ``None`` leaves them unconfined (local ``collage train`` without COLLAGE_DATA_ROOTS).
        """
        self.config = config
        self.reward_modules = tuple(reward_modules) if reward_modules is not None else None
        self.data_roots = tuple(data_roots) if data_roots is not None else None
        self.out = Path(output_dir) if output_dir is not None else None
        self.callbacks = CallbackList(callbacks or [])
        self.resume = resume
        if resume and self.out is None:
            raise TrainingError("resume needs the output folder that holds the checkpoints")
        self._perm: tuple[int, torch.Tensor] = (
            -1,
            torch.zeros(0, dtype=torch.long),
        )  # (epoch, that epoch's permutation of row indices)
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
        set_seed(t.seed, device_specific=True)  # sampling differs per process; the data order below does not

        split = self._load_data()  # the whole training split; eval_fraction's rows are taken out below
        self.heldout = self._load_heldout(split)
        held = self.heldout.held_rows if self.heldout is not None else None
        self.dataset = training_rows(split, held) if held else split
        self.processor, self.family = load_processor(cfg.model.path)
        self.tokenizer = self.processor.tokenizer
        if self.tokenizer.pad_token_id is None:
            raise TrainingError(f"model.path: the tokenizer of {cfg.model.path} has no pad token")
        self.encoder = PromptEncoder(self.processor, self.family, t.max_prompt_length)
        self.image_token_id = self.encoder.image_token_id
        self._validate_rows(split)
        self.rewards = self._load_rewards()
        self._check_best_metric()

        model = load_model(cfg.model.path, cfg.model.dtype)
        model.generation_config.top_k = None  # sampling is plain temperature sampling unless configured
        self.uses_lora = cfg.model.lora is not None
        self.ref_model = reference_model(model, self.uses_lora) if t.beta > 0 else None
        self.loss_settings = self._loss_settings()
        self._pending_events.extend(("warning", message) for message in option_warnings(cfg))
        model = prepare_policy(model, cfg.model, t.gradient_checkpointing)
        params = [p for p in model.parameters() if p.requires_grad]
        decay = t.weight_decay
        self.optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=decay)
        from transformers import get_scheduler

        self.scheduler = get_scheduler(
            t.lr_scheduler_type, self.optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps
        )
        self.model, self.optimizer = self.accelerator.prepare(model, self.optimizer)
        if self.ref_model is not None:
            self.ref_model.to(self.accelerator.device)
        self.vision_params = trainable_vision_params(self.accelerator.unwrap_model(self.model))
        # each distinct sample's vision features once per generation batch (see training.batching.vision)
        self.vision = VisionFeatures(self.family)
        self.images_encoded = 0  # this step's images through the vision tower (cached or with gradients)
        # an evaluation's own feature cache: training's (which a generation batch may still need) is never touched
        self.eval_vision = VisionFeatures(self.family)
        self.last_eval_step = -1  # the step of the newest finished evaluation (kept in checkpoints)
        self.record: tuple[int, dict[str, float]] = (-1, {})  # the newest step's logged metrics (for checkpoints)
        self._saved_step: int | None = None  # the step whose state the newest checkpoint holds (None: moved on)
        self._best_checked = False

        self.step = 0
        self.micro = 0
        self.position = 0  # prompts consumed from the (infinite, seeded) data order, all processes together
        self.buffer: GenerationBatch | None = None
        self.num_tokens = 0.0
        self.resumed_from = 0
        if self.resume:
            self._restore()

    def _loss_settings(self) -> alg.GRPOLossSettings:
        t = self.config.train
        return alg.GRPOLossSettings(
            loss_type=t.loss_type,
            epsilon_low=t.epsilon_low,
            epsilon_high=t.epsilon_high_value,
            delta=t.delta,
            beta=t.beta,
            use_bias_correction_kl=t.use_bias_correction_kl,
            importance_sampling_level=t.importance_sampling_level,
            sapo_temperature_pos=t.sapo_temperature_pos,
            sapo_temperature_neg=t.sapo_temperature_neg,
            vespo_k_pos=t.vespo_k_pos,
            vespo_lambda_pos=t.vespo_lambda_pos,
            vespo_k_neg=t.vespo_k_neg,
            vespo_lambda_neg=t.vespo_lambda_neg,
            entropy_coef=t.entropy_coef,
            max_completion_length=t.max_completion_length,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            steps_per_generation=t.generation_steps,
            num_processes=self.world,
        )

    def _load_data(self) -> LoadedDataset:
        d = self.config.dataset
        synth = {}
        if d.source.startswith("synth:"):
            synth = dict(rows=d.rows, min_images=d.min_images, max_images=d.max_images, seed=d.seed)
        try:
            dataset = load_dataset(d.source, d.split, data_roots=self.data_roots, mapping=RowMapping.of(d),
                                   config_name=d.config_name, **synth)  # fmt: skip
        except DatasetError as exc:
            raise TrainingError(f"dataset.source: {exc}") from None
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
            raise TrainingError(f"dataset.{named[0]}: {exc}") from None
        if heldout is not None and heldout.held_rows is not None and len(heldout.held_rows) >= len(split):
            raise TrainingError(
                f"dataset.eval_fraction: {d.eval_fraction} of {len(split)} rows holds out every row: nothing is left "
                "to train on"
            )
        return heldout

    def _validate_rows(self, split: LoadedDataset) -> None:
        """The checks of ``collage data check`` before any compute is spent: on every row (``dataset.check: full``,
        cached per dataset fingerprint, so a start or resume on an unchanged dataset does not decode and encode
        every row again), or on a seeded sample of the split (``sample``: every other row is checked when a batch
        draws it, see :meth:`_drawn`)."""
        from .data.check import cached_check, run_check

        cfg, d = self.config, self.config.dataset
        full = d.check == "full" or (d.check == "auto" and len(split) <= AUTO_FULL_CHECK_ROWS)
        self.draw_check = not full
        self.bad_drawn: set[int] = set()  # rows found bad when drawn (sample check)
        self._draw_warnings: list[str] = []
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
        self.checked_ids = set(good)  # rows a batch may draw without checking them again
        if bad:  # dataset.bad_rows: skip: the others are used, and each skipped row is named
            self.dataset = training_rows(self.dataset, sorted(skipped))
            self.bad_drawn |= skipped
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
                raise TrainingError(f"rewards[{k}].name: {exc}") from None
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

    # ------------------------------------------------------------- data order
    def _prompts_for_generation(self) -> list[Sample]:
        """This process's prompts for the next generation batch; the order is a seeded permutation per epoch,
        identical on every process, and each process takes its own slice."""
        t = self.config.train
        per_process = t.generation_batch_size // t.num_generations
        total = per_process * self.world
        n = len(self.dataset)
        indices = []
        for pos in range(self.position, self.position + total):
            epoch, offset = divmod(pos, n)
            g = torch.Generator().manual_seed(t.seed * 1_000_003 + epoch)
            if self._perm[0] != epoch:
                self._perm = (epoch, torch.randperm(n, generator=g))  # a tensor: 8 bytes a row, not a list
            indices.append(int(self._perm[1][offset]))
        start, self.position = self.position, self.position + total
        mine = indices[self.rank * per_process : (self.rank + 1) * per_process]
        return [self._drawn(i, start, slot) for slot, i in enumerate(mine)]

    def _drawn(self, index: int, start: int, slot: int) -> Sample:
        """The sample of drawn row ``index``. After a sample check, a row the check did not cover is checked now:
        a bad one fails the run (``dataset.bad_rows: fail``) or is replaced by a row drawn from a stream seeded by
        ``train.seed``, the batch's position, the process and the slot, so every process keeps its place in the
        shared order and a resume draws the same replacements."""
        raw = self.dataset.rows[index]
        if not self.draw_check:
            return raw.to_sample()
        from .data.check import checked_sample

        for attempt in range(1, MAX_REDRAWS + 1):
            if raw.row in self.checked_ids:
                return raw.to_sample()
            if raw.row not in self.bad_drawn:
                try:
                    sample, _ = checked_sample(raw, self.encoder)
                    self.checked_ids.add(raw.row)
                    return sample
                except RowError as err:
                    self._bad_row_drawn(err)
            seed = f"redraw:{self.config.train.seed}:{start}:{self.rank}:{slot}:{attempt}"
            raw = self.dataset.rows[random.Random(seed).randrange(len(self.dataset))]
        raise TrainingError(
            f"dataset {self.dataset.source}: {MAX_REDRAWS} rows drawn in a row fail `collage data check` "
            f"({len(self.bad_drawn)} bad rows found so far); run `collage data check` on it"
        )

    def _bad_row_drawn(self, err: RowError) -> None:
        source = self.dataset.source
        if self.config.dataset.bad_rows == "fail":
            raise TrainingError(
                f"dataset {source}: a drawn row fails `collage data check` (dataset.bad_rows: fail): {err}"
            )
        self.bad_drawn.add(err.row)
        self._draw_warnings.append(
            f"dataset {source}: skipped when drawn (dataset.bad_rows: skip), another row taken instead: {err}"
        )

    def _flush_draw_warnings(self, callbacks: CallbackList) -> None:
        """The bad rows this step's batches drew, from every process, as warning events."""
        if not self.draw_check:
            return
        warnings, self._draw_warnings = self._draw_warnings, []
        if self.world > 1:
            from accelerate.utils import gather_object

            warnings = gather_object(warnings)
        for message in warnings:
            callbacks.on_event("warning", message)

    # ------------------------------------------------------- generate + score
    def _scope(self, model: str) -> str | None:
        """Which cached vision features a pass may use (``None``: encode with gradients, no cache). A frozen
        vision side is the same function in every pass; a trainable one differs between policy and reference and
        must run with gradients in the training forward."""
        if not self.vision_params:
            return SHARED
        return {"policy": POLICY, "reference": REFERENCE, "train": None}[model]

    def _encoder_outputs(self, model: Any, batch: ModelBatch, scope: str | None) -> Any | None:
        if scope is None:  # a training forward with a trainable tower: the model encodes with gradients
            self.images_encoded += sum(batch.num_images)
            return None
        before = self.vision.images_encoded
        out = self.vision.encoder_outputs(model, batch, scope)  # no gradients, eval mode (training.batching.vision)
        self.images_encoded += self.vision.images_encoded - before
        return out

    def _share_prompts(self) -> bool:
        """Whether a loss forward runs each distinct prompt once for its group (training.batching.prefix). Not with
        gradient checkpointing (the checkpointed layers keep no KV cache to share), and with gradients only in a
        single process: DDP expects one forward per backward."""
        if self.config.train.gradient_checkpointing:
            return False
        return self.world == 1 or not torch.is_grad_enabled()

    def _logps(
        self, model: Any, batch: ModelBatch, scope: str | None, entropy: bool = False, entropy_grad: bool = False
    ):
        return completion_logprobs_and_entropy(
            model,
            batch,
            self.family,
            self.image_token_id,
            self.config.train.temperature,
            entropy=entropy,
            entropy_grad=entropy_grad,
            vision=lambda part: self._encoder_outputs(model, part, scope),
            share_prompts=self._share_prompts(),
        )

    @torch.no_grad()
    def _batched_logps(self, model: Any, batch: ModelBatch, scope: str | None) -> torch.Tensor:
        size = self.config.train.per_device_train_batch_size
        width = batch.completion_mask.shape[1]
        parts = []
        for lo in range(0, batch.batch_size, size):
            part = batch.slice(lo, min(lo + size, batch.batch_size), self.family.layout).trimmed()
            logps = self._logps(model, part, scope)[0]
            parts.append(torch.nn.functional.pad(logps, (0, width - logps.shape[1])))
        return torch.cat(parts)

    def _sampling(self) -> Sampling:
        t = self.config.train
        return Sampling(t.temperature, t.top_p, t.top_k, t.min_p, t.repetition_penalty)

    def _generate_and_score(self) -> GenerationBatch:
        cfg, t = self.config, self.config.train
        device = self.accelerator.device
        samples = self._prompts_for_generation()
        encoded = [self.encoder.encode(s) for s in samples]  # each prompt encoded once, then repeated
        prompts: list[EncodedPrompt] = [e for e in encoded for _ in range(t.num_generations)]
        repeated: list[Sample] = [s for s in samples for _ in range(t.num_generations)]
        policy = self.accelerator.unwrap_model(self.model)
        self.vision.clear()  # features live for one generation batch (the policy moves between batches)
        tic = time.perf_counter()
        prompt_batch = self._batch_to_device(collate(encoded, self.family, self.tokenizer.pad_token_id))
        completions = generation_backend(t.generation_backend)(
            policy,
            prompt_batch,
            t.num_generations,
            self.family,
            self.tokenizer,
            self.image_token_id,
            self.encoder.protected,
            t.max_completion_length,
            self._sampling(),
            self._encoder_outputs(policy, prompt_batch, self._scope("policy")),
        )
        self.timings["timing/generation"] += time.perf_counter() - tic
        batch = collate(prompts, self.family, self.tokenizer.pad_token_id, completions.ids, self.encoder.protected)
        truncated = torch.tensor(completions.truncated)
        if t.mask_truncated_completions:
            batch.completion_mask[truncated] = 0
            batch.attention_mask[truncated, batch.prompt_length :] = 0
        batch = self._batch_to_device(batch)

        generate_every = t.generation_steps * t.num_iterations
        old_logps = None
        if t.gradient_accumulation_steps % generate_every != 0 or (cfg.algorithm == "rloo" and t.beta > 0):
            old_logps = self._batched_logps(self.model, batch, self._scope("policy"))
        ref_logps = None
        if t.beta > 0:
            if self.uses_lora:
                with policy.disable_adapter():
                    ref_logps = self._batched_logps(self.model, batch, self._scope("reference"))
            else:
                ref_logps = self._batched_logps(self.ref_model, batch, self._scope("reference"))

        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completions.ids]
        reward_batch = _reward_batch(repeated, texts, completions.ids)
        tic = time.perf_counter()
        local = torch.tensor(score(self.rewards, reward_batch), dtype=torch.float32, device=device)
        self.timings["timing/rewards"] += time.perf_counter() - tic
        if local.dim() == 1:
            local = local.view(len(texts), len(self.rewards))
        weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float32, device=device)
        mask = batch.completion_mask.float()
        rewards_per_func = self.accelerator.gather(local)
        rewards, unscorable = alg.combine_rewards(rewards_per_func, weights)
        kl_seq = None
        if cfg.algorithm == "rloo" and t.beta > 0:
            assert old_logps is not None and ref_logps is not None  # computed above whenever beta > 0
            kl_seq = self.accelerator.gather(alg.sequence_kl_penalty(old_logps, ref_logps, mask))
            rewards = rewards - t.beta * kl_seq
        if cfg.algorithm == "grpo" and t.multi_objective_aggregation == "normalize_then_sum":
            adv = alg.gdpo_advantages(rewards_per_func, weights, t.num_generations)
        elif cfg.algorithm == "grpo":
            adv = alg.grpo_advantages(rewards, t.num_generations, t.scale_rewards)
        else:
            adv = alg.rloo_advantages(rewards, t.num_generations, t.normalize_advantages)
        n_local = len(texts)
        mine = slice(self.rank * n_local, (self.rank + 1) * n_local)
        num_items = self.accelerator.gather(mask.sum().reshape(1)).sum()

        lengths = torch.tensor([len(ids) for ids in completions.ids], device=device)
        metrics = self._generation_metrics(
            rewards_per_func, weights, unscorable, adv, batch, lengths, truncated, kl_seq, mask
        )
        rows = self._rollout_rows(repeated, texts, completions, local, rewards_per_func[mine], adv, mine)

        # shuffle before cutting micro-batches so each mixes prompts (and image counts), as TRL does; then, where
        # the loss allows, regroup rows within what one optimizer step takes (training.batching.buckets)
        order = torch.randperm(n_local).tolist()
        if composition_invariant(cfg.algorithm, t.loss_type, t.entropy_coef, t.top_entropy_quantile):
            block = block_micro_batches(t.gradient_accumulation_steps, t.generation_steps)
            prompt_lengths = batch.attention_mask[:, : batch.prompt_length].sum(-1).tolist()
            order = bucket_rows(order, prompt_lengths, [i // t.num_generations for i in range(n_local)],
                                lengths.tolist(), block * t.per_device_train_batch_size)  # fmt: skip
        shuffled = batch.select(order, self.family.layout)
        pick = torch.as_tensor(order, device=device)
        return GenerationBatch(
            batch=shuffled,
            advantages=adv.advantages[mine].to(device)[pick],
            old_logps=None if old_logps is None else old_logps[pick],
            ref_logps=None if ref_logps is None else ref_logps[pick],
            num_items=num_items,
            metrics=metrics,
            rows=rows,
        )

    def _batch_to_device(self, batch: ModelBatch) -> ModelBatch:
        device = self.accelerator.device
        batch.input_ids = batch.input_ids.to(device)
        batch.attention_mask = batch.attention_mask.to(device)
        batch.completion_mask = batch.completion_mask.to(device)
        dtype = next(self.model.parameters()).dtype
        batch.pixels = {
            k: v.to(device, dtype=dtype) if v.is_floating_point() else v.to(device) for k, v in batch.pixels.items()
        }
        return batch

    def _generation_metrics(self, rewards_per_func, weights, unscorable, adv, batch, lengths, truncated, kl_seq, mask):
        metrics: dict[str, float] = {}
        for k, reward in enumerate(self.rewards):
            column = rewards_per_func[:, k]
            metrics[f"rewards/{reward.name}/mean"] = _f(torch.nanmean(column))
            metrics[f"rewards/{reward.name}/std"] = _f(alg.nanstd(column))
        logged = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        logged[unscorable] = torch.nan
        metrics["reward"] = _f(torch.nanmean(logged))
        metrics["reward_std"] = _f(alg.nanstd(logged))
        metrics["frac_reward_zero_std"] = _f(adv.zero_std.float().mean())
        lengths = self.accelerator.gather(lengths)
        trunc = self.accelerator.gather(truncated.to(lengths.device).long())
        metrics["completions/mean_length"] = _f(lengths.float().mean())
        metrics["completions/max_length"] = _f(lengths.float().max())
        metrics["completions/clipped_ratio"] = _f(trunc.float().mean())
        tokens = self.accelerator.gather(batch.attention_mask.sum().reshape(1)).sum()
        self.num_tokens += float(tokens)
        metrics["num_tokens"] = self.num_tokens
        images = self.accelerator.gather(torch.tensor([sum(batch.num_images)], device=lengths.device)).sum()
        metrics["num_images"] = _f(images)
        if kl_seq is not None:
            gathered_mask = self.accelerator.gather(mask.sum(-1))
            metrics["kl"] = _f(kl_seq.sum() / gathered_mask.sum().clamp(min=1.0))
        return metrics

    def _rollout_rows(self, repeated, texts, completions, local, rewards_per_func, adv, mine) -> list[RolloutRow]:
        t = self.config.train
        if not self.config.logging.samples_every or (self.step + 1) % self.config.logging.samples_every:
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
                    cache[key] = _rollout_image(image)
                images.append(cache[key])
            values = [None if math.isnan(v) else v for v in rewards_per_func[i].tolist()]
            scored = [w * v for w, v in zip(weights, values, strict=True) if v is not None]
            g = self.rank * per_process_groups + i // t.num_generations
            gi = mine.start + i
            rows.append(
                RolloutRow(
                    step=self.step + 1,
                    group=g,
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
                    group_mean=_none(adv.group_mean[gi]),
                    group_std=_none(adv.group_std[gi]),
                )
            )
        return rows

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
        metrics["timing/eval"] = time.perf_counter() - tic
        self.last_eval_step = self.step
        self._saved_step = None  # the state moved on: a checkpoint must record this evaluation
        return Evaluation(metrics, [row for row, _ in scored])

    def _evaluate_batch(self, positions: list[int], raws: list[Any]) -> list[tuple[RolloutRow, ScoredCompletion]]:
        """Generate and score ``eval_num_generations`` completions for each of these held-out rows (at
        ``positions`` in the evaluation); no gradients, the policy in eval mode."""
        t = self.config.train
        g = t.eval_num_generations
        samples = [raw.to_sample() for raw in raws]
        encoded = [self.encoder.encode(s) for s in samples]
        policy = self.accelerator.unwrap_model(self.model)
        with torch.no_grad():
            prompts = self._batch_to_device(collate(encoded, self.family, self.tokenizer.pad_token_id))
            self.eval_vision.clear()
            completions = generation_backend(t.generation_backend)(
                policy,
                prompts,
                g,
                self.family,
                self.tokenizer,
                self.image_token_id,
                self.encoder.protected,
                t.max_completion_length,
                self._eval_sampling(),
                self.eval_vision.encoder_outputs(policy, prompts, POLICY),
            )
        repeated = [s for s in samples for _ in range(g)]
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completions.ids]
        reward_batch = _reward_batch(repeated, texts, completions.ids)
        values = score(self.rewards, reward_batch)
        names = [r.name for r in self.rewards]
        weights = [r.weight for r in self.rewards]
        images: dict[int, RolloutImage] = {}
        out = []
        for i, sample in enumerate(repeated):
            rewards = tuple(None if math.isnan(v) else float(v) for v in values[i])
            for image in sample.images:
                images.setdefault(id(image), _rollout_image(image))
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
            scored = ScoredCompletion(positions[i // g], i % g, rewards, row.completion_length, len(sample.images))
            out.append((row, scored))
        return out

    def _evaluate_alone(self, callbacks: CallbackList) -> bool:
        """An evaluation outside a training step (eval_on_start's step 0, or the one a cancel interrupted at the
        checkpoint this run resumed from), logged as a record of its own for the step; False when a cancel came
        during it (the newest checkpoint already holds this state, else one is saved)."""
        evaluation = self._evaluate(callbacks)
        if evaluation is None:
            self._save_if_changed()
            callbacks.on_event(
                "info",
                f"stopped at step {self.step} on request, during its evaluation; checkpoint saved (the evaluation "
                "runs again on resume)",
            )
            return False
        step, metrics = self.record
        self.record = (self.step, {**(metrics if step == self.step else {}), **evaluation.metrics})
        callbacks.on_metrics(self.step, evaluation.metrics)
        callbacks.on_samples(self.step, evaluation.rows)
        if self.resume and self.step < self.config.train.max_steps:
            self._save()  # the resumed checkpoint did not hold this evaluation: now one does (never repeated)
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

    # ------------------------------------------------------------------ loss
    def _logps_for_loss(self, mb: ModelBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of a micro-batch; the entropies carry gradients when the entropy bonus
        (``entropy_coef``) trains through them."""
        t = self.config.train
        entropy_grad = self.config.algorithm == "grpo" and t.entropy_coef != 0.0
        logps, entropy = self._logps(self.model, mb, self._scope("train"), entropy=True, entropy_grad=entropy_grad)
        assert entropy is not None
        return logps, entropy

    def _entropy_mask(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """``top_entropy_quantile``: the threshold is the quantile over every process's completion tokens of the
        micro-batch, as in TRL."""
        t = self.config.train
        if self.config.algorithm != "grpo" or t.top_entropy_quantile >= 1.0:
            return None
        local = entropy.detach()[mask.bool()].float()
        pool = local
        if self.world > 1:
            pad = -1e9  # entropies are >= 0, so the sentinel cannot collide with a real value
            gathered = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0, pad_index=pad))
            pool = gathered[gathered != pad]
        return alg.high_entropy_mask(entropy.detach(), mask, t.top_entropy_quantile, pool)

    def _micro_step(self, gen: GenerationBatch, index: int, sync: bool) -> dict[str, float]:
        cfg, t = self.config, self.config.train
        size = t.per_device_train_batch_size
        lo, hi = index * size, (index + 1) * size
        mb = gen.batch.slice(lo, hi, self.family.layout).trimmed()  # padded to its own longest rows only
        c = mb.completion_mask.shape[1]
        advantages = gen.advantages[lo:hi]
        old = None if gen.old_logps is None else gen.old_logps[lo:hi, :c]
        ref = None if gen.ref_logps is None else gen.ref_logps[lo:hi, :c]
        mask = mb.completion_mask
        context = torch.enable_grad() if sync else self.accelerator.no_sync(self.model)
        with context:
            logps, entropy = self._logps_for_loss(mb)
            if cfg.algorithm == "grpo":
                out = alg.grpo_loss(
                    logps,
                    old,
                    advantages,
                    mask,
                    self.loss_settings,
                    ref_logps=ref,
                    num_items_in_batch=gen.num_items,
                    entropies=entropy,
                    entropy_mask=self._entropy_mask(entropy, mask),
                )
            else:
                out = alg.rloo_loss(
                    logps, old, advantages, mask, t.epsilon_low, t.epsilon_high_value, t.gradient_accumulation_steps
                )
            loss = out.loss
            if self.world > 1 and not mb.pixels and self.vision_params:
                # DDP all-reduces a fixed set of gradients: a micro-batch without images must still give the
                # trainable vision parameters a (zero) gradient, or ranks disagree and DDP fails (TRL #4169)
                loss = loss + 0.0 * sum(p.sum() for p in self.vision_params)
            self.accelerator.backward(loss)
        return loss_metrics(out, entropy.detach(), mask, t.entropy_coef if cfg.algorithm == "grpo" else 0.0)

    # ------------------------------------------------------------- reference
    def _sync_reference(self) -> None:
        """``sync_ref_model`` (TR-DPO): every ``ref_model_sync_steps`` optimizer steps the reference moves towards
        the policy, ``ref = alpha * policy + (1 - alpha) * ref``, as TRL's ``SyncRefModelCallback`` does."""
        t = self.config.train
        if self.ref_model is None or not t.sync_ref_model or self.step % t.ref_model_sync_steps:
            return
        policy = dict(self.accelerator.unwrap_model(self.model).named_parameters())
        names = [n for n, _ in self.ref_model.named_parameters()]
        alg.mix_into_reference(
            [p for _, p in self.ref_model.named_parameters()], [policy[n] for n in names], t.ref_model_mixup_alpha
        )

    def _reference_state(self) -> dict[str, torch.Tensor] | None:
        """The synchronised reference's weights for a checkpoint (``None`` when the reference never moves: it is
        then the initial policy, rebuilt on resume)."""
        if self.ref_model is None or not self.config.train.sync_ref_model:
            return None
        return {k: v.detach().cpu().clone() for k, v in self.ref_model.state_dict().items()}

    def _restore_reference(self, state: dict[str, Any] | None = None) -> None:
        """On resume, a reference that ``sync_ref_model`` has moved must come back from the checkpoint."""
        t = self.config.train
        if self.ref_model is None or not t.sync_ref_model or self.step < t.ref_model_sync_steps:
            return
        if state is None:
            assert self.out is not None
            path = latest_checkpoint(self.out)
            assert path is not None  # _restore found it
            state = load_state(path)
        saved = state.get("ref_model")
        if saved is None:
            raise TrainingError(
                f"resume: train.sync_ref_model: the checkpoint at step {self.step} does not hold the synchronised "
                "reference model, so the run cannot continue with the same reference"
            )
        self.ref_model.load_state_dict(saved)

    # ------------------------------------------------------------ checkpoint
    def _state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "micro": self.micro,
            "position": self.position,
            "num_tokens": self.num_tokens,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "buffer": self.buffer,
            "world": self.world,
            "ref_model": self._reference_state(),  # a reference that sync_ref_model moved (else None)
            "last_eval_step": self.last_eval_step,  # a resumed run never repeats a finished evaluation
        }

    def _save_if_changed(self) -> Path | None:
        """Save, unless the newest checkpoint already holds this very state (a cancel right after resuming)."""
        if self._saved_step == self.step:
            return None
        return self._save()

    def _save(self) -> Path | None:
        from accelerate.utils import gather_object

        rngs = gather_object([rng_state()])
        path = None
        if self.is_main and self.out is not None:
            unwrapped = self.accelerator.unwrap_model(self.model)
            kind = "adapter" if self.uses_lora else "full"
            metric = self._checkpoint_metric()
            state = self._state()
            path, size = save_checkpoint(self.out, self.step, unwrapped, self.processor, state, rngs, kind, metric)
            value = read_info(path) or {}
            info = CheckpointInfo(self.step, str(path), kind, size, value.get("metric_value"))
            self.callbacks.on_checkpoint(self.step, str(path), info)
            self._apply_retention()
        self._saved_step = self.step
        self.accelerator.wait_for_everyone()
        return path

    def _checkpoint_metric(self) -> tuple[str, float | None] | None:
        """``(metric_for_best_model, its value at this step)``; the value is None when the step did not log it (a
        cancel between evaluations, a step without a generation)."""
        name = self.config.train.metric_for_best_model
        if name is None:
            return None
        step, metrics = self.record
        return name, metrics.get(name) if step == self.step else None

    def _apply_retention(self) -> None:
        """``save_total_limit``: delete all but the newest checkpoints and the best (``metric_for_best_model``),
        counting those an earlier worker attempt wrote (linked into this attempt's folder)."""
        t = self.config.train
        if t.save_total_limit is None or self.out is None:
            return
        found = list_checkpoints(self.out)
        values = []
        for step, folder in found:
            info = read_info(folder) or {}
            same = info.get("metric") == t.metric_for_best_model and t.metric_for_best_model is not None
            values.append((step, info.get("metric_value") if same else None))
        doomed = set(checkpoints_to_remove(values, t.save_total_limit, t.best_is_greater))
        for step, folder in found:
            if step in doomed:
                removed = remove_checkpoint(folder)
                self.callbacks.on_checkpoint_removed(step, str(removed))

    def _restore(self) -> None:
        assert self.out is not None  # __init__ refuses resume without an output folder
        path = latest_checkpoint(self.out)
        if path is None:
            raise TrainingError(f"resume: no checkpoint in {self.out / 'checkpoints'}")
        state = load_state(path)
        if state["world"] != self.world:
            raise TrainingError(f"resume: the checkpoint was written by {state['world']} processes, not {self.world}")
        load_model_weights(self.accelerator.unwrap_model(self.model), path, self.uses_lora)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.micro, self.position = state["step"], state["micro"], state["position"]
        self.num_tokens = state["num_tokens"]
        self.last_eval_step = state.get("last_eval_step", -1)  # -1: written before evaluation existed
        self._saved_step = self.step
        name = self.config.train.metric_for_best_model
        info = read_info(path) or {}
        if name is not None and info.get("metric") == name and info.get("metric_value") is not None:
            self.record = (self.step, {name: info["metric_value"]})  # a save at this step keeps the checkpoint's value
        self.buffer = state["buffer"]
        if self.buffer is not None:
            self.buffer.batch = self._batch_to_device(self.buffer.batch)
        set_rng_state(state["rng"][self.rank])
        self.resumed_from = self.step
        self._restore_reference(state)

    # ------------------------------------------------------------------ loop
    def train(self) -> TrainResult:
        self.setup()
        history: list[dict[str, float]] = []
        cfg, t = self.config, self.config.train
        callbacks = self.callbacks if self.is_main else CallbackList()
        callbacks.on_start(cfg, self.resumed_from)
        if self.resumed_from:
            callbacks.on_event("info", f"resumed from checkpoint at step {self.resumed_from}")
        for level, message in self._pending_events:
            callbacks.on_event(level, message)
        self._announce_heldout(callbacks)
        generate_every = t.generation_steps * t.num_iterations
        started = time.monotonic()
        done_steps = 0
        stopped = False
        try:
            if self._eval_due(self.step) and self.last_eval_step != self.step:
                # eval_on_start's baseline, or the evaluation a cancel interrupted at the step this run resumed from
                stopped = not self._evaluate_alone(callbacks)
            while not stopped and self.step < t.max_steps:
                if self._stop_requested(callbacks):
                    self._save_if_changed()
                    callbacks.on_event("info", f"stopped at step {self.step} on request; checkpoint saved")
                    stopped = True
                    break
                tic = time.monotonic()
                gen_metrics: list[dict[str, float]] = []
                loss_metrics: list[dict[str, float]] = []
                rows: list[RolloutRow] = []
                lr = self.scheduler.get_last_lr()[0]
                self.timings = _zero_timings()
                self.images_encoded = 0
                self.model.train()
                for a in range(t.gradient_accumulation_steps):
                    if self.micro % generate_every == 0 or self.buffer is None:
                        self.buffer = self._generate_and_score()
                        gen_metrics.append(self.buffer.metrics)
                        rows.extend(self.buffer.rows)
                    index = self.micro % t.generation_steps
                    sync = a == t.gradient_accumulation_steps - 1
                    micro_tic = time.perf_counter()
                    loss_metrics.append(self._micro_step(self.buffer, index, sync))
                    self.timings["timing/train"] += time.perf_counter() - micro_tic
                    self.micro += 1
                grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                self._saved_step = None
                self._sync_reference()
                done_steps += 1
                metrics = _mean_dicts(loss_metrics)
                if gen_metrics:
                    metrics.update(
                        {k: v for k, v in _mean_dicts(gen_metrics).items() if k != "kl" or "kl" not in metrics}
                    )
                metrics["learning_rate"] = lr
                metrics["grad_norm"] = _f(grad_norm)
                metrics["step_time"] = time.monotonic() - tic
                metrics.update(self.timings)  # where the step's time went: sampling, scoring, forward+backward
                metrics["vision/images_encoded"] = self._global_sum(self.images_encoded)
                metrics = self._reduce_metrics(metrics)
                if gen_metrics:
                    self._check_best_metric_logged(metrics)
                evaluation = None
                if self._eval_due(self.step):
                    # after the step, before its record: the step's metrics and its evaluation are one record
                    evaluation = self._evaluate(callbacks)
                    stopped = evaluation is None  # a cancel came during the evaluation: it is abandoned
                    if evaluation is not None:
                        metrics.update(evaluation.metrics)
                history.append(metrics)
                self.record = (self.step, metrics)
                callbacks.on_metrics(self.step, metrics)
                if rows:
                    from accelerate.utils import gather_object

                    all_rows = gather_object(rows) if self.world > 1 else rows
                    callbacks.on_samples(self.step, all_rows)
                if evaluation is not None:
                    callbacks.on_samples(self.step, evaluation.rows)  # a call of its own: the store keeps splits apart
                self._flush_draw_warnings(callbacks)
                elapsed = time.monotonic() - started
                callbacks.on_progress(self.step, t.max_steps, elapsed / done_steps)
                if stopped:
                    self._save()
                    callbacks.on_event(
                        "info",
                        f"stopped at step {self.step} on request, during its evaluation; checkpoint saved (the "
                        "evaluation runs again on resume)",
                    )
                    break
                if t.save_steps and self.step % t.save_steps == 0 and self.step < t.max_steps:
                    self._save()
            if not stopped:
                self._save_if_changed()
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
        return TrainResult(status, self.step, history)

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
        if self.world == 1:
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


def loss_metrics(
    out: alg.LossOutput, entropy: torch.Tensor, mask: torch.Tensor, entropy_coef: float = 0.0
) -> dict[str, float]:
    """A micro-batch's loss-side metrics under TRL's names: ``loss``, ``entropy``, the ``kl`` term as TRL logs it,
    ``clip_ratio/*`` for the clipped losses, ``cispo_clip_ratio``, ``vespo/phi_seq_mean``, and with the entropy
    bonus ``policy_loss`` and ``entropy_coef``."""
    fmask = mask.float()
    metrics = {
        "loss": _f(out.logged_loss if out.logged_loss is not None else out.policy_loss),
        "entropy": _f(alg.masked_mean(entropy, fmask)),
    }
    if out.is_low_clipped is not None and out.is_high_clipped is not None:
        low, high = out.is_low_clipped, out.is_high_clipped
        metrics["clip_ratio/low_mean"] = _f(alg.masked_mean(low.float(), fmask))
        metrics["clip_ratio/high_mean"] = _f(alg.masked_mean(high.float(), fmask))
        metrics["clip_ratio/region_mean"] = _f(alg.masked_mean((low | high).float(), fmask))
    for name, value in out.extra.items():
        metrics[name] = _f(alg.masked_mean(value.float(), fmask))
    if out.kl is not None:
        metrics["kl"] = _f(alg.masked_mean(out.kl.detach(), fmask))
    if entropy_coef != 0.0:
        metrics["policy_loss"] = _f(out.policy_loss)
        metrics["entropy_coef"] = entropy_coef
    return metrics


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


def _reward_batch(repeated: list[Sample], texts: list[str], completion_ids: list[list[int]]) -> RewardBatch:
    """What the reward functions see for these completions (each sample repeated once per completion)."""
    columns = {k: [s.columns.get(k) for s in repeated] for k in sorted({k for s in repeated for k in s.columns})}
    return RewardBatch(
        prompts=[s.prompt for s in repeated],
        completions=texts,
        completion_ids=completion_ids,
        images=[s.images for s in repeated],
        columns=columns,
        rows=[s.row for s in repeated],
    )


def _id_list(ids: Sequence[int], most: int = 200) -> str:
    """Row ids for an event message: every one, or the first ``most`` and how many more."""
    shown = ", ".join(str(i) for i in ids[:most])
    return shown if len(ids) <= most else f"{shown}, ... and {len(ids) - most} more"


def _f(x: Any) -> float:
    return float(x.item()) if hasattr(x, "item") else float(x)


def _none(x: Any) -> float | None:
    v = _f(x)
    return None if math.isnan(v) else v


def _mean_dicts(items: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in items for k in d}
    out = {}
    for k in keys:
        values = [d[k] for d in items if k in d and not math.isnan(d[k])]
        out[k] = sum(values) / len(values) if values else math.nan
    return out
