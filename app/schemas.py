"""Response and request models of the REST API (they make the OpenAPI schema precise)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from collage.training.config import (
    IMAGES_MAX,
    JSON_MAX_DEPTH,
    SEED_MAX,
    TEMPLATE_MAX,
    TOKENS_MAX,
    ColumnMap,
    RunConfig,
    json_problem,
    no_nul,
)


class FieldError(BaseModel):
    path: str = Field(description="dotted key path of the bad field, e.g. train.loss_type")
    message: str


class ValidationErrorOut(BaseModel):
    detail: list[FieldError]


class ErrorOut(BaseModel):
    detail: str


class RunCreated(BaseModel):
    id: str
    status: Literal["queued"]
    url: str


class Progress(BaseModel):
    step: int
    max_steps: int


class RunOut(BaseModel):
    id: str
    name: str
    algorithm: str
    status: str
    tags: list[str]
    model: str
    dataset: str
    progress: Progress
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime
    heartbeat_at: datetime | None
    error: str | None = Field(description="why the run failed, in one line (a traceback's last line)")
    error_detail: str | None = Field(
        None,
        description="admin tokens only, GET /runs/{id} only: the traceback behind `error` (it names server paths "
        "and code, so members never see it); null otherwise",
    )
    warning_count: int
    attempt: int
    worker: str | None
    parent_id: str | None
    created_by: str | None = Field(None, description="the name of the API token that created the run")
    latest_reward: float | None = None
    seconds_per_step: float | None = Field(
        None,
        description="the mean time of the current attempt's recent steps (evaluations included), as its training "
        "process measured them; null until the attempt finished a step. Time left: (max_steps - step) x this",
    )
    eval_reward: float | None = Field(
        None, description="the latest `eval/reward` (held-out evaluation); null when the run has none yet"
    )
    best_eval_reward: float | None = Field(
        None,
        description="the best `eval/reward` so far: the highest, or the lowest when the run ranks checkpoints by "
        "eval/reward (train.metric_for_best_model) with train.greater_is_better false; null when it has none",
    )
    eval_metric: str | None = Field(
        None,
        description="the evaluation metric the run picks its best checkpoint by (train.metric_for_best_model, e.g. "
        "eval/accuracy); null when it ranks by none",
    )
    eval_metric_value: float | None = Field(None, description="the latest value of `eval_metric`; null before one")
    best_eval_metric: float | None = Field(
        None,
        description="the best value of `eval_metric` so far (by train.greater_is_better: the checkpoint `best` "
        "names); null before one",
    )
    url: str
    config: dict[str, Any] | None = None
    notes: str | None = Field(None, description="free text, editable after launch (PATCH /runs/{id})")
    queue_position: int | None = Field(
        None, description="queued runs only: 1-based place among the queued runs of the same resources.queue"
    )
    queue_estimate_s: float | None = Field(
        None,
        description="queued runs only: estimated seconds until a worker takes the run, from the live workers of "
        "its queue and recent runs' durations; null when there is no basis (no live worker, no finished run)",
    )
    queue_workers: int | None = Field(
        None,
        description="queued runs only: how many live workers take runs from its resources.queue now (0: the run "
        "waits until one starts: collage worker --queues <queue>); null when unknown",
    )


class RunPage(BaseModel):
    items: list[RunOut]
    next_cursor: str | None


class _Request(BaseModel):
    """A request body: unknown keys refused, and no NUL byte in any string (PostgreSQL and process arguments
    refuse them)."""

    model_config = ConfigDict(extra="forbid")

    _no_nul = field_validator("*")(no_nul)


class CloneRequest(_Request):
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="config keys to change, nested like the config or dotted ({'train.max_steps': 10})",
    )

    @field_validator("overrides")
    @classmethod
    def _bounded(cls, value: dict[str, Any]) -> dict[str, Any]:
        # overrides nest like the config, whose deepest free-form field (rewards[i].args) starts 3 levels down;
        # the size is bounded by the request body's limit and, once applied, by the config's own checks
        if (problem := json_problem(value, max_depth=JSON_MAX_DEPTH + 3, max_bytes=None)) is not None:
            raise ValueError(problem)
        return value


class ImageRef(BaseModel):
    sha256: str
    url: str
    thumb_url: str
    width: int
    height: int


class ImageSource(BaseModel):
    image: int = Field(
        description="the image it was cropped from: the row's own images first (0..n-1), then each "
        "tool image of the trajectory in order of appearance"
    )
    bbox_2d: list[float] = Field(description="[x1, y1, x2, y2] in that source image's pixel coordinates")


class TrajectoryImageRef(ImageRef):
    source: ImageSource | None = Field(None, description="where a tool's image came from (a crop's box), if known")


class ToolCall(BaseModel):
    name: str
    arguments: Any = Field(description="the call's arguments, as the model wrote them (parsed JSON)")


class TrajectoryTurn(BaseModel):
    role: str = Field(description="`assistant` (the model's turn) or `tool` (a tool's answer)")
    text: str
    tool_call: ToolCall | None = None
    images: list[TrajectoryImageRef] = Field(default_factory=list)
    error: str | None = Field(None, description="the tool's error, when the call failed")


class SampleOut(BaseModel):
    id: int
    run_id: str
    step: int
    group: int
    index: int
    prompt: Any
    completion: str
    images: list[ImageRef]
    rewards: dict[str, float | None]
    reward: float | None
    advantage: float
    completion_length: int
    truncated: bool
    num_images: int
    group_mean: float | None
    group_std: float | None
    zero_std: bool
    dataset_row: int | None
    split: str = Field(
        "train",
        description="`train` or `eval`. train: a rollout the policy was trained on; eval: a held-out evaluation rollout (`step` is the "
        "step evaluated, `group` the held-out prompt's index in that evaluation, `advantage` 0)",
    )
    columns: dict[str, str | int | float | bool | None] = Field(
        default_factory=dict,
        description="the dataset row's scalar columns besides the prompt and images (answer, ...); text cut at "
        "1,000 characters",
    )
    trajectory: list[TrajectoryTurn] = Field(
        default_factory=list,
        description="a multi-turn rollout's turns (a run with tools), empty otherwise; `completion` is the final "
        "assistant text",
    )
    tool_calls: int = Field(0, description="the trajectory's assistant turns that call a tool")
    tool_errors: int = Field(0, description="the trajectory's turns that report a tool error")
    turns: int = Field(0, description="the trajectory's turns")


class SamplePage(BaseModel):
    items: list[SampleOut]
    next_cursor: str | None


class EventOut(BaseModel):
    id: int
    time: datetime
    level: str = Field(description="debug, info, warning, error; admins also get traceback (a failure's traceback)")
    message: str


class EventPage(BaseModel):
    items: list[EventOut]
    last_id: int | None


NOTES_MAX = 10_000


def _tag_without_nul(value: str) -> str:
    no_nul(value)
    return value


class RunEdit(_Request):
    """``PATCH /runs/{id}``: the tags and notes of a run, editable at any time. Absent keys stay as they are."""

    tags: list[Annotated[str, Field(min_length=1, max_length=100), AfterValidator(_tag_without_nul)]] | None = Field(
        None, max_length=50, description="replaces the run's tags (the config's limits: 1-100 chars, 50 tags)"
    )
    notes: str | None = Field(None, max_length=NOTES_MAX, description="free text up to 10,000 characters")


class DatasetCheckRequest(_Request):
    source: str = Field(min_length=1, max_length=1000)
    split: str = Field("train", max_length=100)
    model: str | None = Field(None, max_length=1000)
    max_prompt_length: int | None = Field(None, gt=0, le=TOKENS_MAX)
    rows: int = Field(256, gt=0, le=100_000, description="synth:<task> only")
    min_images: int = Field(0, ge=0, le=IMAGES_MAX, description="synth:<task> only")
    max_images: int = Field(3, ge=0, le=IMAGES_MAX, description="synth:<task> only")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="synth:<task> only")
    columns: ColumnMap | None = Field(None, description="dataset.columns: the source columns of prompt, images, ...")
    prompt_template: str | None = Field(None, max_length=TEMPLATE_MAX, description="dataset.prompt_template")
    system_prompt: str | None = Field(None, max_length=TEMPLATE_MAX, description="dataset.system_prompt")
    config_name: str | None = Field(None, max_length=200, description="dataset.config_name")
    check: Literal["auto", "full", "sample"] = Field(
        "auto", description="dataset.check: auto checks a split of more than 100,000 rows by a seeded sample"
    )


class RowProblem(BaseModel):
    row: int
    message: str


class Stats(BaseModel):
    min: float
    mean: float
    max: float


class DatasetCheckOut(BaseModel):
    source: str
    ok: bool
    rows: int = Field(description="rows checked (a sample's rows when sample_of is set)")
    sample_of: int | None = Field(None, description="a sample check: the rows of the split it was drawn from")
    errors: list[RowProblem]
    images_per_row: Stats | None
    image_tokens_per_row: Stats | None
    prompt_tokens_per_row: Stats | None
    truncated_rows: int
    model: str | None
    max_prompt_length: int | None
    conversions: dict[str, int] = Field(
        default_factory=dict, description="images the processor takes converted (RGBA, P, L, CMYK, EXIF), by kind"
    )
    large_images: list[dict[str, Any]] = Field(
        default_factory=list, description="images over 16 MP: {row, image, width, height, image_tokens}"
    )
    summary: str


class PreviewRow(BaseModel):
    row: int
    prompt: Any = Field(
        description="the conversation (as the row's images are placed); a row with an error shows its prompt as "
        "stored. Bounded like `columns`"
    )
    images: list[ImageRef]
    columns: dict[str, Any] = Field(
        description="the row's other columns, bounded: 8 levels deep, 50 items per list or object, 2,000 characters "
        "per string, 32,000 per row; a cut part becomes a text marker that starts with its JSON text"
    )
    error: str | None = None


class DatasetPreviewOut(BaseModel):
    source: str
    rows: list[PreviewRow]
    total_rows: int | None = Field(None, description="rows in the split (the preview shows the first ones)")
    note: str | None = Field(
        None, description="why fewer rows are shown than asked for (the preview's image and byte bounds), or null"
    )
    column_names: list[str] = Field(default_factory=list, description="the columns of the rows shown, in order")
    guess: dict[str, Any] = Field(
        default_factory=dict,
        description="dataset.columns guessed from the column names (question, image_1 ..., solution); {}: none needed",
    )


class RewardInfo(BaseModel):
    name: str
    kind: Literal["builtin"]
    doc: str


class ToolInfo(BaseModel):
    name: str
    kind: Literal["builtin"]
    doc: str  # the first line of its docstring (the whole docstring is what the model is shown)


class ToolsInfo(BaseModel):
    """The tools a run may name (``tools[].name``) and the environments (``environment``)."""

    builtins: list[ToolInfo]
    modules: list[str]  # COLLAGE_TOOL_MODULES: the modules whose functions and classes runs may name
    user_functions: str
    environments: str


class RewardsOut(BaseModel):
    builtins: list[RewardInfo]
    user_functions: str
    text_reward_models: str
    tools: ToolsInfo


class FamilyInfo(BaseModel):
    name: str
    layout: str
    tiny: bool
    model_types: list[str]


class ModelsOut(BaseModel):
    families: list[FamilyInfo]
    tiny: list[str]
    local: list[str]


class GpuInfo(BaseModel):
    index: int
    name: str
    memory_total_mb: int | None = None
    memory_used_mb: int | None = None
    utilization: int | None = Field(None, description="percent, as nvidia-smi reports it")


class WorkerRun(BaseModel):
    id: str
    name: str | None
    status: str | None
    url: str


class WorkerOut(BaseModel):
    name: str
    hostname: str
    pid: int
    queues: list[str]
    gpu_slots: list[int] = Field(description="the GPU indices of this worker's slot; empty = trains on the CPU")
    gpus: list[GpuInfo] | None = Field(
        None, description="model, memory and utilisation of the slot's GPUs; null when none or unknown"
    )
    current_run: WorkerRun | None
    started_at: datetime
    last_seen: datetime
    heartbeat_age_s: float = Field(description="seconds since the worker's last heartbeat, as the server saw it")


class WorkersOut(BaseModel):
    items: list[WorkerOut]
    live_within_s: float = Field(description="workers seen within this many seconds are listed")


class HealthOut(BaseModel):
    ok: bool
    store: dict[str, Any]
    broker: dict[str, Any]
    workers: list[dict[str, Any]]


# --- checkpoints and exports (issue 18) ---------------------------------------------------------------------------


class CheckpointOut(BaseModel):
    step: int
    attempt: int | None = Field(description="the attempt that wrote it (null: recorded before migration 0007)")
    bytes: int | None = Field(description="size of its model folder (what a download or an export moves)")
    created_at: datetime | None
    kind: Literal["adapter", "full"] | None = Field(description="adapter: a LoRA adapter; full: the whole model")
    metric: float | None = Field(description="train.metric_for_best_model's value at this step (null: none)")
    best: bool = Field(description="the best checkpoint by metric_for_best_model and greater_is_better")
    download_url: str


class CheckpointList(BaseModel):
    items: list[CheckpointOut]
    metric_for_best_model: str | None = Field(description="the run's train.metric_for_best_model")
    greater_is_better: bool = Field(description="whether a larger metric is better (TRL's default rule)")


class ExportRequest(_Request):
    """``POST /runs/{id}/exports``: which checkpoint, and whether to merge a LoRA adapter into the base weights."""

    step: Annotated[int, Field(strict=True, ge=0, le=2**31 - 1)] | Literal["best", "last"] = Field(
        "last", description="a step number, best or last"
    )
    merge_lora: bool = Field(False, description="merge a LoRA adapter into the base model (peft merge_and_unload)")


class ExportCreated(BaseModel):
    id: str
    url: str


class ExportOut(BaseModel):
    id: str
    run_id: str | None
    status: str = Field(description="queued, running, cancelling, succeeded, failed or cancelled")
    progress: float = Field(description="0..1")
    message: str | None
    error: str | None
    queue_position: int | None = Field(description="1-based place among its queue's waiting jobs (null: not queued)")
    step: int | None
    merge_lora: bool
    kind: str | None = Field(description="the exported checkpoint's kind (adapter, full), once it has succeeded")
    bytes: int | None = Field(description="the exported folder's size, once it has succeeded")
    created_at: datetime
    finished_at: datetime | None
    download_url: str | None = Field(description="the exported folder as a tar, once it has succeeded")
    removed: str | None = Field(description="why the exported folder is gone (null: it is there, or not yet made)")


# ------------------------------------------------------------------------------------------- the playground
PROMPT_TEXT_MAX = 20_000  # characters of prompt text (a string, or all text parts of a conversation)
GENERATIONS_MAX = 16  # completions per model of one generation
PLAYGROUND_TOOLS_MAX = 8  # tools one generation may name
PLAYGROUND_TOOL_CALLS_MAX = 16  # the largest max_tool_calling_iterations of a generation
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="an image's SHA-256, from POST /images")]
ColumnValue = Annotated[str, Field(max_length=2000)] | int | float | bool | None


class PlaygroundModelRef(_Request):
    """A model to generate with: a run's checkpoint (``run`` and ``step``: a number, ``best`` or ``last``, default
    ``last``) or a base model (``path``: ``tiny:<family>`` or a model folder under COLLAGE_MODEL_ROOTS)."""

    run: str | None = Field(None, min_length=1, max_length=32)
    step: Annotated[int, Field(ge=0, le=2**31 - 1)] | Literal["best", "last"] | None = None
    path: str | None = Field(None, min_length=1, max_length=500)

    @model_validator(mode="after")
    def _one_model(self) -> PlaygroundModelRef:
        if (self.run is None) == (self.path is None):
            raise ValueError("give run (and step) or path, one of them")
        if self.path is not None and self.step is not None:
            raise ValueError("step goes with run, not with path")
        return self


class ChatPart(_Request):
    type: Literal["text", "image", "image_url"]
    text: str | None = Field(None, max_length=PROMPT_TEXT_MAX)


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=PROMPT_TEXT_MAX)] | Annotated[list[ChatPart], Field(max_length=256)]

    def text_length(self) -> int:
        if isinstance(self.content, str):
            return len(self.content)
        return sum(len(p.text or "") for p in self.content)


class GenerateRequest(_Request):
    """``POST /generate``: one prompt with its images, answered by one or two models side by side."""

    models: list[PlaygroundModelRef] = Field(min_length=1, max_length=2, description="one or two models")
    prompt: (
        Annotated[str, Field(max_length=PROMPT_TEXT_MAX)]
        | Annotated[list[ChatMessage], Field(min_length=1, max_length=32)]
    ) = Field(
        description="text (the images go before it, unless it places them with [image 1], [image 2], ...) or a "
        "conversation with one {type: image} part per image (a rollout row's prompt)"
    )
    images: list[Sha256] = Field(default_factory=list, max_length=IMAGES_MAX, description="uploaded or stored images")
    answer: Annotated[str, Field(max_length=2000)] | int | float | None = Field(
        None, description="the expected answer: with it, every reward of the run is computed on each completion"
    )
    columns: dict[Annotated[str, Field(min_length=1, max_length=100)], ColumnValue] | None = Field(
        None, max_length=32, description="other dataset columns for the rewards (a rollout row's `columns`)"
    )
    num_generations: int = Field(2, ge=1, le=GENERATIONS_MAX, description="completions per model")
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="0: greedy decoding (the most likely token)")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(64, ge=1, le=TOKENS_MAX, description="at most COLLAGE_PLAYGROUND_MAX_NEW_TOKENS")
    seed: int | None = Field(
        None, ge=0, le=SEED_MAX, description="the same seed, model and input: the same completions"
    )
    tools: list[Annotated[str, Field(min_length=1, max_length=500)]] | None = Field(
        None,
        max_length=PLAYGROUND_TOOLS_MAX,
        description="tools the model may call, turn by turn (image_zoom_in, image_rotate, or a module:function of "
        "COLLAGE_TOOL_MODULES); null: the first run model's own tools (none for a base model); []: none",
    )
    max_tool_calling_iterations: int | None = Field(
        None,
        ge=1,
        le=PLAYGROUND_TOOL_CALLS_MAX,
        description="with tools: the most tool calls of one completion (the model's turn after the last one allowed "
        "ends it); null: the first run model's train.max_tool_calling_iterations (a base model: 4)",
    )

    @field_validator("prompt")
    @classmethod
    def _bounded_prompt(cls, value: str | list[ChatMessage]) -> str | list[ChatMessage]:
        if isinstance(value, list) and sum(m.text_length() for m in value) > PROMPT_TEXT_MAX:
            raise ValueError(f"holds more than {PROMPT_TEXT_MAX} characters of text")
        return value

    @field_validator("columns")
    @classmethod
    def _plain_columns(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and (problem := json_problem(value, max_bytes=None)) is not None:
            raise ValueError(problem)
        return value

    def conversation(self) -> str | list[dict[str, Any]]:
        """The prompt as plain JSON (a string, or the conversation's messages as dicts)."""
        if isinstance(self.prompt, str):
            return self.prompt
        return [m.model_dump(exclude_none=True) for m in self.prompt]


class GenerateCreated(BaseModel):
    id: str
    status: Literal["queued"]
    url: str


class PlaygroundModelOut(BaseModel):
    label: str
    kind: str = Field(description="base (a path), full or adapter (a run's checkpoint)")
    path: str | None = Field(description="tiny:<family> or the base model's folder; null for a run's checkpoint")
    run: str | None
    run_name: str | None
    step: int | None


class PlaygroundToolCall(BaseModel):
    name: str
    arguments: dict[str, Any]


class PlaygroundToolImage(BaseModel):
    png: str | None = Field(
        description="the image as base64 PNG (shrunk to at most 512 pixels a side for showing); null when the "
        "result's image bytes ran past their bound"
    )
    width: int = Field(description="the image's own width (the pixels a later call's bbox_2d on it counts in)")
    height: int
    source: dict[str, Any] | None = Field(
        description="{image: k, bbox_2d: [x1, y1, x2, y2]}: the region of the completion's image k (the prompt's "
        "images, then every earlier tool image, from 0) it was made from, in that image's pixels"
    )


class PlaygroundTurn(BaseModel):
    role: Literal["assistant", "tool"]
    text: str = Field(description="what the model wrote, or the tool's result text (its error when it failed)")
    tool_call: PlaygroundToolCall | None = Field(description="the call an assistant turn made, or a tool turn answers")
    images: list[PlaygroundToolImage] = Field(default_factory=list, description="a tool turn's images")
    error: str | None = None


class PlaygroundTrajectory(BaseModel):
    turns: list[PlaygroundTurn]
    tool_calls: int
    tool_errors: int
    capped: bool = Field(description="it still called a tool when max_tool_calling_iterations ran out")


class PlaygroundCompletion(BaseModel):
    text: str = Field(description="the completion (with tools: the model's last turn, its answer)")
    tokens: int = Field(description="the tokens the model generated (with tools: in all its turns)")
    truncated: bool = Field(
        description="no end of turn within max_new_tokens (with tools: the rollout's tokens, every assistant and "
        "tool token, ran past max_new_tokens)"
    )
    logprob: float | None = Field(description="the completion's log-probability under the model (temperature 1)")
    reward: float | None = Field(description="the run's weighted reward total; null without an answer")
    trajectory: PlaygroundTrajectory | None = Field(
        None, description="with tools: every turn of the completion, in order; null without tools"
    )


class PlaygroundResult(BaseModel):
    model: PlaygroundModelOut
    completions: list[PlaygroundCompletion]
    rewards: dict[str, list[float | None]] | None = Field(
        description="each reward function's value per completion (as training computes it); null without an answer"
    )
    reward_weights: dict[str, float] | None
    reward_errors: dict[str, str] | None = Field(description="rewards that could not be computed, and why")
    prompt_tokens: int
    image_tokens: int
    seconds: float = Field(description="wall-clock seconds of loading (when not already loaded) and generating")
    reused: bool = Field(description="the model was already loaded in the worker's playground process")
    device: str


class GenerationOut(BaseModel):
    id: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"] = Field(
        description="a generation being cancelled shows as running until it stops"
    )
    queue_position: int | None = Field(description="1-based among the queued jobs of its queue; null once started")
    message: str | None = Field(description="what it is doing or waiting for")
    progress: float
    queue: str
    models: list[PlaygroundModelOut]
    prompt: list[dict[str, Any]] = Field(description="the conversation the models were given, one image part per image")
    images: list[ImageRef] = Field(description="the images, in the order of the prompt's image parts")
    answer: str | int | float | None
    sampling: dict[str, Any] = Field(
        description="num_generations, temperature, top_p, max_new_tokens, seed, tools (their names), "
        "max_tool_calling_iterations"
    )
    results: list[PlaygroundResult]
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    worker: str | None
    url: str


