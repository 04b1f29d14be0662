"""A memory plan before launch: what one training process of a run holds, from the model's config alone.

The model is built on PyTorch's ``meta`` device from its ``config.json`` (no weights read, no memory taken), with
the run's own freezing and LoRA applied (``training.modeling.prepare_policy``), so the parameter counts are exact.
The rest follows from the run config; every figure is per process, in bytes, and ``docs/scaling.md`` states the
formula:

- parameters ``P · b`` (``b``: bytes per element of ``model.dtype``);
- gradients and AdamW's two moments: ``3 · T · b`` for the ``T`` trainable parameters (Collage trains in the
  model's dtype, without fp32 master weights, and torch's AdamW keeps its moments in the parameters' dtype);
- the reference model (``beta > 0`` without LoRA): ``P · b``; with LoRA the base with adapters disabled serves;
- activations of one micro-batch (``per_device_train_batch_size`` sequences of ``max_prompt_length +
  max_completion_length`` tokens, an upper bound): per token and decoder layer ``(6h + 2·kv + 4i) · b`` (the
  inputs a gated-MLP layer keeps for backward with SDPA attention: norms, q/k/v, attention output, residual, the
  MLP's gate, up, activation and down inputs); with gradient checkpointing ``h · b`` per layer plus one layer's
  full set; plus the log-prob chunk's logits ``256 · V · 4 · 3`` (fp32 logits, log-softmax, gradient);
- the generation cache: ``2 · layers · kv · b`` per token for every rollout of a generation batch on this process
  (``generation_batch_size``, per process) at full length.

A DDP process holds everything; an FSDP2 process holds ``1/N`` of parameters, gradients, moments and reference,
plus the largest layer gathered (twice: the one running and the one prefetched), and the whole policy gathered
while it generates; with CPU offload the shards live in host memory instead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LOGPROB_CHUNK = 256  # tokens per chunk of the log-prob pass (training.batching.logprobs)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model, counted on the meta device."""

    model_type: str
    parameters: int
    trainable: int
    vision_parameters: int
    largest_layer: int  # parameters of the largest decoder layer or vision block
    layers: int
    hidden: int
    intermediate: int
    kv_width: int  # key/value heads x head dim
    vocab: int
    dtype_bytes: int


def model_shape(model_path: str, model_settings: Any, dtype: str | None = None) -> ModelShape:
    """The shape of ``model_path`` (a folder with a ``config.json``, or ``tiny:<family>``) as the run would train
    it (``model_settings``: the run's ``model`` section, its freezing and LoRA applied)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from .modeling import is_vision_param, prepare_policy
    from .models.loading import resolve_model_path

    path = resolve_model_path(model_path)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for n, p in model.named_parameters() if is_vision_param(n))
    largest = max((sum(p.numel() for p in m.parameters()) for m in _blocks(model)), default=0)
    model = prepare_policy(model, model_settings, gradient_checkpointing=False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    chosen = dtype if dtype not in (None, "auto") else str(getattr(text, "dtype", None) or "float32")
    return ModelShape(
        model_type=config.model_type,
        parameters=total,
        trainable=trainable,
        vision_parameters=vision,
        largest_layer=largest,
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
        kv_width=kv * head_dim,
        vocab=text.vocab_size,
        dtype_bytes=DTYPE_BYTES.get(chosen.replace("torch.", ""), 4),
    )


def _blocks(model: Any) -> list[Any]:
    """The repeated blocks FSDP wraps: modules whose class the model names as not to be split."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


@dataclass(frozen=True)
class RunShape:
    """What the plan needs of a run config."""

    processes: int
    micro_batch: int
    sequence: int  # max_prompt_length + max_completion_length
    rollouts_per_process: int  # train.generation_batch_size (completions per generation, per process)
    beta: float
    lora: bool
    gradient_checkpointing: bool


def run_shape(config: Any, processes: int | None = None) -> RunShape:
    t = config.train
    world = processes or config.resources.world_size
    return RunShape(
        processes=world,
        micro_batch=t.per_device_train_batch_size,
        sequence=t.max_prompt_length + t.max_completion_length,
        rollouts_per_process=t.generation_batch_size,
        beta=t.beta,
        lora=config.model.lora is not None,
        gradient_checkpointing=t.gradient_checkpointing,
    )


@dataclass(frozen=True)
class Figures:
    """One strategy's bytes per process, by part; ``peak`` the larger of training and generation."""

    strategy: str
    parameters: int
    gradients: int
    optimizer: int
    reference: int
    gathered: int  # FSDP: full layers (training) gathered at once
    activations: int
    logits: int
    generation_cache: int
    generation_weights: int  # what generating adds: FSDP gathers the whole policy
    host: int  # offloaded to CPU memory
    training_peak: int
    generation_peak: int
    peak: int


