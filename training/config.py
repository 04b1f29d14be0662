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

from collage.training.infra.errors import InputError


class ConfigError(InputError):
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
    r: int = Field(8, gt=0, le=4096, description="LoRA rank: the adapters' inner dimension (peft: r).")
    alpha: int = Field(
        16, gt=0, le=65_536, description="LoRA scale: the update is multiplied by alpha / r (peft: lora_alpha)."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input (peft: lora_dropout).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"],
        min_length=1,
        description=(
            "Names of the language model's linear layers that get adapters (peft: target_modules); the vision tower "
            "stays frozen unless model.freeze_vision is false."
        ),
    )


class ModelSettings(_Strict):
    path: str = Field(
        "tiny:qwen2-vl",
        min_length=1,
        max_length=500,
        description=(
            "The model to train: a local folder, a hub id (needs internet), or tiny:<family> (a tiny random-weight "
            "model built locally, for tests and demos). A local path must lie under COLLAGE_MODEL_ROOTS on a server."
        ),
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Weights' dtype: auto keeps the checkpoint's."
    )
    freeze_vision: bool = Field(
        True, description="Keep the vision tower and projector frozen (only the language model trains)."
    )
    lora: LoraSettings | None = Field(
        None, description="Train LoRA adapters instead of the full model (peft); empty = full fine-tuning."
    )


COLUMN_NAME = Annotated[str, Field(min_length=1, max_length=200)]
TEMPLATE_MAX = 20_000  # characters of a prompt template
IMAGES_MARKER = "images"  # {images} in a prompt template: where the row's images go


class ColumnMap(_Strict):
    """Which source columns hold the prompt, the images, the answer and the system turn (``dataset.columns``), for
    datasets whose columns are named otherwise (``question``, ``image_1`` ... ``image_4``, ``solution``). A key left
    out keeps its default column (``prompt``, ``images``/``image``, ``answer``, none)."""

    prompt: COLUMN_NAME | None = Field(
        None, description="The source column holding the prompt (a string or a conversation); empty = prompt."
    )
    # one column (a list of images, or one image), or several gathered into one list in order, empty ones skipped
    images: COLUMN_NAME | list[COLUMN_NAME] | None = Field(
        None,
        description=(
            "The source column(s) holding the images: one column (a list or one image), or several gathered in order,"
            " empty ones skipped ([image_1, image_2]); empty = images or image."
        ),
    )
    answer: COLUMN_NAME | None = Field(
        None,
        description=(
            "The source column holding the answer, passed to the rewards unchanged (a number, a string or a list of "
            "acceptable answers); a prompt-completion dataset's completion is used when empty."
        ),
    )  # reaches the rewards unchanged: a number, a string or a list of answers
    system: COLUMN_NAME | None = Field(None, description="The source column holding a system turn; empty = none.")

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
        raise ValueError(f"not a valid template ({exc}); write a literal brace as {{{{ or }}}}") from exc
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


TEMPLATE_FIELDS_MAX = 64  # dataset.prompt_template: {column} fields a template may have
# dataset.prompt_template: the longest prompt (characters) one row's rendering may make
PROMPT_MAX_CHARS = 1_000_000
CHECK_SAMPLE_ROWS = 2_000  # dataset.check: sample checks this many rows before training
AUTO_FULL_CHECK_ROWS = 100_000  # dataset.check: auto checks every row of a split up to this size


