"""The playground process of a worker: ``python -m collage.worker.playground.process``, started by
:mod:`collage.worker.playground.service` (never by the Celery process's own imports: torch lives here).

It keeps the model(s) of the last generation loaded, so the next request for the same model answers at once, and
exits on its own after ``COLLAGE_PLAYGROUND_TTL`` seconds without a request (the memory goes back), when its stdin
closes or its parent process is gone (the worker ended). A request for other models drops the
ones the request does not name before it loads the new ones.

Protocol (JSON lines, like ``collage.app.datasets.process``): a request on stdin ``{"op": "generate", "model": {...},
"keep": [{...}, ...], "prompt": [...], "images": [sha256, ...], "artifacts": DIR, "answer", "columns", "rewards":
[...], "reward_modules": [...], "num_generations", "temperature", "top_p", "max_new_tokens", "seed", "tools": [...],
"tool_modules": [...], "max_tool_calling_iterations", "max_images_per_rollout", "cancel": FILE}``; on stdout first
``{"event": "received"}``, then progress events (``loading``, ``generating``, ``scoring``), then one answer:
``{"ok": true, "result": {...}}`` or ``{"ok": false, "error": "...", "cancelled": bool}`` (a cancelled one with the
``phase`` it stopped in). The request's ``cancel`` file appearing stops the work: it is looked for between the
phases and before every forward pass of the model (a pre-forward hook), so a cancel stops a generation at its next
token.

Everything is Collage's own training code: the row is built and its images decoded as a dataset row is
(``training.data.rows``), the prompt encoded and collated by ``training.batching`` with the run's
``max_prompt_length``, completions sampled by ``training.generation`` and scored by ``training.rewards`` with the
operator's reward-module allowlist (sent by the worker, never by the client). With ``tools``, each completion is a
multi-turn rollout of ``training.rollout.multi_turn`` under the operator's tool-module allowlist, and its answer
carries every turn (``trajectory``: texts, tool calls, errors, tool images as base64 PNG with their source).
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import select
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collage.worker.errors import WorkerError

TTL_ENV = "COLLAGE_PLAYGROUND_TTL"
PARENT_ENV = "COLLAGE_PLAYGROUND_PARENT"
WORKDIR_ENV = "COLLAGE_PLAYGROUND_WORKDIR"  # an empty folder to work in (imports are resolved before the move)
MAX_IMAGES_PER_ROLLOUT = 16  # with tools, for a base model: train.max_images_per_rollout's default
TOOL_IMAGE_SIDE = 512  # a tool image in the answer: at most this many pixels a side (for showing)
TOOL_IMAGE_BYTES = 6 << 20  # base64 PNG bytes of tool images one model's answer carries (a job result is a row)
TURN_TEXT_CHARS = 20_000  # characters of one turn's text in the answer (a tool of the operator's may say a lot)


_SCRATCH: list[Path] = []  # this process's folder for consolidated sharded checkpoints (removed at exit)


def _with_weights(model_dir: Path, key: Any) -> Path:
    """A sharded checkpoint's ``model/`` holds configs only: its shards consolidated once into this process's
    scratch folder (training.sharded_checkpoint); any other folder as it is."""
    from collage.training.sharded_checkpoint import with_weights

    if not _SCRATCH:
        import atexit
        import shutil
        import tempfile

        _SCRATCH.append(Path(tempfile.mkdtemp(prefix="collage-playground-")))
        atexit.register(shutil.rmtree, _SCRATCH[0], True)
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    return with_weights(model_dir, _SCRATCH[0] / digest)


class Failed(WorkerError):
    """A request that cannot be answered, in the user's words."""


class Cancelled(WorkerError):
    """The request's cancel file appeared."""


@dataclass
class Stopper:
    """The request's cancel file: present means stop."""

    path: Path | None

    def check(self) -> None:
        if self.path is not None and self.path.exists():
            raise Cancelled("cancelled")

    def hook(self, _module: Any, _args: Any) -> None:  # a forward pre-hook: runs before every forward pass
        self.check()


