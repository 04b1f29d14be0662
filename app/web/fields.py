"""The launch form: every config key with its default, its help text and TRL's meaning.

Defaults and help texts come from the config schema itself (``training.config``: each field's default and
``description``), so the form cannot drift from what the API accepts or from the docs. One default comes from
the machines instead: ``resources.gpus`` is what the live workers of the default queue have (see
:func:`gpus_default`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from collage.training import config
from collage.training.config import RunConfig
from collage.training.config_docs import key_doc

# The form's fields, in the order it shows them, with the input each gets. What a field means is its
# Field(description=...) in training/config.py (training.config_docs), the one source the form, the docs and
# `collage config explain` share. kind: text | int | float | bool | choice | optional-int | optional-float |
# optional-text (empty = null) | optional-bool (a select: empty = null, true, false)
FORM: dict[str, str] = {
    "name": "text",
    "tags": "text",
    "model.dtype": "choice",
    "model.freeze_vision": "bool",
    "dataset.split": "text",
    "dataset.rows": "int",
    "dataset.min_images": "int",
    "dataset.max_images": "int",
    "dataset.seed": "int",
    "dataset.config_name": "optional-text",
    "dataset.prompt_template": "optional-text",
    "dataset.system_prompt": "optional-text",
    "dataset.bad_rows": "choice",
    "dataset.check": "choice",
    "dataset.eval_split": "optional-text",
    "dataset.eval_source": "optional-text",
    "dataset.eval_fraction": "optional-float",
    "train.max_steps": "int",
    "train.learning_rate": "float",
    "train.per_device_train_batch_size": "int",
    "train.gradient_accumulation_steps": "int",
    "train.num_generations": "int",
    "train.max_prompt_length": "optional-int",
    "train.max_completion_length": "int",
    "train.temperature": "float",
    "train.beta": "optional-float",
    "train.use_bias_correction_kl": "bool",
    "train.sync_ref_model": "bool",
    "train.ref_model_mixup_alpha": "float",
    "train.ref_model_sync_steps": "int",
    "train.epsilon": "float",
    "train.epsilon_high": "optional-float",
    "train.delta": "optional-float",
    "train.loss_type": "choice",
    "train.importance_sampling_level": "choice",
    "train.sapo_temperature_pos": "float",
    "train.sapo_temperature_neg": "float",
    "train.vespo_k_pos": "float",
    "train.vespo_lambda_pos": "float",
    "train.vespo_k_neg": "float",
    "train.vespo_lambda_neg": "float",
    "train.top_entropy_quantile": "float",
    "train.entropy_coef": "float",
    "train.multi_objective_aggregation": "choice",
    "train.scale_rewards": "choice",
    "train.normalize_advantages": "bool",
    "train.num_iterations": "int",
    "train.steps_per_generation": "optional-int",
    "train.mask_truncated_completions": "bool",
    "train.max_tool_calling_iterations": "int",
    "train.eval_max_tool_calling_iterations": "optional-int",
    "train.max_images_per_rollout": "int",
    "train.mask_capped_trajectories": "bool",
    "environment": "optional-text",
    "train.gradient_checkpointing": "bool",
    "train.seed": "int",
    "train.save_steps": "int",
    "train.save_total_limit": "optional-int",
    "train.metric_for_best_model": "optional-text",
    "train.greater_is_better": "optional-bool",
    "train.eval_strategy": "choice",
    "train.eval_steps": "optional-int",
    "train.eval_on_start": "bool",
    "train.per_device_eval_batch_size": "optional-int",
    "train.eval_num_generations": "int",
    "train.eval_temperature": "optional-float",
    "train.eval_max_rows": "optional-int",
    "train.eval_pass_reward": "optional-text",
    "train.eval_pass_threshold": "float",
    "train.weight_decay": "float",
    "train.max_grad_norm": "float",
    "train.lr_scheduler_type": "choice",
    "train.warmup_steps": "int",
    "logging.samples_every": "int",
    "resources.gpus": "int",
    "resources.queue": "text",
}
HELP: dict[str, tuple[str, str]] = {path: (key_doc(path).description, kind) for path, kind in FORM.items()}

GRPO_ONLY = {f"train.{key}" for key in config.GRPO_ONLY}
RLOO_ONLY = {f"train.{key}" for key in config.RLOO_ONLY}
# the policy-loss, advantage and reference-model options get their own card on the form ("loss" section)
LOSS_SECTION = {
    f"train.{key}"
    for key in (
        "beta",
        "use_bias_correction_kl",
        "sync_ref_model",
        "ref_model_mixup_alpha",
        "ref_model_sync_steps",
        "epsilon",
        "epsilon_high",
        "delta",
        *config.GRPO_ONLY,
        *config.RLOO_ONLY,
    )
}
# evaluation and checkpoint retention get their own card ("eval" section); the held-out data stays with the dataset
EVAL_SECTION = {
    f"train.{key}"
    for key in (
        "save_total_limit",
        "metric_for_best_model",
        "greater_is_better",
        "eval_strategy",
        "eval_steps",
        "eval_on_start",
        "per_device_eval_batch_size",
        "eval_num_generations",
        "eval_temperature",
        "eval_max_rows",
        "eval_pass_reward",
        "eval_pass_threshold",
    )
}
# the multi-turn rollouts' keys get their own group ("tools" section), beside the tools themselves (:func:`tool_form`)
TOOLS_SECTION = {
    "environment",
    *(
        f"train.{key}"
        for key in (
            "max_tool_calling_iterations",
            "eval_max_tool_calling_iterations",
            "max_images_per_rollout",
            "mask_capped_trajectories",
        )
    ),
}
# keys whose default depends on the algorithm: the form leaves them empty (= that algorithm's default)
ALGORITHM_DEFAULTED = {f"train.{key}" for defaults in config.ALGORITHM_DEFAULTS.values() for key in defaults}


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
    loss_types: tuple[str, ...] = ()  # shown (and sent) only with one of these train.loss_type values; () = any


def _lookup(model: Any, path: str) -> Any:
    value = model
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _choices(path: str) -> list[str]:
    from typing import get_args

    section, _, key = path.rpartition(".")
    model: Any = RunConfig  # a section's pydantic model (``X | None`` unwrapped)
    for part in section.split(".") if section else []:
        annotation = model.model_fields[part].annotation
        model = next((a for a in get_args(annotation) if hasattr(a, "model_fields")), annotation)
    annotation = model.model_fields[key].annotation
    return [str(a) for a in get_args(annotation)]


def gpus_default(workers: list[dict[str, Any]], queue: str | None = None) -> int | None:
    """The launch form's ``resources.gpus``: the fewest GPUs any live worker of ``queue`` (the config's default
    queue) has in its slot, so that the run fits whichever of them takes it; 0 when one of them has none (it
    trains on the CPU). Workers of other queues count only when none serves ``queue``. ``None`` (the schema's
    default) without any live worker."""
    queue = queue or RunConfig(name="x").resources.queue
    serving = [w for w in workers if queue in (w.get("queues") or [])] or workers
    if not serving:
        return None
    return min(len(w.get("gpu_slots") or []) for w in serving)


def _section(path: str) -> str:
    """The form's card of a field: loss, eval, tools, or its config section (run for the other top-level keys)."""
    if path in LOSS_SECTION:
        return "loss"
    if path in EVAL_SECTION:
        return "eval"
    if path in TOOLS_SECTION:
        return "tools"
    return path.partition(".")[0] if "." in path else "run"