class DatasetSettings(_Strict):
    source: str = Field(
        "synth:count-red",
        min_length=1,
        max_length=500,
        description=(
            "The training data: a JSONL/Parquet/CSV file or folder, a save_to_disk folder, a local Hub snapshot, "
            "synth:<task>, or a hub id (needs internet). A local path must lie under COLLAGE_DATA_ROOTS on a server "
            "(docs/data.md)."
        ),
    )
    split: str = Field(
        "train",
        min_length=1,
        max_length=100,
        description="Split of the dataset to train on (a DatasetDict's split, <split>.jsonl in a folder, a hub split).",
    )
    # the dataset's configuration (a Hub dataset's `configs:`, datasets' `name`), for sources that have several
    config_name: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        pattern=r"^[\w.-]+$",
        description="A Hub dataset's configuration (its card's configs:); empty = the default.",
    )
    # bring your own data (docs/data.md): source columns for the prompt, images, answer and system turn; a prompt
    # built from the row's columns ({images} marks where the images go, else they come first); a system turn
    columns: ColumnMap | None = Field(
        None, description="Which source columns hold the prompt, images, answer and system turn; empty = TRL's names."
    )
    prompt_template: str | None = Field(
        None,
        min_length=1,
        max_length=TEMPLATE_MAX,
        description=(
            "Build the prompt from the row's columns: {question} is a column's value, {images} where the images go "
            "(else first). Not with a mapped prompt column. Empty = the prompt column as it is."
        ),
    )
    system_prompt: str | None = Field(
        None,
        min_length=1,
        max_length=TEMPLATE_MAX,
        description="A system turn for every row (a conversation with its own keeps it). Empty = none.",
    )
    # a row `collage data check` refuses (a corrupt image, a malformed line): skip: named in a warning event and
    # left out, the others used (a split with no usable row still fails); fail: the run fails before training
    bad_rows: Literal["skip", "fail"] = Field(
        "skip",
        description=(
            "Rows the data check refuses: skip (left out, each named in a warning) or fail (the run fails first)."
        ),
    )
    # the data check before training (docs/data.md, Large datasets). full: every row, cached per dataset fingerprint;
    # sample: a seeded sample of CHECK_SAMPLE_ROWS rows before training and every other row when a batch draws it
    # (a bad row drawn is skipped, or fails the run, as bad_rows says); auto: full up to AUTO_FULL_CHECK_ROWS rows
    check: Literal["auto", "full", "sample"] = Field(
        "auto",
        description=(
            "The data check before training: full (every row, cached), sample (2,000 rows first, every other row when"
            " a batch draws it), auto (full up to 100,000 rows)."
        ),
    )
    rows: int = Field(256, gt=0, le=ROWS_MAX, description="synth:<task> only: how many rows to generate.")
    min_images: int = Field(
        0, ge=0, le=IMAGES_MAX, description="synth:<task> only: fewest images per row; 0 mixes text-only rows in."
    )
    max_images: int = Field(3, ge=0, le=IMAGES_MAX, description="synth:<task> only: most images per row.")
    seed: int = Field(
        0, ge=0, le=SEED_MAX, description="synth:<task> only: the dataset's seed."
    )  # synth only: the dataset's own seed, independent of train.seed
    # held-out data for evaluation (train.eval_strategy; docs/training.md, Evaluation), one of three ways:
    # eval_split: another split of `source` (a synthetic task: the same task from another seed); with eval_source, the
    # split of that source (default train); eval_fraction: a deterministic slice of `split` that is never trained on
    eval_split: str | None = Field(
        None,
        min_length=1,
        max_length=100,
        description=(
            "Held-out data for evaluation: another split of the source (e.g. test of a DatasetDict); for "
            "synth:<task>, any name gives the same task from another seed. Empty = none (TRL: eval_dataset)."
        ),
    )
    eval_source: str | None = Field(
        None,
        min_length=1,
        max_length=500,
        description=(
            "Held-out data from another dataset (a path or hub id, like source); its split is eval_split, default "
            "train. Empty = none."
        ),
    )
    eval_fraction: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description=(
            "Held-out data from the training split: this fraction of its rows (0..1, a deterministic slice by the "
            "dataset seed) is never trained on, only evaluated. Not with eval_split or eval_source. Empty = none."
        ),
    )

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
            if len(fields) > TEMPLATE_FIELDS_MAX:
                raise ValueError(
                    f"{len(fields)} {{column}} fields, more than the {TEMPLATE_FIELDS_MAX} a template may have (each "
                    "copies a cell into every row's prompt)"
                )
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
    name: str = Field(
        min_length=1,
        max_length=500,
        description=(
            "A built-in reward (accuracy, closeness, numeric, format, length, ...), an import path module:function "
            "the operator allowlisted (COLLAGE_REWARD_MODULES), or a text reward model (a sequence-classification "
            "checkpoint)."
        ),
    )
    weight: float = Field(
        1.0, ge=-1e6, le=1e6, description="The reward's weight in the total reward (TRL: reward_weights)."
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments for the reward function (JSON values, bounded in size).",
    )  # extra keyword arguments for the function
    # only for text reward models (a sequence-classification checkpoint): what to do with rows that have images
    on_images_for_text_reward: Literal["error", "drop"] = Field(
        "error",
        description=(
            "For a text reward model, which cannot see images: error refuses rows with images before training; drop "
            "scores their text alone (a warning event says so)."
        ),
    )

    @field_validator("args")
    @classmethod
    def _bounded_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        if (problem := json_problem(value)) is not None:
            raise ValueError(problem)
        return value