@dataclass
class Loaded:
    model: Any
    processor: Any
    family: Any
    device: Any
    encoders: dict[int | None, Any] = field(default_factory=dict)
    tool_encoders: dict[tuple[int | None, str], Any] = field(default_factory=dict)

    def encoder(self, max_prompt_length: int | None, tools: list[dict[str, Any]] | None = None) -> Any:
        """The prompt encoder with the run's ``max_prompt_length`` (kept: building one scans the vocabulary) and,
        with ``tools`` (their JSON schemas), a copy of it that shows them to the model as training does (the chat
        template's tools turn); the encoder without tools is never changed."""
        import copy

        from collage.training.batching.encoding import PromptEncoder

        if max_prompt_length not in self.encoders:
            self.encoders[max_prompt_length] = PromptEncoder(self.processor, self.family, max_prompt_length)
        plain = self.encoders[max_prompt_length]
        if not tools:
            return plain
        key = (max_prompt_length, json.dumps(tools, sort_keys=True))
        if key not in self.tool_encoders:
            if len(self.tool_encoders) >= 8:  # a few tool sets at a time (each one only a shallow copy)
                self.tool_encoders.clear()
            with_tools = copy.copy(plain)
            with_tools.tools = tools
            self.tool_encoders[key] = with_tools
        return self.tool_encoders[key]


def model_key(spec: dict[str, Any]) -> str:
    """What identifies a loaded model: kind, folder, base and dtype, and the folder's modification time (a rewritten
    checkpoint of the same step is loaded again)."""
    folder = Path(spec["path"])
    try:
        stamp = folder.stat().st_mtime_ns if folder.is_dir() else 0
    except OSError:
        stamp = 0
    return json.dumps([spec["kind"], spec["path"], spec.get("base"), spec.get("dtype", "auto"), stamp])


