"""The playground's request side (torch-free, the web node runs it): uploads cleaned into plain PNGs, a prompt and
its images made into the conversation training would see, and each model of a request resolved to what a worker
loads (a run's checkpoint, or a base model under the operator's roots).

Everything here either returns what the job needs or raises :class:`Refused` with the HTTP status, the request
field and a message in the user's terms; the routes (``app.routers.playground``) turn that into the answer.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError
from sqlmodel import Session

from collage.app.core.errors import WebError
from collage.app.core.settings import Settings
from collage.app.core.trust import base_model_problem, tool_violation
from collage.app.schemas import PLAYGROUND_TOOL_CALLS_MAX
from collage.app.store import checkpoints as checkpoint_store
from collage.app.store.checkpoints import CheckpointEntry
from collage.app.store.tables import Run
from collage.training.config import ConfigError, RunConfig, parse_config
from collage.training.data.errors import RowError
from collage.training.data.rows import normalise_prompt
from collage.training.infra.images import RASTER_FORMATS, ImageRefused, decode_raster

# the formats an upload may have: the raster allowlist of training.images, narrowed to what browsers and cameras
# write (MPO is how Pillow names a multi-picture JPEG, decoded by the same JPEG decoder)
UPLOAD_FORMATS: tuple[str, ...] = tuple(f for f in RASTER_FORMATS if f in ("PNG", "JPEG", "WEBP"))
UPLOAD_FORMAT_NAMES = "PNG, JPEG or WebP"
DECODED_AS = {"PNG": "PNG", "JPEG": "JPEG", "MPO": "JPEG", "WEBP": "WEBP"}

# the built-in rewards a base model (no run, so no reward list of its own) is scored with when an answer is given
BASE_REWARDS: tuple[dict[str, Any], ...] = (
    {"name": "accuracy", "weight": 1.0, "args": {}, "on_images_for_text_reward": "error"},
    {"name": "format", "weight": 1.0, "args": {}, "on_images_for_text_reward": "error"},
)


class Refused(WebError):
    """A request the playground cannot take: ``status`` (404, 409, 413, 422), the request field, the reason."""

    def __init__(self, status: int, path: str, message: str):
        super().__init__(message)
        self.status, self.path, self.message = status, path, message


# ---------------------------------------------------------------------------------------------------- uploads
@dataclass(frozen=True)
class CleanImage:
    png: bytes  # RGB, no metadata
    width: int
    height: int
    source_format: str  # PNG, JPEG or WEBP: what was uploaded


def _rgb(image: Image.Image) -> Image.Image:
    """The image as plain RGB: transparency flattened onto white (a model sees no alpha channel)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image.convert("RGB")


def clean_upload(data: bytes, max_pixels: int) -> CleanImage:
    """Decode an uploaded file (PNG, JPEG or WebP only; the header's size checked against ``max_pixels`` before any
    pixel is decoded), turn it upright (EXIF orientation), flatten it to RGB and encode it again as a PNG built from
    the pixels alone: no EXIF, no GPS, no ICC profile, no text chunk of the original survives. ``ImageRefused`` says
    what is wrong (the route names the field)."""
    if not data:
        raise ImageRefused("is empty (0 bytes)")
    try:
        with Image.open(io.BytesIO(data), formats=UPLOAD_FORMATS) as probe:
            fmt, (width, height) = probe.format or "", probe.size
    except UnidentifiedImageError as exc:
        raise ImageRefused(f"is not a {UPLOAD_FORMAT_NAMES} image (the playground takes only these formats)") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageRefused(f"is too large to decode: {exc}") from exc
    except (OSError, SyntaxError, ValueError, TypeError, EOFError) as exc:
        raise ImageRefused(f"is unreadable: {exc}") from exc
    if width * height > max_pixels:
        raise ImageRefused(
            f"is {width}x{height} pixels, more than the {max_pixels} an upload may have (COLLAGE_UPLOAD_MAX_PIXELS; "
            "a decompression bomb?)"
        )
    image = decode_raster(data)  # the project's one checked decoder: the raster allowlist, the pixel bound
    if DECODED_AS.get(image.format or "") != DECODED_AS.get(fmt):
        raise ImageRefused(f"is not a {UPLOAD_FORMAT_NAMES} image")
    try:
        upright = ImageOps.exif_transpose(image) or image
        rgb = _rgb(upright)
    except (OSError, ValueError) as exc:
        raise ImageRefused(f"has pixels that cannot be turned into RGB (mode {image.mode}): {exc}") from exc
    bare = Image.frombytes("RGB", rgb.size, rgb.tobytes())  # a new image: none of the original's metadata
    buf = io.BytesIO()
    bare.save(buf, format="PNG")
    return CleanImage(buf.getvalue(), bare.width, bare.height, DECODED_AS[fmt])