class ToolSettings(_Strict):
    """One entry of the top-level ``tools`` list: a tool the model may call during a rollout (docs/tools.md)."""

    name: str = Field(
        min_length=1,
        max_length=500,
        description=(
            "A built-in image tool (image_zoom_in: a crop of a region of an image; image_rotate: an image turned by "
            "90, 180 or 270 degrees) or an import path package.module:function the operator allowlisted "
            "(COLLAGE_TOOL_MODULES): a function with type hints and a docstring, its JSON schema read from them as in "
            "TRL."
        ),
    )
    coords: Literal["pixel", "normalised"] = Field(
        "pixel",
        description=(
            "image_zoom_in only: bbox_2d in the pixel coordinates of the image it names (pixel) or as fractions 0..1 "
            "of its width and height (normalised, Mini-o3's convention)."
        ),
    )
    timeout: float = Field(
        10.0,
        gt=0,
        le=600,
        description=(
            "Seconds one call of this tool may take; past it the model sees a tool error (the call's thread is "
            "abandoned, never waited for)."
        ),
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments the tool always receives (JSON values; not shown to the model).",
    )

    @field_validator("args")
    @classmethod
    def _bounded_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        if (problem := json_problem(value)) is not None:
            raise ValueError(problem)
        return value


class TrainSettings(_Strict):
    """The ``train`` section. Keys TRL has carry TRL's names, defaults and meanings (``GRPOConfig`` /
    ``RLOOConfig`` 1.16); ``beta``'s default depends on the algorithm and is filled in by :class:`RunConfig`."""

    max_steps: int = Field(50, gt=0, le=STEPS_MAX, description="Optimizer steps to run (TRL: max_steps).")
    learning_rate: float = Field(1.0e-5, gt=0, le=1.0, description="AdamW learning rate (TRL: learning_rate).")
    per_device_train_batch_size: int = Field(
        4, gt=0, le=BATCH_MAX, description="Completions per micro-batch per device (TRL: per_device_train_batch_size)."
    )
    gradient_accumulation_steps: int = Field(
        1, gt=0, le=BATCH_MAX, description="Micro-batches per optimizer step (TRL: gradient_accumulation_steps)."
    )
    num_generations: int = Field(
        4, ge=2, le=BATCH_MAX, description="Completions sampled per prompt: one group (TRL: num_generations)."
    )
    max_prompt_length: int | None = Field(
        512,
        gt=0,
        le=TOKENS_MAX,
        description="Prompt token limit; text is cut oldest-first, image tokens never (TRL: max_prompt_length).",
    )
    max_completion_length: int = Field(
        32, gt=0, le=COMPLETION_TOKENS_MAX, description="Most tokens per completion (TRL: max_completion_length)."
    )
    temperature: float = Field(
        1.0, gt=0, le=100.0, description="Sampling temperature for completions and log-probs (TRL: temperature)."
    )
    # sampling of completions, as TRL's: nucleus, top-k (0 = off), min-p, repetition penalty (1 = off)
    top_p: float = Field(
        1.0,
        gt=0,
        le=1.0,
        description=(
            "Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1.0 = off (TRL: top_p)."
        ),
    )
    top_k: int = Field(
        0, ge=0, le=10_000_000, description="Sample among the k most likely tokens; 0 = off (TRL: top_k)."
    )
    min_p: float | None = Field(
        None,
        ge=0,
        le=1.0,
        description="Drop tokens less likely than min_p times the most likely one; empty = off (TRL: min_p).",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0,
        le=100.0,
        description="Penalise tokens already in the prompt or completion; 1.0 = off (TRL: repetition_penalty).",
    )
    beta: float = Field(
        0.0,
        ge=0,
        le=COEF_MAX,
        description=(
            "KL coefficient; empty = the algorithm's TRL default (GRPO 0.0, RLOO 0.05). > 0 needs a reference model; "
            "with LoRA the adapters are disabled instead of copying the model (TRL: beta; DeepSeek-R1 used 0.001)."
        ),
    )  # GRPO's default; RunConfig fills in RLOO's (ALGORITHM_DEFAULTS)
    use_bias_correction_kl: bool = Field(
        True,
        description=(
            "GRPO with beta > 0: multiply the KL term by the importance ratio, so its gradient is the unbiased "
            "reverse-KL gradient even on-policy; the kl metric is logged with the same weighting, as TRL logs it "
            "(TRL: use_bias_correction_kl; DeepSeek-V3.2, arXiv 2512.02556)."
        ),
    )  # GRPO, beta > 0: weight the KL term by the ratio (TRL's default)
    epsilon: float = Field(0.2, gt=0, le=100.0, description="Lower clip range of the ratio (TRL: epsilon).")
    epsilon_high: float | None = Field(
        None,
        gt=0,
        le=100.0,
        description=(
            "Upper clip range; empty = epsilon (TRL: epsilon_high; DAPO's clip-higher recommends 0.28). With "
            "loss_type cispo it is the cap of the importance weight itself (ScaleRL, arXiv 2510.13786, recommends "
            "5.0)."
        ),
    )
    delta: float | None = Field(
        None,
        gt=0,
        le=COEF_MAX,
        description=(
            "Two-sided clipping: also cap the unclipped ratio at delta, bounding updates on negative advantages; "
            "empty = off, TRL recommends > 1 + epsilon (TRL: delta; INTELLECT-2, arXiv 2505.07291). Clipped loss "
            "types only."
        ),
    )  # GRPO: two-sided clipping (INTELLECT-2)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "dapo",
        description=(
            "How the policy term is built and normalised (TRL: loss_type). grpo: each sequence's token mean, then the"
            " mean over sequences (length-biased); bnpo: over the micro-batch's tokens; dr_grpo: by batch size x "
            "max_completion_length (Dr. GRPO); dapo: over the generation batch's tokens (DAPO); cispo: clip the "
            "detached importance weight times A log pi, every token keeps a gradient (MiniMax-M1, arXiv 2506.13585); "
            "sapo: a smooth gate sigmoid(tau (r - 1)) 4 / tau instead of the hard clip (SAPO, arXiv 2511.20347); "
            "luspo: each sequence summed, then the mean over sequences, a length-unbiased GSPO for "
            "importance_sampling_level sequence (LUSPO, arXiv 2602.05261); vespo: -phi(w) A log pi with phi(w) = "
            "e^lambda w^k e^(-lambda w) of the sequence ratio, dapo's normaliser (VESPO, arXiv 2602.10693)."
        ),
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description=(
            "token: one importance ratio per token; sequence: one per sequence, exp of the mean token log-ratio "
            "(GSPO, Zheng et al. 2025, arXiv 2507.18071; meant for loss_type grpo or luspo: with bnpo, dr_grpo, dapo "
            "or cispo it weights sequences by length, and a warning event says so) (TRL: importance_sampling_level)."
        ),
    )  # GRPO; sequence = GSPO
    sapo_temperature_neg: float = Field(
        1.05,
        gt=0,
        le=COEF_MAX,
        description=(
            "loss_type sapo: gate temperature for tokens with non-positive advantage (TRL: sapo_temperature_neg; SAPO)."
        ),
    )
    sapo_temperature_pos: float = Field(
        1.0,
        gt=0,
        le=COEF_MAX,
        description=(
            "loss_type sapo: gate temperature for tokens with positive advantage (TRL: sapo_temperature_pos; SAPO)."
        ),
    )
    vespo_k_pos: float = Field(
        2.0,
        ge=0,
        le=COEF_MAX,
        description=(
            "loss_type vespo, positive advantages: power k of the gamma weight, how hard ratios < 1 are down-weighted"
            " (TRL: vespo_k_pos; VESPO)."
        ),
    )
    vespo_lambda_pos: float = Field(
        3.0,
        ge=0,
        le=COEF_MAX,
        description=(
            "loss_type vespo, positive advantages: decay lambda, how hard ratios > 1 are down-weighted (TRL: "
            "vespo_lambda_pos; VESPO)."
        ),
    )
    vespo_k_neg: float = Field(
        3.0, ge=0, le=COEF_MAX, description="loss_type vespo, negative advantages: power k (TRL: vespo_k_neg; VESPO)."
    )
    vespo_lambda_neg: float = Field(
        2.0,
        ge=0,
        le=COEF_MAX,
        description="loss_type vespo, negative advantages: decay lambda (TRL: vespo_lambda_neg; VESPO).",
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize",
        description=(
            "Several rewards: sum the weighted rewards then normalise (scale_rewards), or normalise each reward in "
            "its group, sum, and standardise over the batch (TRL: multi_objective_aggregation; GDPO, arXiv "
            "2601.05242)."
        ),
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description=(
            "Divide advantages by the group std, the batch std (PPO Lite), or not at all (Dr. GRPO) (TRL: "
            "scale_rewards)."
        ),
    )
    normalize_advantages: bool = Field(
        False, description="RLOO: standardise the advantages over the generation batch (TRL: normalize_advantages)."
    )
    top_entropy_quantile: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description=(
            "Keep in the policy loss only the top rho fraction of tokens by entropy; 1.0 keeps all, 0.0 only the "
            "highest, the paper recommends 0.2 (TRL: top_entropy_quantile; Beyond the 80/20 Rule, arXiv 2506.01939)."
        ),
    )
    entropy_coef: float = Field(
        0.0,
        ge=-COEF_MAX,
        le=COEF_MAX,
        description=(
            "Entropy bonus: the loss minus entropy_coef times the mean per-token entropy (of the tokens "
            "top_entropy_quantile keeps), the same for every loss_type, with gradients through the entropy; 0 = off. "
            "The loss metric is then the total and policy_loss the policy term (TRL: entropy_coef)."
        ),
    )
    sync_ref_model: bool = Field(
        False,
        description=(
            "Move the reference model towards the policy every ref_model_sync_steps steps; needs beta > 0, not with "
            "LoRA (TRL: sync_ref_model; TR-DPO, arXiv 2404.09656)."
        ),
    )
    ref_model_mixup_alpha: float = Field(
        0.6,
        ge=0.0,
        le=1.0,
        description=(
            "With sync_ref_model: ref = alpha x policy + (1 - alpha) x ref at each sync (TRL: ref_model_mixup_alpha; "
            "TR-DPO's alpha)."
        ),
    )
    ref_model_sync_steps: int = Field(
        512,
        gt=0,
        le=STEPS_MAX,
        description="With sync_ref_model: optimizer steps between syncs (TRL: ref_model_sync_steps; TR-DPO's tau).",
    )
    num_iterations: int = Field(
        1, gt=0, le=BATCH_MAX, description="Updates per generation batch (TRL: num_iterations, GRPO's mu)."
    )
    steps_per_generation: int | None = Field(
        None,
        gt=0,
        le=BATCH_MAX,
        description="Micro-batches per generation; empty = gradient_accumulation_steps (TRL: steps_per_generation).",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="Leave completions that hit the length limit out of the loss (TRL: mask_truncated_completions).",
    )
    max_tool_calling_iterations: int = Field(
        4,
        ge=0,
        le=64,
        description=(
            "With tools: the most tool calls one training rollout may make; the model's turn after the last allowed "
            "call ends the rollout (TRL: max_tool_calling_iterations). max_completion_length counts every assistant "
            "and tool token of the rollout."
        ),
    )
    eval_max_tool_calling_iterations: int | None = Field(
        None,
        ge=0,
        le=64,
        description=(
            "With tools: the most tool calls of an evaluation rollout; empty = max_tool_calling_iterations (Mini-o3 "
            "evaluates with more turns than it trains)."
        ),
    )
    max_images_per_rollout: int = Field(
        16,
        ge=1,
        le=256,
        description=(
            "With tools: the most images one rollout may hold, the row's own included; a tool result that would "
            "pass it becomes a tool error the model sees."
        ),
    )
    mask_capped_trajectories: bool = Field(
        False,
        description=(
            "With tools: leave rollouts that still called a tool when max_tool_calling_iterations ran out out of "
            "the loss (Mini-o3's over-turn masking), as mask_truncated_completions does for the length limit."
        ),
    )
    # who samples the completions: "hf" (transformers' generate). The seam for vLLM (colocated, weights synced
    # each step) is training.generation.BACKENDS; no vLLM backend ships until it is built and measured on a GPU
    generation_backend: Literal["hf"] = Field(
        "hf",
        description=(
            "Who samples completions: hf (transformers' generate, each prompt prefilled once and its KV cache forked "
            "to its group, docs/batching.md) is the only backend. The seam is training.generation.BACKENDS; a vLLM "
            "backend is not shipped: it has to be built and measured on a GPU."
        ),
    )
    gradient_checkpointing: bool = Field(
        False,
        description=(
            "Recompute activations in the backward pass: less memory, more compute (TRL: gradient_checkpointing)."
        ),
    )
    seed: int = Field(
        0,
        ge=0,
        le=SEED_MAX,
        description="Seed of sampling and the data order (TRL: seed); the dataset's own seed is dataset.seed.",
    )
    save_steps: int = Field(
        0,
        ge=0,
        le=STEPS_MAX,
        description="Checkpoint every N steps; 0 = only at the end (and on cancel) (TRL: save_steps).",
    )
    # checkpoints kept (TRL's names): the newest save_total_limit, never deleting the newest nor the best by
    # metric_for_best_model (greater_is_better: None = True unless the metric's name ends in "loss", as TRL)
    save_total_limit: int | None = Field(
        None,
        gt=0,
        le=STEPS_MAX,
        description=(
            "Keep only the newest N checkpoints, never deleting the newest nor the best by metric_for_best_model; "
            "empty = keep all; needs save_steps > 0 (TRL: save_total_limit)."
        ),
    )
    metric_for_best_model: str | None = Field(
        None,
        min_length=1,
        max_length=100,
        pattern=r"^[\w./@+-]+$",
        description=(
            "The metric that ranks checkpoints for best (e.g. eval/reward: with eval_strategy steps and save_steps a "
            "multiple of eval_steps); empty = none (TRL: metric_for_best_model)."
        ),
    )
    greater_is_better: bool | None = Field(
        None,
        description=(
            "Whether a higher metric_for_best_model is better; auto = yes unless its name ends in loss (TRL: "
            "greater_is_better)."
        ),
    )
    # held-out evaluation (TRL's names where TRL has them; docs/training.md, Evaluation)
    eval_strategy: Literal["no", "steps"] = Field(
        "no",
        description=(
            "Evaluate on the held-out data (a dataset eval_* key) every eval_steps steps, or never (TRL: "
            "eval_strategy; epoch is not offered: runs count steps)."
        ),
    )
    eval_steps: int | None = Field(
        None,
        gt=0,
        le=STEPS_MAX,
        description=(
            "Optimizer steps between evaluations; empty = about ten per run, every ceil(max_steps / 10) (TRL: "
            "eval_steps)."
        ),
    )  # None: every ceil(max_steps / 10) steps
    eval_on_start: bool = Field(
        False,
        description=(
            "Also evaluate the initial model, at step 0: the baseline the curve starts from (TRL: eval_on_start)."
        ),
    )  # evaluate the initial model too (step 0), for a baseline
    # completions per eval batch and process (a multiple of eval_num_generations); None: per_device_train_batch_size
    per_device_eval_batch_size: int | None = Field(
        None,
        gt=0,
        le=BATCH_MAX,
        description=(
            "Completions per evaluation batch and process, a multiple of eval_num_generations; empty = "
            "per_device_train_batch_size (TRL: per_device_eval_batch_size)."
        ),
    )
    eval_num_generations: int = Field(
        1,
        ge=1,
        le=BATCH_MAX,
        description=(
            "Completions per held-out prompt; eval/pass@k is reported for k = 1 and this (TRL: num_generations_eval)."
        ),
    )  # completions per held-out prompt (TRL: num_generations_eval)
    eval_temperature: float | None = Field(
        None,
        gt=0,
        le=100.0,
        description=(
            "Sampling temperature of the evaluation; empty = greedy with one completion per prompt, else temperature."
        ),
    )  # None: greedy with one completion, else temperature
    eval_max_rows: int | None = Field(
        None, gt=0, le=ROWS_MAX, description="Held-out prompts per evaluation (the first N); empty = all of them."
    )  # held-out prompts per evaluation (the first N)
    # eval/pass@k: a completion passes when this reward (default: accuracy, when the run has it) is >= the threshold
    eval_pass_reward: str | None = Field(
        None,
        min_length=1,
        max_length=500,
        description=(
            "The reward whose value decides eval/pass@k (a completion passes at >= eval_pass_threshold); empty = "
            "accuracy when the run has it."
        ),
    )
    eval_pass_threshold: float = Field(
        1.0, ge=-1e6, le=1e6, description="The pass reward's value at which a completion passes (eval/pass@k)."
    )
    # not in TRL's GRPOConfig under these names, but users expect them
    weight_decay: float = Field(0.0, ge=0, le=100.0, description="AdamW weight decay (TRL: weight_decay).")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="Gradient clipping norm (TRL: max_grad_norm).")
    lr_scheduler_type: Literal["linear", "constant", "cosine"] = Field(
        "linear", description="Learning-rate schedule (TRL: lr_scheduler_type)."
    )
    warmup_steps: int = Field(0, ge=0, le=STEPS_MAX, description="Warm-up steps of the schedule (TRL: warmup_steps).")

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
    samples_every: int = Field(
        1, ge=0, le=STEPS_MAX, description="Write the rollout table every N steps; 0 = never (TRL: log_completions)."
    )  # 0 = never write rollout rows
    # TRL's report_to: the trackers a worker mirrors the run to (worker/trackers.py), by name only: where the data
    # goes is the operator's setting on the worker, never the client's. One name is a one-item list; TRL's "none" is [].
    report_to: list[Literal["trackio", "wandb", "none"]] = Field(
        default_factory=list,
        max_length=8,
        description=(
            "Trackers the run is mirrored to, trackio and/or wandb (none or empty: none); names only, their settings "
            "come from the environment of the process that trains (TRL: report_to; docs/trackers.md)."
        ),
    )

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


