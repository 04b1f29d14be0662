"""The launch form: every config key with its default, its help text and TRL's meaning.

Defaults come from the config schema itself (``training.config``), so the form cannot drift from what the API
accepts; the help texts live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from collage.training.config import RunConfig

HELP: dict[str, tuple[str, str]] = {
    # path: (help, kind) - kind: text | int | float | bool | choice | optional-int | optional-float
    "name": ("A readable name; generated from dataset, algorithm and model when empty.", "text"),
    "tags": ("Comma-separated tags to filter runs by.", "text"),
    "model.dtype": ("Weights' dtype: auto keeps the checkpoint's.", "choice"),
    "model.freeze_vision": ("Keep the vision tower and projector frozen (only the language model trains).", "bool"),
    "dataset.split": ("Split of the dataset to train on.", "text"),
    "dataset.rows": ("synth:<task> only: how many rows to generate.", "int"),
    "dataset.min_images": ("synth:<task> only: fewest images per row; 0 mixes text-only rows in.", "int"),
    "dataset.max_images": ("synth:<task> only: most images per row.", "int"),
    "dataset.seed": ("synth:<task> only: the dataset's seed.", "int"),
    "train.max_steps": ("Optimizer steps to run (TRL: max_steps).", "int"),
    "train.learning_rate": ("AdamW learning rate (TRL: learning_rate).", "float"),
    "train.per_device_train_batch_size": (
        "Completions per micro-batch per device (TRL: per_device_train_batch_size).",
        "int",
    ),
    "train.gradient_accumulation_steps": (
        "Micro-batches per optimizer step (TRL: gradient_accumulation_steps).",
        "int",
    ),
    "train.num_generations": ("Completions sampled per prompt: one group (TRL: num_generations).", "int"),
    "train.max_prompt_length": (
        "Prompt token limit; text is cut oldest-first, image tokens never (TRL: max_prompt_length).",
        "optional-int",
    ),
    "train.max_completion_length": ("Most tokens per completion (TRL: max_completion_length).", "int"),
    "train.temperature": ("Sampling temperature for completions and log-probs (TRL: temperature).", "float"),
    "train.beta": (
        "KL coefficient; > 0 needs a reference model, with LoRA the adapters are disabled (TRL: beta).",
        "float",
    ),
    "train.use_bias_correction_kl": (
        "GRPO, beta > 0: weight the KL term by the ratio (TRL: use_bias_correction_kl).",
        "bool",
    ),
    "train.epsilon": ("Lower clip range of the ratio (TRL: epsilon).", "float"),
    "train.epsilon_high": (
        "Upper clip range; empty = epsilon (TRL: epsilon_high, DAPO's clip-higher).",
        "optional-float",
    ),
    "train.loss_type": (
        "Loss normalisation (TRL: loss_type): grpo per sequence, bnpo per token of the batch, dr_grpo by B x max length, dapo by tokens of the generation batch.",
        "choice",
    ),
    "train.scale_rewards": (
        "Divide advantages by the group std, the batch std, or not at all (TRL: scale_rewards).",
        "choice",
    ),
    "train.normalize_advantages": ("Standardise RLOO advantages over the batch (TRL: normalize_advantages).", "bool"),
    "train.num_iterations": ("Updates per generation batch (TRL: num_iterations, GRPO's mu).", "int"),
    "train.steps_per_generation": (
        "Micro-batches per generation; empty = gradient_accumulation_steps (TRL: steps_per_generation).",
        "optional-int",
    ),
    "train.mask_truncated_completions": (
        "Leave completions that hit the length limit out of the loss (TRL: mask_truncated_completions).",
        "bool",
    ),
    "train.gradient_checkpointing": ("Trade compute for memory (TRL: gradient_checkpointing).", "bool"),
    "train.seed": ("Seed of sampling and data order.", "int"),
    "train.save_steps": ("Checkpoint every N steps; 0 = only at the end (and on cancel).", "int"),
    "train.weight_decay": ("AdamW weight decay.", "float"),
    "train.max_grad_norm": ("Gradient clipping norm.", "float"),
    "train.lr_scheduler_type": ("Learning-rate schedule.", "choice"),
    "train.warmup_steps": ("Warm-up steps of the schedule.", "int"),
    "logging.samples_every": ("Write the rollout table every N steps; 0 = never.", "int"),
    "resources.gpus": ("GPUs for the run: 0 = CPU; > 1 = one multi-GPU run through accelerate.", "int"),
    "resources.queue": ("Worker queue to run on.", "text"),
}

GRPO_ONLY = {"train.loss_type", "train.scale_rewards", "train.use_bias_correction_kl"}
RLOO_ONLY = {"train.normalize_advantages"}


@dataclass
class FormField:
    path: str
    label: str
    kind: str
    default: Any
    help: str
    choices: list[str]
    algorithm: str | None  # grpo | rloo | None (both)
    section: str


def _lookup(model: Any, path: str) -> Any:
    value = model
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _choices(path: str) -> list[str]:
    from typing import get_args

    section, _, key = path.rpartition(".")
    model = RunConfig
    for part in section.split(".") if section else []:
        model = model.model_fields[part].annotation
        model = next((a for a in get_args(model) if hasattr(a, "model_fields")), model)
    annotation = model.model_fields[key].annotation
    return [str(a) for a in get_args(annotation)]


def form_fields() -> list[FormField]:
    defaults = RunConfig(name="x")
    fields = []
    for path, (help_text, kind) in HELP.items():
        default = "" if path == "name" else _lookup(defaults, path)
        if path == "tags":
            default = ""
        algorithm = "grpo" if path in GRPO_ONLY else "rloo" if path in RLOO_ONLY else None
        fields.append(
            FormField(
                path=path,
                label=path.rpartition(".")[2],
                kind=kind,
                default=default,
                help=help_text,
                choices=_choices(path) if kind == "choice" else [],
                algorithm=algorithm,
                section=path.partition(".")[0] if "." in path else "run",
            )
        )
    return fields