# a re-encoded upload (a PNG of its pixels) may be at most this many times the bytes sent, and never more than
# UPLOAD_STORED_FACTOR times COLLAGE_UPLOAD_MAX_BYTES: a 2.5 MB JPEG of noise re-encodes to a 59 MB PNG (23 times)
UPLOAD_GROWTH = 12
UPLOAD_GROWTH_FLOOR = 1 << 20  # small files may always grow to this (a PNG's own overhead on a tiny image)
UPLOAD_STORED_FACTOR = 4


def upload_growth_error(sent: int, stored: int, max_bytes: int) -> str | None:
    """Why an upload whose ``sent`` bytes re-encode to ``stored`` bytes of PNG is not kept, or None."""
    cap = min(max(UPLOAD_GROWTH * sent, UPLOAD_GROWTH_FLOOR), UPLOAD_STORED_FACTOR * max_bytes)
    if stored <= cap:
        return None
    return (
        f"re-encodes to a PNG of {stored} bytes, more than the {cap} an upload of {sent} bytes may become "
        f"({UPLOAD_GROWTH} times what was sent, at most {UPLOAD_STORED_FACTOR} x COLLAGE_UPLOAD_MAX_BYTES): images "
        "of noise or film grain do not compress; send a smaller or a cleaner image"
    )


# ----------------------------------------------------------------------------------------------------- prompts
MARKER = re.compile(r"\[image (\d+)\]")


def prompt_conversation(prompt: str | list[dict[str, Any]], num_images: int) -> tuple[list[dict[str, Any]], list[int]]:
    """The conversation the model sees, with one ``{"type": "image"}`` part per image, and the order in which the
    request's images fill those parts (0-based indices into the request's ``images``).

    A string without markers is one user turn with the images before the text, as training makes a plain-string
    dataset prompt. A string that places ``[image N]`` markers (1-based, the dashboard's notation for where an
    image stands) gets image N where its marker is; then every image must be placed exactly once. A conversation
    (a rollout row's prompt, as stored) is taken as it is and must hold one placeholder per image.
    :class:`Refused` (422, ``prompt``) otherwise."""
    in_order = list(range(num_images))
    if not isinstance(prompt, str):
        try:
            return normalise_prompt(0, prompt, num_images), in_order
        except RowError as exc:
            raise Refused(422, "prompt", exc.message.replace("the row has", "the request has")) from exc
    marks = [int(m.group(1)) for m in MARKER.finditer(prompt)]
    if not marks:
        return normalise_prompt(0, prompt, num_images), in_order
    wrong = sorted({n for n in marks if not 1 <= n <= num_images})
    if wrong:
        raise Refused(422, "prompt", f"places [image {wrong[0]}] but the request has {num_images} image(s)")
    twice = sorted({n for n in marks if marks.count(n) > 1})
    if twice:
        raise Refused(422, "prompt", f"places [image {twice[0]}] more than once: each image goes in one place")
    missing = [n for n in range(1, num_images + 1) if n not in marks]
    if missing:
        raise Refused(
            422, "prompt", f"places some images but not [image {missing[0]}]: place every image, or none (then "
            "the images go before the text)"
        )  # fmt: skip
    parts: list[dict[str, Any]] = []
    for k, text in enumerate(MARKER.split(prompt)):
        if k % 2:
            parts.append({"type": "image"})
        elif text:
            parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}], [n - 1 for n in marks]


# ------------------------------------------------------------------------------------------------------ models
@dataclass
class ResolvedModel:
    """What a worker loads for one model of a request (the job's request JSON holds it)."""

    label: str
    kind: str  # "base" (a path), "full" or "adapter" (a run's checkpoint), or "checkpoint" (recorded before 0007)
    path: str  # tiny:<family>, a model folder under the roots, or a checkpoint's model/ folder
    base: str | None = None  # an adapter's base model: the run's model.path
    dtype: str = "auto"
    run: str | None = None
    run_name: str | None = None
    step: int | None = None
    max_prompt_length: int | None = None  # the run's: the prompt is truncated as in training
    max_completion_length: int | None = None  # the run's (the `length` reward's bound)
    rewards: list[dict[str, Any]] | None = None  # the run's reward list (a base model: accuracy and format)
    queue: str = "default"
    tools: list[dict[str, Any]] | None = None  # the run's tools (its ToolSettings, as JSON); a base model: none
    max_images_per_rollout: int | None = None  # the run's (with tools)
    max_tool_calling_iterations: int | None = None  # the run's (a generation's default with tools)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _run_config(run: Run) -> RunConfig:
    try:
        return parse_config(run.config)
    except ConfigError as exc:
        raise Refused(409, "models", f"run {run.id}'s stored config no longer loads: {exc}") from exc


