"""The playground process of a worker: ``python -m collage.worker.playground_child``, started by
:mod:`collage.worker.playground` (never by the Celery process's own imports: torch lives here).

It keeps the model(s) of the last generation loaded, so the next request for the same model answers at once, and
exits on its own after ``COLLAGE_PLAYGROUND_TTL`` seconds without a request (the memory goes back), when its stdin
closes or its parent process is gone (the worker ended). A request for other models drops the
ones the request does not name before it loads the new ones.

Protocol (JSON lines, like ``collage.app.datahelper``): a request on stdin ``{"op": "generate", "model": {...},
"keep": [{...}, ...], "prompt": [...], "images": [sha256, ...], "artifacts": DIR, "answer", "columns", "rewards":
[...], "reward_modules": [...], "num_generations", "temperature", "top_p", "max_new_tokens", "seed", "cancel":
FILE}``; on stdout first ``{"event": "received"}``, then progress events (``loading``, ``generating``,
``scoring``), then one answer: ``{"ok": true, "result": {...}}`` or ``{"ok": false, "error": "...", "cancelled":
bool}`` (a cancelled one with the ``phase`` it stopped in). The request's ``cancel`` file appearing stops the work: it is looked for between the phases and before
every forward pass of the model (a pre-forward hook), so a cancel stops a generation at its next token.

Everything is Collage's own training code: the row is built and its images decoded as a dataset row is
(``training.data.rows``), the prompt encoded and collated by ``training.batching`` with the run's
``max_prompt_length``, completions sampled by ``training.generation`` and scored by ``training.rewards`` with the
operator's reward-module allowlist (sent by the worker, never by the client).
"""

from __future__ import annotations

import gc
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

    def encoder(self, max_prompt_length: int | None) -> Any:
        """The prompt encoder with the run's ``max_prompt_length`` (kept: building one scans the vocabulary)."""
        from collage.training.batching.encoding import PromptEncoder

        if max_prompt_length not in self.encoders:
            self.encoders[max_prompt_length] = PromptEncoder(self.processor, self.family, max_prompt_length)
        return self.encoders[max_prompt_length]


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
        from collage.training.images import FileMissing, ImageRefused, image_file, read_image_file, resolve_roots

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
        try:
            encoded = loaded.encoder(spec.get("max_prompt_length")).encode(sample)
        except RowError as exc:
            raise Failed(f"{label}: {_images_named(exc.message, req['images'])}") from exc
        stop.check()
        model, family, tokenizer = loaded.model, loaded.family, loaded.processor.tokenizer
        encoder = loaded.encoder(spec.get("max_prompt_length"))
        n = int(req["num_generations"])
        prompt = self._to_device(collate([encoded], family, tokenizer.pad_token_id), loaded)
        if req.get("seed") is not None:
            torch.manual_seed(int(req["seed"]))
        else:
            torch.seed()
        self.emit({"event": "generating"})
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
        result: dict[str, Any] = {
            "completions": [
                {"text": text, "tokens": len(ids), "truncated": cut, "logprob": _finite(lp), "reward": None}
                for text, ids, cut, lp in zip(texts, completions.ids, completions.truncated, sums, strict=True)
            ],
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
            self._score(req, sample, texts, completions.ids, result)
        result["seconds"] = round(time.perf_counter() - tic, 3)
        return result

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
        req: dict[str, Any], sample: Any, texts: list[str], ids: list[list[int]], result: dict[str, Any]
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
    from .child import lower_priority

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
