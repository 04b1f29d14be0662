"""The run config (``../shared/CONTRACTS.md`` section 1), validated with pydantic.

Names and meanings follow TRL's ``GRPOConfig`` / ``RLOOConfig`` wherever TRL has the same setting, so a TRL
user's values carry over. Unknown keys and wrong types are errors that name the key path.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import CollageError


class ConfigError(CollageError, ValueError):
    """A bad run config; ``errors`` is a list of ``(path, message)``, one per bad field."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("\n".join(f"{path}: {message}" for path, message in errors))


# Free-form JSON fields (``rewards[].args``, the API's clone ``overrides``) are bounded: deeper values crash
# serialisers (pydantic's stops at a few hundred levels) and a worker should never receive megabytes of arguments.
JSON_MAX_DEPTH = 32
JSON_MAX_BYTES = 65_536
NUL_MESSAGE = "must not contain a NUL byte (\\x00)"  # PostgreSQL refuses NUL in text; nobody means one

SEED_MAX = 2**32 - 1  # numpy's seed range (TRL seeds numpy, random and torch with it)
STEPS_MAX = 10_000_000  # steps, warm-up and save intervals: years of training at one step a second
BATCH_MAX = 1024  # per-device batch, accumulation, steps per generation, completions per prompt, iterations
TOKENS_MAX = 1_000_000  # prompt tokens (the same bound as the API's dataset check)
COMPLETION_TOKENS_MAX = 131_072
ROWS_MAX = 10_000_000
IMAGES_MAX = 64  # images per row (the same bound as the API's dataset check)
COEF_MAX = 1000.0  # KL and entropy coefficients, delta, SAPO temperatures, VESPO's k and lambda