class FsdpSettings(_Strict):
    """accelerate's FSDP plugin settings Collage keeps (FSDP2 only: ``fsdp_version: 2``)."""

    reshard_after_forward: bool = Field(
        True,
        description=(
            "Free each block's gathered weights after its forward and gather them again for backward (ZeRO-3; "
            "less memory); false keeps them until backward (ZeRO-2-like: one gather fewer per step, more memory)."
        ),
    )
    cpu_offload: bool = Field(
        False,
        description=(
            "Keep the sharded parameters, their gradients and the optimizer state in CPU memory (FSDP2's "
            "CPUOffloadPolicy; the optimizer steps on the CPU): far less GPU memory, slower steps. A CPU run "
            "(gpus: 0) has everything there already and ignores it."
        ),
    )
    state_dict_type: Literal["sharded", "full"] = Field(
        "sharded",
        description=(
            "How checkpoints are written: sharded = each process writes its own shards with "
            "torch.distributed.checkpoint (no process ever holds the whole model; resumable with another process "
            "count); full = the whole model gathered on the main process into a plain transformers folder."
        ),
    )


class ResourceSettings(_Strict):
    gpus: int = Field(
        1, ge=0, le=1024, description="GPUs for the run: 0 = CPU; > 1 = one multi-GPU run through accelerate."
    )
    queue: str = Field(
        "default", min_length=1, max_length=100, pattern=r"^[\w.-]+$", description="Worker queue to run on."
    )
    processes: int | None = Field(
        None,
        ge=1,
        le=1024,
        description=(
            "Training processes of the run. With gpus: 0, N CPU processes over gloo, launched as a multi-GPU run is "
            "(accelerate launch; the worker's path of multi-process runs without a GPU); with gpus > 0 one process "
            "per GPU, so empty or equal to gpus. Empty: one per GPU, or one on the CPU."
        ),
    )

    nodes: int = Field(
        1,
        ge=1,
        le=256,
        description=(
            "Hosts of the run: N > 1 = one run on N worker slots of its queue, on N hosts, started together or not "
            "at all, their processes joined by torchrun's c10d rendezvous (gpus, or processes with gpus: 0, on each "
            "host); any host's loss fails the attempt on every host, and a resume takes any N live slots. Read by "
            "workers; under a launcher you bring it is the launcher's --nnodes (docs/scaling.md)."
        ),
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description=(
            "How a multi-process run shares the model: ddp = every process holds the whole policy, reference, "
            "gradients and optimizer state; fsdp = FSDP2, each process holds 1/N of them (the policy and the "
            "reference sharded by decoder layer and vision block). A one-process run ignores it."
        ),
    )
    fsdp: FsdpSettings = Field(default_factory=FsdpSettings, description="FSDP2 settings (read with strategy: fsdp).")

    @model_validator(mode="after")
    def _one_process_per_gpu(self) -> ResourceSettings:
        if self.gpus > 0 and self.processes is not None and self.processes != self.gpus:
            raise ValueError(
                f"processes: a GPU run has one process per GPU ({self.gpus}); leave processes empty, or use gpus: 0 "
                f"for {self.processes} CPU processes"
            )
        if self.nodes > 1 and self.strategy == "fsdp":
            raise ValueError(
                f"nodes: a run on {self.nodes} hosts trains with strategy: ddp; FSDP2 across hosts would leave each "
                "host's shards of a checkpoint on that host's disk, and uploading them all before the checkpoint is "
                "recorded is not built yet (one host with several GPUs shards fine)"
            )
        return self

    @property
    def per_node(self) -> int:
        """How many training processes each host of the run starts."""
        return self.gpus if self.gpus > 0 else (self.processes or 1)

    @property
    def world_size(self) -> int:
        """How many training processes the run has (on all its hosts)."""
        return self.nodes * self.per_node

    @property
    def sharded(self) -> bool:
        """Whether the run shards its model (FSDP2 over more than one process)."""
        return self.strategy == "fsdp" and self.world_size > 1


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
# the PPO-style clipped surrogate losses (they use epsilon's clip and delta)
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# train keys that only one family of loss types reads: the launch form shows them for those loss types only, and a
# value given for another loss type is a warning event (the trainer's option warnings)
LOSS_TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "delta": CLIPPED_LOSSES,
    "sapo_temperature_pos": ("sapo",),
    "sapo_temperature_neg": ("sapo",),
    "vespo_k_pos": ("vespo",),
    "vespo_lambda_pos": ("vespo",),
    "vespo_k_neg": ("vespo",),
    "vespo_lambda_neg": ("vespo",),
}
# Defaults that differ between TRL's two configs: filled in when the key is absent (or null), so a resolved config
# written out (every key present) loads again unchanged.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {"grpo": {"beta": 0.0}, "rloo": {"beta": 0.05}}