def form_fields(gpus: int | None = None) -> list[FormField]:
    """Every field of the form; ``gpus`` (from :func:`gpus_default`) replaces ``resources.gpus``'s default."""
    defaults = RunConfig(name="x")
    fields = []
    for path, (help_text, kind) in HELP.items():
        default = "" if path == "name" else None if path in ALGORITHM_DEFAULTED else _lookup(defaults, path)
        if path == "tags":
            default = ""
        if path == "resources.gpus" and gpus is not None:
            default = gpus
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
                section=_section(path),
                loss_types=key_doc(path).loss_types or (),
            )
        )
    return fields


@dataclass
class ToolChoice:
    name: str
    doc: str  # the first line of its docstring


@dataclass
class ToolForm:
    """The launch form's tools (the ``tools`` list): a checkbox per built-in, a text field for import paths, the
    built-in zoom's ``coords``; the help texts are the config fields' descriptions, as for every other field."""

    builtins: list[ToolChoice]
    help: str  # tools
    name_help: str  # tools[].name
    coords_help: str  # tools[].coords
    coords_choices: list[str]
    coords_default: str
    modules: list[str]  # the operator's COLLAGE_TOOL_MODULES


def tool_form(tool_modules: tuple[str, ...] = ()) -> ToolForm:
    from typing import get_args

    from collage.training.tools.image_tools import BUILTIN_TOOLS  # PIL only: the web tier may import it

    coords = config.ToolSettings.model_fields["coords"]
    return ToolForm(
        builtins=[ToolChoice(n, (fn.__doc__ or "").strip().partition("\n")[0]) for n, fn in BUILTIN_TOOLS.items()],
        help=key_doc("tools").description,
        name_help=key_doc("tools[].name").description,
        coords_help=key_doc("tools[].coords").description,
        coords_choices=[str(a) for a in get_args(coords.annotation)],
        coords_default=str(coords.default),
        modules=list(tool_modules),
    )