def find_checkpoint(
    session: Session, run: Run, step: checkpoint_store.StepChoice, settings: Settings, where: str
) -> CheckpointEntry:
    """The run's checkpoint at ``step`` (a number, ``best`` or ``last``), as ``GET /runs/{id}/checkpoints/{step}``
    picks it (404 for a step without one, 409 for ``last`` or ``best`` with nothing to pick), whose folder lies in
    the run's own folder under the artifacts (409 otherwise: a store row is data too)."""
    entries = checkpoint_store.run_checkpoints(session, run)
    try:
        entry = checkpoint_store.pick(entries, step, checkpoint_store.BestRule.of_config(run.config), f"run {run.id}")
    except checkpoint_store.CheckpointProblem as exc:
        raise Refused(exc.status, where, str(exc)) from exc
    if checkpoint_store.checkpoint_folder(entry.path, settings.artifacts, run.id) is None:
        raise Refused(409, where, f"run {run.id}'s checkpoint at step {entry.step} is not in the run's own folder")
    return entry


def resolve_model(session: Session, ref: dict[str, Any], index: int, settings: Settings) -> ResolvedModel:
    where = f"models[{index}]"
    if ref.get("path") is not None:
        path = ref["path"]
        if (problem := base_model_problem(path, settings)) is not None:
            raise Refused(422, f"{where}.path", problem)
        return ResolvedModel(label=path, kind="base", path=path, rewards=[dict(r) for r in BASE_REWARDS])
    run_id = ref["run"]
    asked = ref.get("step") or checkpoint_store.LAST
    if isinstance(asked, int):
        step: checkpoint_store.StepChoice = asked
    elif asked == "best":
        step = "best"
    elif asked == "last":
        step = "last"
    else:
        raise Refused(422, f"{where}.step", "a step number, best or last")
    run = session.get(Run, run_id) if len(run_id) <= 32 else None
    if run is None:
        raise Refused(404, f"{where}.run", f"no run with id {run_id!r}")
    config = _run_config(run)
    checkpoint = find_checkpoint(session, run, step, settings, f"{where}.step")
    kind = checkpoint.kind or "checkpoint"
    asked = f"{step} = step {checkpoint.step}" if isinstance(step, str) else f"step {checkpoint.step}"
    return ResolvedModel(
        label=f"{run.name} · {asked}",
        kind=kind,
        path=f"{checkpoint.path.rstrip('/')}/model",
        base=config.model.path,
        dtype=config.model.dtype,
        run=run.id,
        run_name=run.name,
        step=checkpoint.step,
        max_prompt_length=config.train.max_prompt_length,
        max_completion_length=config.train.max_completion_length,
        rewards=[r.model_dump(mode="json") for r in config.rewards],
        queue=config.resources.queue,
        tools=[t.model_dump(mode="json") for t in config.tools],
        max_images_per_rollout=config.train.max_images_per_rollout,
        max_tool_calling_iterations=config.train.max_tool_calling_iterations,
    )


TOOL_CALLS_DEFAULT = 4  # a generation's max_tool_calling_iterations with tools and no run model


def request_tools(names: list[str] | None, models: list[ResolvedModel], settings: Settings) -> list[dict[str, Any]]:
    """The tools a generation's models may call (each a ToolSettings as JSON): those named, a tool the first run
    model also has keeping that run's settings (its ``coords``, ``timeout`` and ``args``), others the defaults; or
    with ``names`` None the first run model's own (none for base models). Each must be allowed on this server (a
    built-in, or an import path inside a module of COLLAGE_TOOL_MODULES) and named once: :class:`Refused` (422,
    ``tools[k]``, naming it; ``tools`` for the run's own) otherwise."""
    runs = [m for m in models if m.run is not None]
    own = {t["name"]: t for t in (runs[0].tools or [])} if runs else {}
    chosen = list(own.values()) if names is None else [dict(own.get(n) or {"name": n}) for n in names]
    seen: set[str] = set()
    for k, spec in enumerate(chosen):
        name = spec["name"]
        path = "tools" if names is None else f"tools[{k}]"
        if name in seen:
            raise Refused(422, path, f"{name!r} is named twice: name each tool once")
        seen.add(name)
        if (problem := tool_violation(name, settings)) is not None:
            what = f"the run's tool {name!r}" if names is None else f"tool {name!r}"
            raise Refused(422, path, f"{what} may not run here: {problem}")
    return chosen


def request_tool_calls(asked: int | None, models: list[ResolvedModel]) -> int:
    """A generation's ``max_tool_calling_iterations``: the one asked for, or the first run model's own (at least
    1, at most the playground's bound), or :data:`TOOL_CALLS_DEFAULT` for base models."""
    if asked is not None:
        return asked
    runs = [m for m in models if m.run is not None and m.max_tool_calling_iterations is not None]
    if not runs:
        return TOOL_CALLS_DEFAULT
    return max(1, min(PLAYGROUND_TOOL_CALLS_MAX, int(runs[0].max_tool_calling_iterations or 0)))