def _out_of_memory(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class Playground:
    def __init__(self, emit: Any):
        self._emit = emit
        self.loaded: dict[str, Loaded] = {}
        self.phase = "starting"  # what the current request is doing (a cancel says where it stopped)

    def emit(self, message: dict[str, Any]) -> None:
        self.phase = message.get("event", self.phase)
        self._emit(message)

    # ------------------------------------------------------------------------------------------------ models
    def drop(self, keep: set[str]) -> None:
        """Unload every model whose key is not in ``keep`` and give its memory back."""
        gone = [k for k in self.loaded if k not in keep]
        for key in gone:
            del self.loaded[key]
        if gone:
            import torch

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def load(self, spec: dict[str, Any], stop: Stopper) -> tuple[Loaded, bool]:
        key = model_key(spec)
        if key in self.loaded:
            return self.loaded[key], True
        self.emit({"event": "loading"})
        import torch

        from collage.training.models.loading import load_model, load_processor

        kind, path, label = spec["kind"], spec["path"], spec["label"]
        if kind != "base":
            folder = Path(path)
            if not folder.is_dir():
                raise Failed(
                    f"{label}: the checkpoint's model folder is no longer on disk (removed by train.save_total_limit, "
                    "or the run was deleted); pick another step"
                )
            if kind == "checkpoint":  # recorded before checkpoints said what they hold
                kind = "adapter" if (folder / "adapter_config.json").is_file() else "full"
        elif not path.startswith("tiny:"):
            folder = Path(path)
            if not (folder / "config.json").is_file():
                adapter = (folder / "adapter_config.json").is_file()
                raise Failed(
                    f"{path}: a LoRA adapter folder, not a model (load it through its run, or export it merged)"
                    if adapter
                    else f"{path}: no model folder there (no config.json)"
                )
        dtype = spec.get("dtype") or "auto"
        try:
            if kind != "base":
                path = str(_with_weights(Path(path), key))
            if kind == "adapter":
                from peft import PeftModel

                processor, family = load_processor(spec["base"])
                model = PeftModel.from_pretrained(load_model(spec["base"], dtype), path)
            else:
                processor, family = load_processor(path)
                model = load_model(path, dtype)
        except (OSError, ValueError) as exc:
            raise Failed(f"{label}: could not load the model: {str(exc).splitlines()[0][:500]}") from exc
        stop.check()
        if processor.tokenizer.pad_token_id is None:
            raise Failed(f"{label}: the tokenizer has no pad token")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model.generation_config.top_k = None  # plain temperature sampling, as training samples
        model.to(device).eval()
        loaded = Loaded(model, processor, family, device)
        self.loaded[key] = loaded
        return loaded, False

    # --------------------------------------------------------------------------------------------- a request
    def sample(self, req: dict[str, Any]) -> Any:
        """The request as a dataset row: its images read from the artifacts store by hash (confined to it, raster
        formats only) and decoded, its prompt checked against them, exactly as a training row is."""
        from collage.app.store.images import relative_path
        from collage.training.data.errors import RowError
        from collage.training.data.rows import RawRow
        from collage.training.infra.images import FileMissing, ImageRefused, image_file, read_image_file, resolve_roots

        artifacts = Path(req["artifacts"])
        roots = resolve_roots([artifacts])
        refs = []
        for i, sha in enumerate(req["images"]):
            what = f"image {i + 1} ({sha[:12]}...)"
            try:
                file = image_file(relative_path(sha), artifacts, roots)
                refs.append({"bytes": read_image_file(file, confined=True)})
            except FileMissing as exc:
                raise Failed(f"{what} is missing from the artifacts store") from exc
            except (ImageRefused, ValueError) as exc:
                raise Failed(f"{what} {exc}") from exc
        data = {**(req.get("columns") or {}), "prompt": req["prompt"], "images": refs}
        if req.get("answer") is not None:
            data["answer"] = req["answer"]
        try:
            return RawRow(0, data).to_sample()
        except RowError as exc:
            raise Failed(_images_named(exc.message, req["images"])) from exc

    def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        import torch

        from collage.training.batching.batch import collate
        from collage.training.batching.forward import base_model
        from collage.training.batching.logprobs import completion_logprobs_and_entropy
        from collage.training.data.errors import RowError
        from collage.training.generation import generate

        tic = time.perf_counter()
        stop = Stopper(Path(req["cancel"]) if req.get("cancel") else None)
        stop.check()
        spec = req["model"]
        label = spec["label"]
        self.drop({model_key(s) for s in req.get("keep") or [spec]})
        sample = self.sample(req)
        loaded, reused = self.load(spec, stop)
        tools = self._tools(req, loaded) if req.get("tools") else []
        encoder = loaded.encoder(spec.get("max_prompt_length"), [t.schema for t in tools])
        try:
            encoded = encoder.encode(sample)
        except RowError as exc:
            raise Failed(f"{label}: {_images_named(exc.message, req['images'])}") from exc
        stop.check()
        model, family, tokenizer = loaded.model, loaded.family, loaded.processor.tokenizer
        n = int(req["num_generations"])
        prompt = self._to_device(collate([encoded], family, tokenizer.pad_token_id), loaded)
        if req.get("seed") is not None:
            torch.manual_seed(int(req["seed"]))
        else:
            torch.seed()
        self.emit({"event": "generating"})
        if tools:
            return self._generate_with_tools(req, sample, encoded, encoder, tools, loaded, prompt, stop, reused, tic)
        hook = base_model(model).register_forward_pre_hook(stop.hook)
        try:
            completions = generate(
                model, prompt, n, family, tokenizer, encoder.image_token_id, encoder.protected,
                int(req["max_new_tokens"]), _sampling(req),
            )  # fmt: skip
            full = self._to_device(
                collate([encoded] * n, family, tokenizer.pad_token_id, completions.ids, encoder.protected), loaded
            )
            with torch.no_grad():
                logps, _ = completion_logprobs_and_entropy(
                    model, full, family, encoder.image_token_id, 1.0, entropy=False
                )
        finally:
            hook.remove()
        sums = (logps.float() * full.completion_mask).sum(-1).tolist()
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completions.ids]
        stop.check()
        completed = [
            {"text": text, "tokens": len(ids), "truncated": cut, "logprob": _finite(lp), "reward": None}
            for text, ids, cut, lp in zip(texts, completions.ids, completions.truncated, sums, strict=True)
        ]
        return self._answer(req, sample, encoded, loaded, reused, tic, completed, completions.ids)

    def _answer(
        self, req: dict[str, Any], sample: Any, encoded: Any, loaded: Loaded, reused: bool, tic: float,
        completions: list[dict[str, Any]], ids: list[list[int]], turns: list[Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """A generation's answer: its completions, scored when the request has an answer to score against."""
        result: dict[str, Any] = {
            "completions": completions,
            "rewards": None,
            "reward_weights": None,
            "reward_errors": None,
            "prompt_tokens": len(encoded.input_ids),
            "image_tokens": encoded.num_image_tokens,
            "reused": reused,
            "device": str(loaded.device),
            "pid": os.getpid(),
        }
        if req.get("answer") is not None:
            self.emit({"event": "scoring"})
            texts = [c["text"] for c in completions]
            self._score(req, sample, texts, ids, result, turns)
        result["seconds"] = round(time.perf_counter() - tic, 3)
        return result

    @staticmethod
    def _tools(req: dict[str, Any], loaded: Loaded) -> list[Any]:
        """The request's tools as callables, resolved under the worker's tool-module allowlist (sent by the worker,
        never by the client: a module outside it is refused before anything is imported), the built-ins' crops
        bounded by the longest side the processor takes."""
        from collage.training.config import ToolSettings
        from collage.training.tools.multiturn import processor_max_side
        from collage.training.tools.registry import UnknownToolError, resolve_tools

        label, family = req["model"]["label"], loaded.family
        if "batch_num_images" in family.extra_inputs:
            raise Failed(f"{label}: tools are not supported for {family.name}: its processor lays out a lone image "
                         "(anyres patches) unlike one among several")  # fmt: skip
        try:
            settings = [ToolSettings.model_validate(t) for t in req["tools"]]
            return resolve_tools(
                settings, tuple(req.get("tool_modules") or ()), processor_max_side(loaded.processor, family)
            )
        except (UnknownToolError, ValueError) as exc:
            raise Failed(f"{label}: {str(exc).strip().splitlines()[0][:500]}") from exc

    def _generate_with_tools(
        self, req: dict[str, Any], sample: Any, encoded: Any, encoder: Any, tools: list[Any], loaded: Loaded,
        prompt: Any, stop: Stopper, reused: bool, tic: float,
    ) -> dict[str, Any]:  # fmt: skip
        """Each completion a multi-turn rollout with the request's tools (``training.rollout.multi_turn``, as
        training and evaluation run them), its turns sampled by :func:`turn_sampler` with the request's own
        sampling; ``max_new_tokens`` bounds every assistant and tool token of a rollout, as a run's
        ``max_completion_length`` does. The answer carries every turn."""
        import torch

        from collage.training.batching.forward import base_model
        from collage.training.batching.logprobs import completion_logprobs_and_entropy
        from collage.training.data.errors import RowError
        from collage.training.generation import eos_ids
        from collage.training.rollout import multi_turn
        from collage.training.tools.multiturn import MultiTurnEngine, TurnLimits

        model, family, tokenizer = loaded.model, loaded.family, loaded.processor.tokenizer
        engine = MultiTurnEngine(encoder, tokenizer, family, tools, None, eos_ids(model, tokenizer))
        limits = TurnLimits(
            int(req.get("max_tool_calling_iterations") or 4),
            int(req.get("max_images_per_rollout") or MAX_IMAGES_PER_ROLLOUT),
            int(req["max_new_tokens"]),
        )
        n = int(req["num_generations"])
        hook = base_model(model).register_forward_pre_hook(stop.hook)
        try:
            generate, resume = turn_sampler(loaded, encoder, _sampling(req))
            try:
                batch, trajectories = multi_turn(
                    engine, model, [sample], [encoded], prompt, n, limits, generate, lambda _b: None,
                    lambda b: self._to_device(b, loaded), resume,
                )  # fmt: skip
            except RowError as exc:  # a tool turn the processor refused
                raise Failed(f"{req['model']['label']}: {_images_named(exc.message, req['images'])}") from exc
            full = self._to_device(batch, loaded)
            with torch.no_grad():
                logps, _ = completion_logprobs_and_entropy(
                    model, full, family, encoder.image_token_id, 1.0, entropy=False
                )
        finally:
            hook.remove()
        sums = (logps.float() * full.completion_mask).sum(-1).tolist()
        stop.check()
        texts = [t.completion_text for t in trajectories]
        ids = [t.generated_ids for t in trajectories]
        budget = [TOOL_IMAGE_BYTES]
        completed = [
            {
                "text": text,
                "tokens": len(own),
                "truncated": t.truncated,
                "logprob": _finite(lp),
                "reward": None,
                "trajectory": trajectory_json(t, budget),
            }
            for text, own, t, lp in zip(texts, ids, trajectories, sums, strict=True)
        ]  # fmt: skip
        return self._answer(req, sample, encoded, loaded, reused, tic, completed, ids, [t.turns for t in trajectories])

    @staticmethod
    def _to_device(batch: Any, loaded: Loaded) -> Any:
        dtype = next(loaded.model.parameters()).dtype
        batch.input_ids = batch.input_ids.to(loaded.device)
        batch.attention_mask = batch.attention_mask.to(loaded.device)
        batch.completion_mask = batch.completion_mask.to(loaded.device)
        batch.pixels = {
            k: v.to(loaded.device, dtype=dtype) if v.is_floating_point() else v.to(loaded.device)
            for k, v in batch.pixels.items()
        }
        return batch

    @staticmethod
    def _score(
        req: dict[str, Any],
        sample: Any,
        texts: list[str],
        ids: list[list[int]],
        result: dict[str, Any],
        trajectories: list[list[Any]] | None = None,
    ) -> None:
        """Every reward of the run on every completion, each on its own (one that fails is reported, the others
        still count), and their weighted total as training combines them (a ``None`` is skipped)."""
        from collage.training.rewards import RewardBatch, RewardError, resolve_reward, score

        n = len(texts)
        batch = RewardBatch(
            prompts=[sample.prompt] * n,
            completions=texts,
            completion_ids=ids,
            images=[sample.images] * n,
            columns={k: [v] * n for k, v in sample.columns.items()},
            rows=[0] * n,
            trajectories=trajectories,
        )
        values: dict[str, list[float | None]] = {}
        weights: dict[str, float] = {}
        errors: dict[str, str] = dict(req.get("reward_errors") or {})
        for spec in req.get("rewards") or []:
            name = spec["name"]
            try:
                reward = resolve_reward(
                    name,
                    spec.get("weight", 1.0),
                    spec.get("args") or {},
                    reward_modules=tuple(req.get("reward_modules") or ()),
                    on_images=spec.get("on_images_for_text_reward", "error"),
                )
                if name == "length" and req.get("max_completion_length"):
                    reward.args.setdefault("max_completion_length", req["max_completion_length"])
                if reward.text_model is not None and sample.images and spec.get("on_images_for_text_reward") != "drop":
                    raise ValueError(
                        "a text reward model cannot see images (the run sets on_images_for_text_reward: error)"
                    )
                column = [row[0] for row in score([reward], batch)]
            except (ValueError, RewardError) as exc:
                errors[reward_name(name)] = str(exc).strip().splitlines()[0][:500]
                continue
            key = reward.name
            values[key] = [None if math.isnan(v) else v for v in column]
            weights[key] = reward.weight
        result["rewards"] = values
        result["reward_weights"] = weights
        result["reward_errors"] = errors or None
        for i, completion in enumerate(result["completions"]):
            scored = [v * weights[k] for k in values if (v := values[k][i]) is not None]
            completion["reward"] = sum(scored) if scored else None


def turn_sampler(loaded: Loaded, encoder: Any, sampling: Any) -> tuple[Any, Any]:
    """How a multi-turn rollout samples its turns: ``(generate, resume)`` for ``training.rollout.multi_turn``, with
    the loaded model, the request's sampling and the generation backend ``hf`` (``training.generation.BACKENDS``),
    exactly as the trainer samples them (``training.rollout.turn_samplers``: the built-in backend continues each
    later turn from the KV cache of the one before). A test scripts the model's turns by replacing that backend, as
    the training tests do (a tiny random model never calls a tool); a replaced backend re-prefills each turn."""
    from collage.training.generation import backend
    from collage.training.rollout import turn_samplers

    return turn_samplers(backend("hf"), loaded.model, loaded.family, loaded.processor.tokenizer,
                         encoder.image_token_id, encoder.protected, sampling)  # fmt: skip


def tool_image_json(image: Any, source: dict[str, Any] | None, budget: list[int]) -> dict[str, Any]:
    """A tool image as the answer carries it: a PNG (base64) shrunk to at most TOOL_IMAGE_SIDE pixels a side for
    showing, the image's own size (its ``bbox_2d`` and the next call's refer to those pixels) and its source; past
    the result's TOOL_IMAGE_BYTES (``budget``: what is left) the PNG is left out (null)."""
    import base64
    import io

    shown = image.copy()
    shown.thumbnail((TOOL_IMAGE_SIDE, TOOL_IMAGE_SIDE))
    buf = io.BytesIO()
    shown.convert("RGB").save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    png = data if len(data) <= budget[0] else None
    if png is not None:
        budget[0] -= len(data)
    return {"png": png, "width": image.width, "height": image.height, "source": source}


def trajectory_json(trajectory: Any, budget: list[int]) -> dict[str, Any]:
    """A rollout's turns as the answer carries them (the rollout rows' shape: a malformed call has no tool_call,
    its tool turn the error the model was shown; a turn's text cut at TURN_TEXT_CHARS)."""
    turns = []
    for turn in trajectory.turns:
        call = turn.tool_call
        text = turn.text if len(turn.text) <= TURN_TEXT_CHARS else turn.text[:TURN_TEXT_CHARS] + " […]"
        turns.append({
            "role": turn.role,
            "text": text,
            "tool_call": call.to_json() if call is not None and not call.error else None,
            "images": [tool_image_json(im.image, im.source, budget) for im in turn.images],
            "error": turn.error,
        })  # fmt: skip
    return {"turns": turns, "tool_calls": trajectory.tool_calls, "tool_errors": trajectory.tool_errors,
            "capped": trajectory.capped}  # fmt: skip


def reward_name(name: str) -> str:
    """How a reward is named in the results: a function's own name (``module:function`` -> ``function``), a reward
    model's folder name, a built-in's name, as the run's metrics name them."""
    if ":" in name and not name.startswith(("/", "~")):
        return name.rpartition(":")[2]
    return Path(name).name if name.startswith(("/", "~")) else name


def _images_named(message: str, shas: list[str]) -> str:
    """A row error's ``image 0`` (counted from 0) as the playground names it: ``image 1 (<hash>...)``."""
    import re

    def name(match: re.Match) -> str:
        k = int(match.group(1))
        return f"image {k + 1} ({shas[k][:12]}...)" if k < len(shas) else match.group(0)

    return re.sub(r"\bimage (\d+)\b", name, message)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def answer(playground: Playground, line: str) -> dict[str, Any]:
    try:
        req = json.loads(line)
        if not isinstance(req, dict) or req.get("op") != "generate":
            return {"ok": False, "error": f"unknown request {line[:100]!r}", "cancelled": False}
        playground.emit({"event": "received"})
        return {"ok": True, "result": playground.generate(req)}
    except Cancelled:
        return {"ok": False, "error": "cancelled", "cancelled": True, "phase": playground.phase}
    except Failed as exc:
        return {"ok": False, "error": str(exc), "cancelled": False}
    except Exception as exc:  # noqa: BLE001 - every failure is answered; the process keeps serving
        if _out_of_memory(exc):
            playground.drop(set())  # start the next request from nothing
            where = "GPU" if "cuda" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError" else "host"
            return {
                "ok": False,
                "cancelled": False,
                "error": f"out of {where} memory: lower num_generations or max_new_tokens, use fewer or smaller "
                "images, or use a smaller model",
            }
        traceback.print_exc()  # the worker's log keeps the whole story
        first = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ""
        return {"ok": False, "error": f"{type(exc).__name__}: {first}", "cancelled": False}


def watch_parent(parent: int, every: float = 1.0) -> None:
    """Exit as soon as the worker that started this process is gone, even in the middle of a generation. (Not
    ``PR_SET_PDEATHSIG``: that follows the thread that started the process, and a worker may start it from a
    thread that ends long before the worker does.)"""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        print(f"collage playground {os.getpid()}: the worker (pid {parent}) is gone: exiting", file=sys.stderr)
        os._exit(0)

    threading.Thread(target=watch, name="collage-playground-parent", daemon=True).start()


def _sampling(req: dict[str, Any]) -> Any:
    """Temperature 0 asks for greedy decoding (the most likely token each step), as other playgrounds take it."""
    from collage.training.generation import Sampling

    temperature = float(req["temperature"])
    if temperature == 0.0:
        return Sampling(greedy=True)
    return Sampling(temperature, float(req["top_p"]))


def main() -> int:
    parent = int(os.environ.get(PARENT_ENV) or 0)
    if parent:
        watch_parent(parent)
    from collage.worker.child import lower_priority

    lower_priority()  # the training's nice value: a playground on a shared machine leaves the web app its share
    if os.environ.get(WORKDIR_ENV):
        os.chdir(os.environ[WORKDIR_ENV])
    ttl = float(os.environ.get(TTL_ENV) or 600)
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # anything a library prints goes to stderr: stdout carries only answers
    sys.stdout = sys.stderr

    def emit(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    playground = Playground(emit)
    buffer = b""
    while True:
        while b"\n" not in buffer:
            ready, _, _ = select.select([0], [], [], ttl)
            if not ready:
                print(f"collage playground {os.getpid()}: no request for {ttl:.0f}s: exiting", file=sys.stderr)
                return 0  # the memory goes back; the worker starts a new process for the next request
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the worker stopped this process (a training starts there) or is gone
                print(f"collage playground {os.getpid()}: the worker closed its pipe: exiting", file=sys.stderr)
                return 0
            buffer += chunk
        line, _, buffer = buffer.partition(b"\n")
        if line.strip():
            emit(answer(playground, line.decode("utf-8", "replace")))


if __name__ == "__main__":
    sys.exit(main())