def json_problem(value: Any, max_depth: int = JSON_MAX_DEPTH, max_bytes: int | None = JSON_MAX_BYTES) -> str | None:
    """Why a free-form JSON value is refused (too deep, too large, a NUL byte, a non-finite number), or None.

    Walks the value without recursion, so any depth is safe to inspect."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        node, depth, where = stack.pop()
        at = f" (at {where[:200]})" if where else ""
        if isinstance(node, dict | list):
            if depth + 1 > max_depth:
                return f"nested deeper than {max_depth} levels{at}"
            if isinstance(node, dict):
                for key, child in node.items():
                    if isinstance(key, str) and "\x00" in key:
                        return f"keys {NUL_MESSAGE}{at}"
                    stack.append((child, depth + 1, f"{where}.{key}" if where else str(key)))
            else:
                stack.extend((child, depth + 1, f"{where}[{i}]") for i, child in enumerate(node))
        elif isinstance(node, str) and "\x00" in node:
            return f"strings {NUL_MESSAGE}{at}"
        elif isinstance(node, float) and not math.isfinite(node):
            return f"numbers must be finite{at}"
    if max_bytes is not None and len(json.dumps(value, default=str)) > max_bytes:
        return f"larger than {max_bytes} bytes as JSON"
    return None


def no_nul(value: Any) -> Any:
    """A field validator: a string, or a list of strings, without NUL bytes."""
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        if isinstance(item, str) and "\x00" in item:
            raise ValueError(NUL_MESSAGE + (f" (item {i})" if item is not value else ""))
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    _no_nul = field_validator("*")(no_nul)


class LoraSettings(_Strict):
    r: int = Field(8, gt=0, le=4096)
    alpha: int = Field(16, gt=0, le=65_536)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)


class ModelSettings(_Strict):
    path: str = Field("tiny:qwen2-vl", min_length=1, max_length=500)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    freeze_vision: bool = True
    lora: LoraSettings | None = None


COLUMN_NAME = Annotated[str, Field(min_length=1, max_length=200)]
TEMPLATE_MAX = 20_000  # characters of a prompt template
IMAGES_MARKER = "images"  # {images} in a prompt template: where the row's images go


class ColumnMap(_Strict):
    """Which source columns hold the prompt, the images, the answer and the system turn (``dataset.columns``), for
    datasets whose columns are named otherwise (``question``, ``image_1`` ... ``image_4``, ``solution``). A key left
    out keeps its default column (``prompt``, ``images``/``image``, ``answer``, none)."""

    prompt: COLUMN_NAME | None = None
    # one column (a list of images, or one image), or several gathered into one list in order, empty ones skipped
    images: COLUMN_NAME | list[COLUMN_NAME] | None = None
    answer: COLUMN_NAME | None = None  # reaches the rewards unchanged: a number, a string or a list of answers
    system: COLUMN_NAME | None = None

    @field_validator("images")
    @classmethod
    def _images_list(cls, value: Any) -> Any:
        if isinstance(value, list) and not 1 <= len(value) <= IMAGES_MAX:
            raise ValueError(f"a list of 1 to {IMAGES_MAX} image columns")
        return value

    @property
    def image_columns(self) -> list[str] | None:
        if self.images is None:
            return None
        return [self.images] if isinstance(self.images, str) else list(self.images)


def template_fields(template: str) -> list[str]:
    """The column names a prompt template uses, in order (``{images}`` included); raises ValueError for anything but
    plain ``{name}`` fields: no attribute or index access (``{x.__class__}`` reads Python internals), no
    conversion and no format spec."""
    import string

    fields = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"not a valid template ({exc}); write a literal brace as {{{{ or }}}}") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(
                f"{{{name}}}: a field is a column name like {{question}} (no attributes, indexes or numbers)"
            )
        if spec or conversion:
            raise ValueError(f"{{{name}}}: no format spec or conversion (write {{{name}}} alone)")
        fields.append(name)
    return fields


CHECK_SAMPLE_ROWS = 2_000  # dataset.check: sample checks this many rows before training
AUTO_FULL_CHECK_ROWS = 100_000  # dataset.check: auto checks every row of a split up to this size


class DatasetSettings(_Strict):
    source: str = Field("synth:count-red", min_length=1, max_length=500)
    split: str = Field("train", min_length=1, max_length=100)
    # the dataset's configuration (a Hub dataset's `configs:`, datasets' `name`), for sources that have several
    config_name: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[\w.-]+$")
    # bring your own data (docs/data.md): source columns for the prompt, images, answer and system turn; a prompt
    # built from the row's columns ({images} marks where the images go, else they come first); a system turn
    columns: ColumnMap | None = None
    prompt_template: str | None = Field(None, min_length=1, max_length=TEMPLATE_MAX)
    system_prompt: str | None = Field(None, min_length=1, max_length=TEMPLATE_MAX)
    # a row `collage data check` refuses (a corrupt image, a malformed line): skip: named in a warning event and
    # left out, the others used (a split with no usable row still fails); fail: the run fails before training
    bad_rows: Literal["skip", "fail"] = "skip"
    # the data check before training (docs/data.md, Large datasets). full: every row, cached per dataset fingerprint;
    # sample: a seeded sample of CHECK_SAMPLE_ROWS rows before training and every other row when a batch draws it
    # (a bad row drawn is skipped, or fails the run, as bad_rows says); auto: full up to AUTO_FULL_CHECK_ROWS rows
    check: Literal["auto", "full", "sample"] = "auto"
    rows: int = Field(256, gt=0, le=ROWS_MAX)
    min_images: int = Field(0, ge=0, le=IMAGES_MAX)
    max_images: int = Field(3, ge=0, le=IMAGES_MAX)
    seed: int = Field(0, ge=0, le=SEED_MAX)  # synth only: the dataset's own seed, independent of train.seed
    # held-out data for evaluation (train.eval_strategy; docs/training.md, Evaluation), one of three ways:
    # eval_split: another split of `source` (a synthetic task: the same task from another seed); with eval_source, the
    # split of that source (default train); eval_fraction: a deterministic slice of `split` that is never trained on
    eval_split: str | None = Field(None, min_length=1, max_length=100)
    eval_source: str | None = Field(None, min_length=1, max_length=500)
    eval_fraction: float | None = Field(None, gt=0.0, lt=1.0)

    @model_validator(mode="after")
    def _images_range(self) -> DatasetSettings:
        if self.max_images < self.min_images:
            raise ValueError(f"max_images ({self.max_images}) must be >= min_images ({self.min_images})")
        return self

    @field_validator("prompt_template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        if value is not None:
            fields = template_fields(value)
            if fields.count(IMAGES_MARKER) > 1:
                raise ValueError("{images} may appear once (it places all of the row's images)")
        return value

    @model_validator(mode="after")
    def _prompt_once(self) -> DatasetSettings:
        if self.prompt_template is not None and self.columns is not None and self.columns.prompt is not None:
            raise ValueError(
                "prompt_template: builds the prompt from the row's columns; it cannot be combined with columns.prompt "
                "(use {<column>} in the template instead)"
            )
        if self.system_prompt is not None and self.columns is not None and self.columns.system is not None:
            raise ValueError("system_prompt: a fixed system turn; it cannot be combined with columns.system")
        return self

    @model_validator(mode="after")
    def _one_eval_set(self) -> DatasetSettings:
        if self.eval_fraction is not None and (self.eval_split is not None or self.eval_source is not None):
            raise ValueError(
                "eval_fraction: holds out a slice of the training split; it cannot be combined with eval_split or "
                "eval_source (which name held-out data of their own)"
            )
        if self.eval_source is None and self.eval_split is not None and self.eval_split == self.split:
            raise ValueError(
                f"eval_split: {self.eval_split!r} is the training split itself: held-out data must be another split "
                "(or use eval_fraction)"
            )
        return self

    @property
    def has_eval_data(self) -> bool:
        return self.eval_split is not None or self.eval_source is not None or self.eval_fraction is not None


class RewardSettings(_Strict):
    name: str = Field(min_length=1, max_length=500)
    weight: float = Field(1.0, ge=-1e6, le=1e6)
    args: dict[str, Any] = Field(default_factory=dict)  # extra keyword arguments for the function
    # only for text reward models (a sequence-classification checkpoint): what to do with rows that have images
    on_images_for_text_reward: Literal["error", "drop"] = "error"

    @field_validator("args")
    @classmethod
    def _bounded_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        if (problem := json_problem(value)) is not None:
            raise ValueError(problem)
        return value


class TrainSettings(_Strict):
    """The ``train`` section. Keys TRL has carry TRL's names, defaults and meanings (``GRPOConfig`` /
    ``RLOOConfig`` 1.16); ``beta``'s default depends on the algorithm and is filled in by :class:`RunConfig`."""

    max_steps: int = Field(50, gt=0, le=STEPS_MAX)
    learning_rate: float = Field(1.0e-5, gt=0, le=1.0)
    per_device_train_batch_size: int = Field(4, gt=0, le=BATCH_MAX)
    gradient_accumulation_steps: int = Field(1, gt=0, le=BATCH_MAX)
    num_generations: int = Field(4, ge=2, le=BATCH_MAX)
    max_prompt_length: int | None = Field(512, gt=0, le=TOKENS_MAX)
    max_completion_length: int = Field(32, gt=0, le=COMPLETION_TOKENS_MAX)
    temperature: float = Field(1.0, gt=0, le=100.0)
    # sampling of completions, as TRL's: nucleus, top-k (0 = off), min-p, repetition penalty (1 = off)
    top_p: float = Field(1.0, gt=0, le=1.0)
    top_k: int = Field(0, ge=0, le=10_000_000)
    min_p: float | None = Field(None, ge=0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0, le=100.0)
    beta: float = Field(0.0, ge=0, le=COEF_MAX)  # GRPO's default; RunConfig fills in RLOO's (ALGORITHM_DEFAULTS)
    use_bias_correction_kl: bool = True  # GRPO, beta > 0: weight the KL term by the ratio (TRL's default)
    epsilon: float = Field(0.2, gt=0, le=100.0)
    epsilon_high: float | None = Field(None, gt=0, le=100.0)
    delta: float | None = Field(None, gt=0, le=COEF_MAX)  # GRPO: two-sided clipping (INTELLECT-2)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
    importance_sampling_level: Literal["token", "sequence"] = "token"  # GRPO; sequence = GSPO
    sapo_temperature_neg: float = Field(1.05, gt=0, le=COEF_MAX)
    sapo_temperature_pos: float = Field(1.0, gt=0, le=COEF_MAX)
    vespo_k_pos: float = Field(2.0, ge=0, le=COEF_MAX)
    vespo_lambda_pos: float = Field(3.0, ge=0, le=COEF_MAX)
    vespo_k_neg: float = Field(3.0, ge=0, le=COEF_MAX)
    vespo_lambda_neg: float = Field(2.0, ge=0, le=COEF_MAX)
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    normalize_advantages: bool = False
    top_entropy_quantile: float = Field(1.0, ge=0.0, le=1.0)
    entropy_coef: float = Field(0.0, ge=-COEF_MAX, le=COEF_MAX)
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = Field(0.6, ge=0.0, le=1.0)
    ref_model_sync_steps: int = Field(512, gt=0, le=STEPS_MAX)
    num_iterations: int = Field(1, gt=0, le=BATCH_MAX)
    steps_per_generation: int | None = Field(None, gt=0, le=BATCH_MAX)
    mask_truncated_completions: bool = False
    # who samples the completions: "hf" (transformers' generate). The seam for vLLM (colocated, weights synced
    # each step) is training.generation.BACKENDS; no vLLM backend ships until it is built and measured on a GPU
    generation_backend: Literal["hf"] = "hf"
    gradient_checkpointing: bool = False
    seed: int = Field(0, ge=0, le=SEED_MAX)
    save_steps: int = Field(0, ge=0, le=STEPS_MAX)
    # checkpoints kept (TRL's names): the newest save_total_limit, never deleting the newest nor the best by
    # metric_for_best_model (greater_is_better: None = True unless the metric's name ends in "loss", as TRL)
    save_total_limit: int | None = Field(None, gt=0, le=STEPS_MAX)
    metric_for_best_model: str | None = Field(None, min_length=1, max_length=100, pattern=r"^[\w./@+-]+$")
    greater_is_better: bool | None = None
    # held-out evaluation (TRL's names where TRL has them; docs/training.md, Evaluation)
    eval_strategy: Literal["no", "steps"] = "no"
    eval_steps: int | None = Field(None, gt=0, le=STEPS_MAX)  # None: every ceil(max_steps / 10) steps
    eval_on_start: bool = False  # evaluate the initial model too (step 0), for a baseline
    # completions per eval batch and process (a multiple of eval_num_generations); None: per_device_train_batch_size
    per_device_eval_batch_size: int | None = Field(None, gt=0, le=BATCH_MAX)
    eval_num_generations: int = Field(
        1, ge=1, le=BATCH_MAX
    )  # completions per held-out prompt (TRL: num_generations_eval)
    eval_temperature: float | None = Field(None, gt=0, le=100.0)  # None: greedy with one completion, else temperature
    eval_max_rows: int | None = Field(None, gt=0, le=ROWS_MAX)  # held-out prompts per evaluation (the first N)
    # eval/pass@k: a completion passes when this reward (default: accuracy, when the run has it) is >= the threshold
    eval_pass_reward: str | None = Field(None, min_length=1, max_length=500)
    eval_pass_threshold: float = Field(1.0, ge=-1e6, le=1e6)
    # not in TRL's GRPOConfig under these names, but users expect them
    weight_decay: float = Field(0.0, ge=0, le=100.0)
    max_grad_norm: float = Field(1.0, gt=0, le=1e6)
    lr_scheduler_type: Literal["linear", "constant", "cosine"] = "linear"
    warmup_steps: int = Field(0, ge=0, le=STEPS_MAX)

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _bool_scale_rewards(cls, value: Any) -> Any:
        # TRL accepts booleans here: True means "group", False means "none"
        if value is True:
            return "group"
        if value is False:
            return "none"
        return value

    @property
    def generation_steps(self) -> int:
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def eval_every(self) -> int:
        """Optimizer steps between evaluations (``eval_steps``, or about ten evaluations per run)."""
        return self.eval_steps or max(1, -(-self.max_steps // 10))

    @property
    def eval_batch_size(self) -> int:
        """Completions per eval batch and process."""
        return self.per_device_eval_batch_size or self.per_device_train_batch_size

    @property
    def eval_greedy(self) -> bool:
        return self.eval_num_generations == 1 and self.eval_temperature is None

    @property
    def best_is_greater(self) -> bool:
        if self.greater_is_better is not None:
            return self.greater_is_better
        return not (self.metric_for_best_model or "").endswith("loss")

    @property
    def generation_batch_size(self) -> int:
        """Completions per generation, per process."""
        return self.per_device_train_batch_size * self.generation_steps

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def epsilon_high_value(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class LoggingSettings(_Strict):
    samples_every: int = Field(1, ge=0, le=STEPS_MAX)  # 0 = never write rollout rows
    # TRL's report_to: the trackers a worker mirrors the run to (worker/trackers.py), by name only: where the data
    # goes is the operator's setting on the worker, never the client's. One name is a one-item list; TRL's "none" is [].
    report_to: list[Literal["trackio", "wandb", "none"]] = Field(default_factory=list, max_length=8)

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else [] if value is None else value

    @field_validator("report_to")
    @classmethod
    def _report_to_names(cls, value: list[str]) -> list[str]:
        if "none" in value and len(value) > 1:
            raise ValueError('"none" turns mirroring off: it cannot be listed with trackers')
        return list(dict.fromkeys(name for name in value if name != "none"))  # in order, each once


class ResourceSettings(_Strict):
    gpus: int = Field(1, ge=0, le=1024)
    queue: str = Field("default", min_length=1, max_length=100, pattern=r"^[\w.-]+$")


# Keys of one algorithm only (TRL's RLOOConfig has none of the GRPO ones, GRPOConfig not normalize_advantages).
GRPO_ONLY = (
    "loss_type",
    "scale_rewards",
    "use_bias_correction_kl",
    "delta",
    "importance_sampling_level",
    "sapo_temperature_neg",
    "sapo_temperature_pos",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "multi_objective_aggregation",
    "top_entropy_quantile",
    "entropy_coef",
)
RLOO_ONLY = ("normalize_advantages",)
# Defaults that differ between TRL's two configs: filled in when the key is absent (or null), so a resolved config
# written out (every key present) loads again unchanged.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {"grpo": {"beta": 0.0}, "rloo": {"beta": 0.05}}


class RunConfig(_Strict):
    name: str | None = Field(None, min_length=1, max_length=200)
    algorithm: Literal["grpo", "rloo"] = "grpo"
    tags: list[Annotated[str, Field(min_length=1, max_length=100)]] = Field(default_factory=list, max_length=50)
    model: ModelSettings = Field(default_factory=ModelSettings)
    dataset: DatasetSettings = Field(default_factory=DatasetSettings)
    rewards: list[RewardSettings] = Field(default_factory=lambda: [RewardSettings(name="accuracy")], min_length=1)
    train: TrainSettings = Field(default_factory=TrainSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    resources: ResourceSettings = Field(default_factory=ResourceSettings)

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        algorithm = data.get("algorithm", "grpo")
        defaults = ALGORITHM_DEFAULTS.get(algorithm) if isinstance(algorithm, str) else None
        if not defaults:
            return data  # an unknown algorithm is reported by the field itself
        train = data.get("train", {})
        if isinstance(train, dict):
            missing = {k: v for k, v in defaults.items() if train.get(k) is None}
            return {**data, "train": {**train, **missing}} if missing else data
        if isinstance(train, TrainSettings):
            missing = {k: v for k, v in defaults.items() if k not in train.model_fields_set}
            return {**data, "train": train.model_copy(update=missing)} if missing else data
        return data

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        t = self.train
        if t.generation_batch_size % t.num_generations:
            raise ValueError(
                f"train: per_device_train_batch_size x steps_per_generation = {t.generation_batch_size} must be a "
                f"multiple of num_generations = {t.num_generations} (each prompt's completions form one group)"
            )
        wrong = RLOO_ONLY if self.algorithm == "grpo" else GRPO_ONLY
        for key in wrong:
            # a resolved config (every key written out) must load again, so only a non-default value is an error
            if key in t.model_fields_set and getattr(t, key) != TrainSettings.model_fields[key].default:
                raise ValueError(f"train.{key}: does not apply to algorithm {self.algorithm}")
        if t.sync_ref_model:
            if t.beta == 0.0:
                raise ValueError(
                    "train.sync_ref_model: needs beta > 0; with beta 0 there is no reference model to synchronise"
                )
            if self.model.lora is not None:
                raise ValueError(
                    "train.sync_ref_model: not supported with model.lora: the reference is the base model with the "
                    "adapters disabled, not a copy that could be synchronised (TRL refuses it too)"
                )
        self._check_eval()
        if self.name is None:
            self.name = default_name(self)
        return self

    def _check_eval(self) -> None:
        t, d = self.train, self.dataset
        evaluates = t.eval_strategy != "no" or t.eval_on_start
        if evaluates and not d.has_eval_data:
            key = "eval_strategy" if t.eval_strategy != "no" else "eval_on_start"
            raise ValueError(
                f"train.{key}: needs held-out data: set dataset.eval_split, dataset.eval_source or dataset.eval_fraction"
            )
        if t.eval_batch_size % t.eval_num_generations:
            raise ValueError(
                f"train.per_device_eval_batch_size: {t.eval_batch_size} completions must be a multiple of "
                f"eval_num_generations = {t.eval_num_generations} (each held-out prompt's completions stay together)"
            )
        names = [r.name for r in self.rewards]
        if t.eval_pass_reward is not None and t.eval_pass_reward not in names:
            raise ValueError(f"train.eval_pass_reward: {t.eval_pass_reward!r} is not one of the run's rewards {names}")
        best = t.metric_for_best_model
        if best is not None and best.startswith("eval/"):
            if t.eval_strategy != "steps":
                raise ValueError(
                    f"train.metric_for_best_model: {best} is an evaluation metric: needs eval_strategy: steps"
                )
            if t.save_steps and t.save_steps % t.eval_every:
                raise ValueError(
                    f"train.save_steps: {t.save_steps} must be a multiple of eval_steps = {t.eval_every}, so every "
                    f"checkpoint has its {best} (as TRL requires for the best model)"
                )
        if t.save_total_limit is not None and t.save_steps == 0:
            raise ValueError("train.save_total_limit: has no effect with save_steps 0 (one checkpoint, at the end)")


def default_name(config: RunConfig) -> str:
    model = re.sub(r"[^A-Za-z0-9.]+", "-", config.model.path.split("/")[-1]).strip("-")[:80]
    data = re.sub(r"[^A-Za-z0-9.]+", "-", config.dataset.source.split("/")[-1]).strip("-")[:80]
    return f"{data}-{config.algorithm}-{model}".lower()


def error_path(loc: Sequence[Any]) -> str:
    """A pydantic error location as a config key path: ``("train", "loss_type")`` -> ``train.loss_type``,
    list indices as ``rewards[0]``; validator-internal parts are dropped."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            if parts:
                parts[-1] = f"{parts[-1]}[{item}]"
            else:
                parts.append(f"[{item}]")
        elif isinstance(item, str) and item and not item.startswith(("function-", "literal[")):
            parts.append(item)
    return ".".join(parts)


def error_message(err: Mapping[str, Any]) -> str:
    """A pydantic error as one plain sentence (the same wording in the CLI, the API and the launch form)."""
    kind = err.get("type")
    message = str(err.get("msg", "invalid"))
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "json_invalid":
        return f"malformed JSON: {err.get('ctx', {}).get('error', 'cannot be parsed')}"
    if kind == "literal_error":
        return "must be one of " + message.removeprefix("Input should be ")
    return message.removeprefix("Value error, ")


_FIELD_PREFIX = re.compile(r"^([a-z][a-z0-9_]*): ")


def format_errors(errors: Iterable[Mapping[str, Any]], root: str = "config") -> list[tuple[str, str]]:
    """Pydantic errors of a run config as ``(key path, message)`` pairs; a cross-field error whose message
    starts with its own path (``train.loss_type: ...``) is filed under that path."""
    out = []
    for err in errors:
        path, message = error_path(err.get("loc", ())) or root, error_message(err)
        if message.startswith(("train: ", "train.", "dataset.")):
            path, message = message.split(": ", 1)
        elif (field := _FIELD_PREFIX.match(message)) is not None and path != root:
            # a section's cross-field check names its field first ("eval_fraction: ..."): file it under that key
            path, message = f"{path}.{field.group(1)}", message[field.end() :]
        out.append((path, message))
    return out


def parse_config(data: Any) -> RunConfig:
    """Validate a config object (from YAML or JSON); raises :class:`ConfigError` listing every bad field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([("config", f"must be a mapping of keys, got {type(data).__name__}")])
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        errors = format_errors(exc.errors())
        raise ConfigError(errors) from None


_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def parse_override(item: str) -> tuple[str, Any]:
    """``key.path=value`` from the command line -> ``(key.path, value)``, the value parsed as YAML (``3``,
    ``1e-4``, ``true``, ``[a, b]``, ``{r: 4}``); an empty value is the empty string."""
    if "=" not in item:
        raise ConfigError([(item, "override must look like key.path=value")])
    key, text = item.split("=", 1)
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError([(key.strip(), f"value {text!r} is not valid YAML: {exc}")]) from None
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        value = float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string; every user means the number
    return key.strip(), value


_SEGMENT = re.compile(r"^([^\[\]]+)((?:\[\d+\])*)$")  # a key, then list indexes: rewards[0], a[1][2]


def _segments(key: str) -> list[str | int]:
    """``rewards[0].weight`` -> ``["rewards", 0, "weight"]``; a malformed path is a :class:`ConfigError`."""
    out: list[str | int] = []
    for part in key.split("."):
        match = _SEGMENT.match(part)
        if not key or match is None:
            raise ConfigError([(key or "overrides", "override keys are dotted paths like train.learning_rate")])
        out.append(match.group(1))
        out.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    return out


def _shown(segments: Sequence[str | int]) -> str:
    return "".join(f"[{s}]" if isinstance(s, int) else ("." if i else "") + s for i, s in enumerate(segments))


def apply_overrides(data: dict[str, Any], overrides: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """A copy of ``data`` with ``overrides`` applied in order: the one rule for ``collage train/submit --set``
    and the API's clone ``overrides``. A key is a dotted path (``train.learning_rate``) whose parts may pick an
    existing list item (``rewards[0].weight``); a mapping value is merged into a mapping already there
    (``{"train": {"max_steps": 5}}`` keeps the other ``train`` keys), anything else replaces it; missing or null
    mappings on the way are created, list items never are (an index past the end names the list's length)."""
    out = copy.deepcopy(data)
    for key, value in overrides:
        path = _segments(key)
        node: Any = out
        for depth, part in enumerate(path):
            last = depth == len(path) - 1
            where = _shown(path[:depth])
            if isinstance(part, int):
                if not isinstance(node, list):
                    raise ConfigError([(key, f"{where} is not a list: [{part}] picks an item of a list")])
                if part >= len(node):
                    items = f"{len(node)} item{'s' if len(node) != 1 else ''}"
                    raise ConfigError([(key, f"{where} has {items}: there is no item [{part}]")])
            elif not isinstance(node, dict):
                raise ConfigError([(key, f"{where} is not a mapping")])
            if last:
                node[part] = _merged(node[part] if isinstance(part, int) else node.get(part), value)
                break
            child = node[part] if isinstance(part, int) else node.get(part)
            if child is None and not isinstance(path[depth + 1], int):
                child = node[part] = {}
            node = child
    return out


def name_override_values(errors: list[tuple[str, str]], overrides: Sequence[tuple[str, Any]]) -> list[tuple[str, str]]:
    """Config errors with the value an override gave their key added (``rewards[0].weight: Input should be a valid
    number ... (--set gave 'x')``): the user sees which of their values was refused, not only where."""
    given = {key: value for key, value in overrides}
    return [(path, f"{message} (--set gave {given[path]!r})" if path in given else message) for path, message in errors]


def _merged(old: Any, new: Any) -> Any:
    if isinstance(old, dict) and isinstance(new, dict):
        out = dict(old)
        for k, v in new.items():
            out[k] = _merged(out.get(k), v)
        return out
    return copy.deepcopy(new)


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    file = Path(path)
    if not file.is_file():
        raise ConfigError([("config", f"file not found: {file}")])
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError([("config", f"{file} is not valid YAML: {exc}")]) from None
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError([("config", f"{file} must hold a mapping of keys")])
    parsed = [parse_override(item) for item in overrides or []]
    try:
        return parse_config(apply_overrides(data, parsed))
    except ConfigError as exc:
        raise ConfigError(name_override_values(exc.errors, parsed)) from None


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