class RunConfig(_Strict):
    name: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="A readable name; generated from dataset, algorithm and model when empty.",
    )
    algorithm: Literal["grpo", "rloo"] = Field(
        "grpo",
        description=(
            "grpo: group-relative advantages and a clipped surrogate loss (TRL: GRPOTrainer; DeepSeekMath, arXiv "
            "2402.03300); rloo: a leave-one-out baseline per prompt (TRL: RLOOTrainer; Ahmadian et al. 2024, arXiv "
            "2402.14740)."
        ),
    )
    tags: list[Annotated[str, Field(min_length=1, max_length=100)]] = Field(
        default_factory=list,
        max_length=50,
        description="Tags to filter runs by (the launch form takes them comma-separated).",
    )
    model: ModelSettings = Field(default_factory=ModelSettings, description="The policy model and how it trains.")
    dataset: DatasetSettings = Field(
        default_factory=DatasetSettings,
        description="The training rows, their mapping, their check and the held-out data.",
    )
    rewards: list[RewardSettings] = Field(
        default_factory=lambda: [RewardSettings(name="accuracy")],
        min_length=1,
        description=(
            "The reward functions; a completion's reward is their weighted sum (TRL: reward_funcs, reward_weights)."
        ),
    )
    train: TrainSettings = Field(
        default_factory=TrainSettings,
        description="The optimisation, sampling, loss, evaluation and checkpoint keys (TRL's names).",
    )
    tools: list[ToolSettings] = Field(
        default_factory=list,
        max_length=32,
        description=(
            "Tools the model may call in a rollout, each {name: ...}: image_zoom_in, image_rotate, or an allowlisted "
            "package.module:function. With tools (or an environment) rollouts are multi-turn: the model's "
            "<tool_call>{json}</tool_call> runs the tool and its result (text and images) comes back as a tool turn "
            "(docs/tools.md)."
        ),
    )
    environment: str | None = Field(
        None,
        min_length=1,
        max_length=500,
        description=(
            "An allowlisted class package.module:Class (COLLAGE_TOOL_MODULES), one instance per rollout: reset(row) "
            "starts it, its public methods are tools beside the tools list, and an optional reward() is readable by "
            "the environment_reward reward (TRL: environment_factory)."
        ),
    )
    logging: LoggingSettings = Field(
        default_factory=LoggingSettings, description="What the run records beyond its metrics."
    )
    resources: ResourceSettings = Field(
        default_factory=ResourceSettings, description="Where and on what the run trains."
    )

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
        names = [tool.name for tool in self.tools]
        if (dup := next((n for n in names if names.count(n) > 1), None)) is not None:
            raise ValueError(f"tools: {dup!r} is listed twice")
        if self.name is None:
            self.name = default_name(self)
        return self

    @property
    def uses_tools(self) -> bool:
        """Whether rollouts are multi-turn: the run names tools or an environment."""
        return bool(self.tools) or self.environment is not None

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
        raise ConfigError(errors) from exc


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
        raise ConfigError([(key.strip(), f"value {text!r} is not valid YAML: {exc}")]) from exc
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
        raise ConfigError([("config", f"{file} is not valid YAML: {exc}")]) from exc
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError([("config", f"{file} must hold a mapping of keys")])
    parsed = [parse_override(item) for item in overrides or []]
    try:
        return parse_config(apply_overrides(data, parsed))
    except ConfigError as exc:
        raise ConfigError(name_override_values(exc.errors, parsed)) from exc


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
