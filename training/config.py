"""The run config (``../shared/CONTRACTS.md`` section 1), validated with pydantic.

Names and meanings follow TRL's ``GRPOConfig`` / ``RLOOConfig`` wherever TRL has the same setting, so a TRL
user's values carry over. Unknown keys and wrong types are errors that name the key path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A bad run config; ``errors`` is a list of ``(path, message)``, one per bad field."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("\n".join(f"{path}: {message}" for path, message in errors))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class LoraSettings(_Strict):
    r: int = Field(8, gt=0)
    alpha: int = Field(16, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)


class ModelSettings(_Strict):
    path: str = Field("tiny:qwen2-vl", min_length=1, max_length=500)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    freeze_vision: bool = True
    lora: LoraSettings | None = None


class DatasetSettings(_Strict):
    source: str = Field("synth:count-red", min_length=1, max_length=500)
    split: str = Field("train", min_length=1, max_length=100)
    rows: int = Field(256, gt=0)
    min_images: int = Field(0, ge=0)
    max_images: int = Field(3, ge=0)
    seed: int = 0  # synth only: the dataset's own seed, independent of train.seed

    @model_validator(mode="after")
    def _images_range(self) -> DatasetSettings:
        if self.max_images < self.min_images:
            raise ValueError(f"max_images ({self.max_images}) must be >= min_images ({self.min_images})")
        return self


class RewardSettings(_Strict):
    name: str = Field(min_length=1, max_length=500)
    weight: float = 1.0
    args: dict[str, Any] = Field(default_factory=dict)  # extra keyword arguments for the function
    # only for text reward models (a sequence-classification checkpoint): what to do with rows that have images
    on_images_for_text_reward: Literal["error", "drop"] = "error"


class TrainSettings(_Strict):
    max_steps: int = Field(50, gt=0, le=2**31 - 1)
    learning_rate: float = Field(1.0e-5, gt=0)
    per_device_train_batch_size: int = Field(4, gt=0)
    gradient_accumulation_steps: int = Field(1, gt=0)
    num_generations: int = Field(4, ge=2)
    max_prompt_length: int | None = Field(512, gt=0)
    max_completion_length: int = Field(32, gt=0)
    temperature: float = Field(1.0, gt=0)
    beta: float = Field(0.0, ge=0)
    use_bias_correction_kl: bool = True  # GRPO, beta > 0: weight the KL term by the ratio (TRL's default)
    epsilon: float = Field(0.2, gt=0)
    epsilon_high: float | None = Field(None, gt=0)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    normalize_advantages: bool = False
    num_iterations: int = Field(1, gt=0)
    steps_per_generation: int | None = Field(None, gt=0)
    mask_truncated_completions: bool = False
    gradient_checkpointing: bool = False
    seed: int = 0
    save_steps: int = Field(0, ge=0)
    # not in TRL's GRPOConfig under these names, but users expect them
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    lr_scheduler_type: Literal["linear", "constant", "cosine"] = "linear"
    warmup_steps: int = Field(0, ge=0)

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
    samples_every: int = Field(1, ge=0)  # 0 = never write rollout rows


class ResourceSettings(_Strict):
    gpus: int = Field(1, ge=0)
    queue: str = Field("default", min_length=1, max_length=100, pattern=r"^[\w.-]+$")


GRPO_ONLY = ("loss_type", "scale_rewards")
RLOO_ONLY = ("normalize_advantages",)


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
        if self.name is None:
            self.name = default_name(self)
        return self


def default_name(config: RunConfig) -> str:
    model = re.sub(r"[^A-Za-z0-9.]+", "-", config.model.path.split("/")[-1]).strip("-")[:80]
    data = re.sub(r"[^A-Za-z0-9.]+", "-", config.dataset.source.split("/")[-1]).strip("-")[:80]
    return f"{data}-{config.algorithm}-{model}".lower()


def _path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1 if parts else 0 :] = [f"{parts[-1] if parts else ''}[{item}]"]
        elif isinstance(item, str) and item and not item.startswith(("function-", "literal[")):
            parts.append(item)
    return ".".join(parts) or "config"


def parse_config(data: Any) -> RunConfig:
    """Validate a config object (from YAML or JSON); raises :class:`ConfigError` listing every bad field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([("config", f"must be a mapping of keys, got {type(data).__name__}")])
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        errors = []
        for err in exc.errors():
            message = err["msg"].removeprefix("Value error, ")
            path = _path(err["loc"])
            if err["type"] == "extra_forbidden":
                message = "unknown key"
            elif err["type"] == "literal_error":
                message = "must be one of " + err["msg"].removeprefix("Input should be ")
            if message.startswith("train: ") or message.startswith("train."):
                path, message = message.split(": ", 1)
            errors.append((path, message))
        raise ConfigError(errors) from None


def _coerce(text: str) -> Any:
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides (values parsed as YAML scalars: ``3``, ``1e-4``, ``true``, ``[a, b]``)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError([(item, "override must look like key.path=value")])
        key, value = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError([(key, f"{part} is not a mapping")])
            node = child
        node[parts[-1]] = _coerce(value)
    return data


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
    return parse_config(apply_overrides(data, overrides or []))


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