class UploadOut(BaseModel):
    sha256: str
    width: int
    height: int
    bytes: int = Field(description="the stored PNG's size (what counts against the quota)")
    url: str
    thumb_url: str
    new: bool = Field(description="false: this token had uploaded the same image before (not counted again)")


class UploadsOut(BaseModel):
    items: list[UploadOut]
    used_bytes: int
    quota_bytes: int


# ------------------------------------------------------------------------------------------------ memory plan
class PlanRequest(BaseModel):
    """``POST /plan``: a run config as ``POST /runs`` takes it, and the machine to judge it against."""

    config: RunConfig = Field(description="a whole run config (validated as POST /runs validates it)")
    gpus: int | None = Field(None, ge=1, le=1024, description="processes to plan for; empty: the config's")
    gpu_memory: str | None = Field(
        None, max_length=32, description="memory of one GPU (80GiB, 141GB, ...); empty: fits is not judged"
    )


class PlanModelOut(BaseModel):
    model_type: str
    parameters: int
    trainable: int
    vision_parameters: int
    largest_layer: int = Field(description="parameters of the largest decoder layer or vision block")
    layers: int
    hidden: int
    intermediate: int
    kv_width: int = Field(description="key/value heads x head dim")
    vocab: int
    dtype_bytes: int


class PlanRunOut(BaseModel):
    processes: int
    micro_batch: int
    sequence: int = Field(description="max_prompt_length + max_completion_length")
    rollouts_per_process: int
    beta: float
    lora: bool
    gradient_checkpointing: bool


class PlanStrategyOut(BaseModel):
    """Bytes per process for one strategy (``ddp``, ``fsdp``, ``fsdp+offload``); docs/scaling.md has the formula."""

    strategy: str
    parameters: int
    gradients: int
    optimizer: int
    reference: int
    gathered: int = Field(description="FSDP: full layers gathered at once while training")
    activations: int
    logits: int
    generation_cache: int
    generation_weights: int = Field(description="what generating adds: FSDP gathers the whole policy")
    host: int = Field(description="bytes offloaded to host memory")
    training_peak: int
    generation_peak: int
    peak: int
    fits: bool | None = Field(description="peak within gpu_memory; null when no gpu_memory was given")


class PlanOut(BaseModel):
    model: PlanModelOut
    run: PlanRunOut
    gpu_memory: int | None
    strategies: list[PlanStrategyOut]
