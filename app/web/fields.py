"""The launch form: every config key with its default, its help text and TRL's meaning.

Defaults come from the config schema itself (``training.config``), so the form cannot drift from what the API
accepts; the help texts live here. One default comes from the machines instead: ``resources.gpus`` is what the
live workers of the default queue have (see :func:`gpus_default`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from collage.training import config
from collage.training.config import RunConfig

HELP: dict[str, tuple[str, str]] = {
    # path: (help, kind) - kind: text | int | float | bool | choice | optional-int | optional-float |
    # optional-text (empty = null) | optional-bool (a select: empty = null, true, false)
    "name": ("A readable name; generated from dataset, algorithm and model when empty.", "text"),
    "tags": ("Comma-separated tags to filter runs by.", "text"),
    "model.dtype": ("Weights' dtype: auto keeps the checkpoint's.", "choice"),
    "model.freeze_vision": ("Keep the vision tower and projector frozen (only the language model trains).", "bool"),
    "dataset.split": ("Split of the dataset to train on.", "text"),
    "dataset.rows": ("synth:<task> only: how many rows to generate.", "int"),
    "dataset.min_images": ("synth:<task> only: fewest images per row; 0 mixes text-only rows in.", "int"),
    "dataset.max_images": ("synth:<task> only: most images per row.", "int"),
    "dataset.seed": ("synth:<task> only: the dataset's seed.", "int"),
    "dataset.config_name": (
        "A Hub dataset's configuration (its card's configs:); empty = the default.",
        "optional-text",
    ),
    "dataset.prompt_template": (
        "Build the prompt from the row's columns: {question} is a column's value, {images} where the images go "
        "(else first). Not with a mapped prompt column. Empty = the prompt column as it is.",
        "optional-text",
    ),
    "dataset.system_prompt": (
        "A system turn for every row (a conversation with its own keeps it). Empty = none.",
        "optional-text",
    ),  # fmt: skip
    "dataset.bad_rows": (
        "Rows the data check refuses: skip (left out, each named in a warning) or fail (the run fails first).",
        "choice",
    ),
    "dataset.check": (
        "The data check before training: full (every row, cached), sample (2,000 rows first, every other row when "
        "a batch draws it), auto (full up to 100,000 rows).",
        "choice",
    ),
    "dataset.eval_split": (
        "Held-out data for evaluation: another split of the source (e.g. test of a DatasetDict); for synth:<task>, "
        "any name gives the same task from another seed. Empty = none (TRL: eval_dataset).",
        "optional-text",
    ),
    "dataset.eval_source": (
        "Held-out data from another dataset (a path or hub id, like source); its split is eval_split, default "
        "train. Empty = none.",
        "optional-text",
    ),
    "dataset.eval_fraction": (
        "Held-out data from the training split: this fraction of its rows (0..1, a deterministic slice by the "
        "dataset seed) is never trained on, only evaluated. Not with eval_split or eval_source. Empty = none.",
        "optional-float",
    ),
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
        "KL coefficient; empty = the algorithm's TRL default (GRPO 0.0, RLOO 0.05). > 0 needs a reference model; "
        "with LoRA the adapters are disabled instead of copying the model (TRL: beta; DeepSeek-R1 used 0.001).",
        "optional-float",
    ),
    "train.use_bias_correction_kl": (
        "GRPO, beta > 0: weight the KL term by the importance ratio, making its gradient the unbiased reverse-KL "
        "gradient (TRL: use_bias_correction_kl; DeepSeek-V3.2, arXiv 2512.02556).",
        "bool",
    ),
    "train.sync_ref_model": (
        "Move the reference model towards the policy every ref_model_sync_steps steps; needs beta > 0, not with "
        "LoRA (TRL: sync_ref_model; TR-DPO, arXiv 2404.09656).",
        "bool",
    ),
    "train.ref_model_mixup_alpha": (
        "With sync_ref_model: ref = alpha x policy + (1 - alpha) x ref at each sync (TRL: ref_model_mixup_alpha; "
        "TR-DPO's alpha).",
        "float",
    ),
    "train.ref_model_sync_steps": (
        "With sync_ref_model: optimizer steps between syncs (TRL: ref_model_sync_steps; TR-DPO's tau).",
        "int",
    ),
    "train.epsilon": ("Lower clip range of the ratio (TRL: epsilon).", "float"),
    "train.epsilon_high": (
        "Upper clip range; empty = epsilon (TRL: epsilon_high; DAPO's clip-higher recommends 0.28). With loss_type "
        "cispo it is the cap of the importance weight itself (ScaleRL, arXiv 2510.13786, recommends 5.0).",
        "optional-float",
    ),
    "train.delta": (
        "Two-sided clipping: also cap the unclipped ratio at delta, bounding updates on negative advantages; empty "
        "= off, TRL recommends > 1 + epsilon (TRL: delta; INTELLECT-2, arXiv 2505.07291). Clipped loss types only.",
        "optional-float",
    ),
    "train.loss_type": (
        "Loss (TRL: loss_type): grpo per-sequence mean (length-biased); bnpo per token of the micro-batch; dr_grpo "
        "by B x max length (Dr. GRPO); dapo by tokens of the generation batch (DAPO); cispo clips the importance "
        "weight, not the update (MiniMax-M1, arXiv 2506.13585); sapo a soft temperature gate instead of clipping "
        "(SAPO, arXiv 2511.20347); luspo sequence sums, a length-unbiased GSPO (LUSPO, arXiv 2602.05261); vespo a "
        "gamma weight of the sequence ratio (VESPO, arXiv 2602.10693).",
        "choice",
    ),
    "train.importance_sampling_level": (
        "Importance ratio per token, or per sequence (the mean log-ratio: GSPO, Zheng et al. 2025, arXiv "
        "2507.18071; use with loss_type grpo or luspo) (TRL: importance_sampling_level).",
        "choice",
    ),
    "train.sapo_temperature_pos": (
        "loss_type sapo: gate temperature for tokens with positive advantage (TRL: sapo_temperature_pos; SAPO).",
        "float",
    ),
    "train.sapo_temperature_neg": (
        "loss_type sapo: gate temperature for tokens with non-positive advantage (TRL: sapo_temperature_neg; SAPO).",
        "float",
    ),
    "train.vespo_k_pos": (
        "loss_type vespo, positive advantages: power k of the gamma weight, how hard ratios < 1 are down-weighted "
        "(TRL: vespo_k_pos; VESPO).",
        "float",
    ),
    "train.vespo_lambda_pos": (
        "loss_type vespo, positive advantages: decay lambda, how hard ratios > 1 are down-weighted "
        "(TRL: vespo_lambda_pos; VESPO).",
        "float",
    ),
    "train.vespo_k_neg": ("loss_type vespo, negative advantages: power k (TRL: vespo_k_neg; VESPO).", "float"),
    "train.vespo_lambda_neg": (
        "loss_type vespo, negative advantages: decay lambda (TRL: vespo_lambda_neg; VESPO).",
        "float",
    ),
    "train.top_entropy_quantile": (
        "Keep in the policy loss only the top rho fraction of tokens by entropy; 1.0 keeps all, 0.0 only the "
        "highest, the paper recommends 0.2 (TRL: top_entropy_quantile; Beyond the 80/20 Rule, arXiv 2506.01939).",
        "float",
    ),
    "train.entropy_coef": (
        "Entropy bonus: subtract coef x the mean per-token entropy from the loss (any loss_type); 0 = off "
        "(TRL: entropy_coef).",
        "float",
    ),
    "train.multi_objective_aggregation": (
        "Several rewards: sum the weighted rewards then normalise (scale_rewards), or normalise each reward in its "
        "group, sum, and standardise over the batch (TRL: multi_objective_aggregation; GDPO, arXiv 2601.05242).",
        "choice",
    ),
    "train.scale_rewards": (
        "Divide advantages by the group std, the batch std (PPO Lite), or not at all (Dr. GRPO) (TRL: scale_rewards).",
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
    "train.save_total_limit": (
        "Keep only the newest N checkpoints, never deleting the newest nor the best by metric_for_best_model; "
        "empty = keep all; needs save_steps > 0 (TRL: save_total_limit).",
        "optional-int",
    ),
    "train.metric_for_best_model": (
        "The metric that ranks checkpoints for best (e.g. eval/reward: with eval_strategy steps and save_steps a "
        "multiple of eval_steps); empty = none (TRL: metric_for_best_model).",
        "optional-text",
    ),
    "train.greater_is_better": (
        "Whether a higher metric_for_best_model is better; auto = yes unless its name ends in loss (TRL: "
        "greater_is_better).",
        "optional-bool",
    ),
    "train.eval_strategy": (
        "Evaluate on the held-out data (a dataset eval_* key) every eval_steps steps, or never (TRL: eval_strategy; "
        "epoch is not offered: runs count steps).",
        "choice",
    ),
    "train.eval_steps": (
        "Optimizer steps between evaluations; empty = about ten per run, every ceil(max_steps / 10) (TRL: eval_steps).",
        "optional-int",
    ),
    "train.eval_on_start": (
        "Also evaluate the initial model, at step 0: the baseline the curve starts from (TRL: eval_on_start).",
        "bool",
    ),
    "train.per_device_eval_batch_size": (
        "Completions per evaluation batch and process, a multiple of eval_num_generations; empty = "
        "per_device_train_batch_size (TRL: per_device_eval_batch_size).",
        "optional-int",
    ),
    "train.eval_num_generations": (
        "Completions per held-out prompt; eval/pass@k is reported for k = 1 and this (TRL: num_generations_eval).",
        "int",
    ),
    "train.eval_temperature": (
        "Sampling temperature of the evaluation; empty = greedy with one completion per prompt, else temperature.",
        "optional-float",
    ),
    "train.eval_max_rows": (
        "Held-out prompts per evaluation (the first N); empty = all of them.",
        "optional-int",
    ),
    "train.eval_pass_reward": (
        "The reward whose value decides eval/pass@k (a completion passes at >= eval_pass_threshold); empty = "
        "accuracy when the run has it.",
        "optional-text",
    ),
    "train.eval_pass_threshold": ("The pass reward's value at which a completion passes (eval/pass@k).", "float"),
    "train.weight_decay": ("AdamW weight decay.", "float"),
    "train.max_grad_norm": ("Gradient clipping norm.", "float"),
    "train.lr_scheduler_type": ("Learning-rate schedule.", "choice"),
    "train.warmup_steps": ("Warm-up steps of the schedule.", "int"),
    "logging.samples_every": ("Write the rollout table every N steps; 0 = never.", "int"),
    "resources.gpus": ("GPUs for the run: 0 = CPU; > 1 = one multi-GPU run through accelerate.", "int"),
    "resources.queue": ("Worker queue to run on.", "text"),
}

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
    """The form's card of a field: loss, eval, or its config section (run for the top-level keys)."""
    if path in LOSS_SECTION:
        return "loss"
    if path in EVAL_SECTION:
        return "eval"
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
            )
        )
    return fields