def figures(model: ModelShape, run: RunShape, strategy: str) -> Figures:
    """The plan of one strategy: ``ddp``, ``fsdp`` or ``fsdp+offload``."""
    b, n = model.dtype_bytes, run.processes
    share = n if strategy != "ddp" else 1
    params, trainable = model.parameters * b, model.trainable * b
    ref = model.parameters * b if run.beta > 0 and not run.lora else 0
    state = [params // share, trainable // share, 2 * trainable // share, ref // share]
    tokens = run.micro_batch * run.sequence
    per_layer = (6 * model.hidden + 2 * model.kv_width + 4 * model.intermediate) * b
    if run.gradient_checkpointing:
        activations = tokens * (model.layers * model.hidden * b + per_layer)
    else:
        activations = tokens * model.layers * per_layer
    logits = min(tokens, LOGPROB_CHUNK) * model.vocab * 4 * 3
    cache = 2 * model.layers * model.kv_width * b * run.rollouts_per_process * run.sequence
    gathered = 0 if strategy == "ddp" else 2 * model.largest_layer * b
    host = 0
    if strategy == "fsdp+offload":
        host, state = sum(state), [0, 0, 0, 0]
    resident = sum(state)
    generation_weights = 0 if strategy == "ddp" else params - state[0]  # the rest of the policy, gathered
    training_peak = resident + gathered + activations + logits
    generation_peak = resident + generation_weights + cache
    return Figures(
        strategy=strategy,
        parameters=state[0],
        gradients=state[1],
        optimizer=state[2],
        reference=state[3],
        gathered=gathered,
        activations=activations,
        logits=logits,
        generation_cache=cache,
        generation_weights=generation_weights,
        host=host,
        training_peak=training_peak,
        generation_peak=generation_peak,
        peak=max(training_peak, generation_peak),
    )


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    run: RunShape
    gpu_memory: int | None
    strategies: list[Figures]

    def fits(self, figures: Figures) -> bool | None:
        return None if self.gpu_memory is None else figures.peak <= self.gpu_memory

    def to_json(self) -> dict[str, Any]:
        return {
            "model": asdict(self.model),
            "run": asdict(self.run),
            "gpu_memory": self.gpu_memory,
            "strategies": [{**asdict(f), "fits": self.fits(f)} for f in self.strategies],
        }


def make_plan(config: Any, processes: int | None = None, gpu_memory: int | None = None) -> Plan:
    """The plan of a validated run config on ``processes`` processes (default: the config's) with ``gpu_memory``
    bytes per GPU (None: not judged)."""
    model = model_shape(config.model.path, config.model, config.model.dtype)
    run = run_shape(config, processes)
    names = ["ddp"] if run.processes == 1 else ["ddp", "fsdp", "fsdp+offload"]
    return Plan(model, run, gpu_memory, [figures(model, run, s) for s in names])


UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
         "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}  # fmt: skip


def parse_size(text: str) -> int:
    """``80GiB``, ``141GB``, ``24 gib`` -> bytes (a bare number is GiB)."""
    raw = text.strip().lower().replace(" ", "")
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits) :] or "gib"
    if unit not in UNITS:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (use GiB, GB, MiB, ...)")
    try:
        return int(float(digits) * UNITS[unit])
    except ValueError as exc:
        raise ValueError(f"not a size: {text!r} (e.g. 80GiB)") from exc


def gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def plan_text(plan: Plan, source: Path | str) -> str:
    """The plan as a person reads it."""
    m, r = plan.model, plan.run
    lines = [
        f"{source}: {m.model_type}, {m.parameters / 1e9:.3f}B parameters ({m.trainable / 1e9:.3f}B trainable, "
        f"vision {m.vision_parameters / 1e9:.3f}B), {m.dtype_bytes} bytes each",
        f"{r.processes} process(es); micro-batch {r.micro_batch} x {r.sequence} tokens; {r.rollouts_per_process} "
        f"rollouts per process per generation; reference model: {'yes' if r.beta > 0 and not r.lora else 'no'}",
    ]
    parts = ("parameters", "gradients", "optimizer", "reference", "gathered", "activations", "logits",
             "generation_cache", "generation_weights", "host")  # fmt: skip
    for f in plan.strategies:
        fits = plan.fits(f)
        verdict = "" if fits is None else ("  fits" if fits else f"  DOES NOT FIT in {gib(plan.gpu_memory or 0)}")
        lines.append(f"{f.strategy}: peak {gib(f.peak)} per process (training {gib(f.training_peak)}, generation "
                     f"{gib(f.generation_peak)}){verdict}")  # fmt: skip
        lines.append("  " + ", ".join(f"{p} {gib(getattr(f, p))}" for p in parts if getattr(f, p)))
    return "\n".join(lines)
