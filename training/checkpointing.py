"""A run's checkpoints: what the trainer state of one holds, when one is written (every process takes part, the main
process writes), which ones ``save_total_limit`` keeps, and reading the newest back on resume. The files themselves
(folders, atomic writes, the safe unpickler) are training.checkpoint's."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .callbacks import CallbackList, CheckpointInfo
from .checkpoint import (
    checkpoint_dir,
    checkpoints_to_remove,
    folder_bytes,
    latest_checkpoint,
    list_checkpoints,
    load_model_weights,
    load_state,
    read_info,
    remove_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    shards_failed,
    staging_dir,
)
from .config import TrainSettings
from .generation_batch import GenerationBatch
from .sharded_checkpoint import SHARDS, check_manifest, is_sharded_checkpoint, load_shards
from .training_error import TrainingError


@dataclass
class TrainerState:
    """What ``trainer_state.pt`` holds besides each process's random state (``rng``), under these keys."""

    step: int
    micro: int  # micro-batches consumed (where the generation schedule stands)
    position: int  # prompts consumed from the seeded data order, all processes together
    num_tokens: float
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    buffer: GenerationBatch | None  # the generation batch still in use, if any
    world: int  # the number of processes (a run resumes with as many)
    ref_model: dict[str, torch.Tensor] | None  # a reference that sync_ref_model moved (else None)
    last_eval_step: int  # a resumed run never repeats a finished evaluation

    def to_dict(self) -> dict[str, Any]:
        """The state as the file stores it (these keys, in this order)."""
        return {
            "step": self.step,
            "micro": self.micro,
            "position": self.position,
            "num_tokens": self.num_tokens,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "buffer": self.buffer,
            "world": self.world,
            "ref_model": self.ref_model,
            "last_eval_step": self.last_eval_step,
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> TrainerState:
        """The state of a loaded file, including those written before a key existed."""
        return cls(
            step=state["step"],
            micro=state["micro"],
            position=state["position"],
            num_tokens=state["num_tokens"],
            optimizer=state["optimizer"],
            scheduler=state["scheduler"],
            buffer=state["buffer"],
            world=state["world"],
            ref_model=state.get("ref_model"),  # an older file may lack it: no moved reference
            last_eval_step=state.get("last_eval_step", -1),  # -1: written before evaluation existed
        )


class Checkpointer:
    """Saves and restores a run's checkpoints in ``out`` (None: the run keeps none).

    ``model``: the policy as the accelerator prepared it (its weights, or its LoRA adapter with ``uses_lora``, are
    what a checkpoint's ``model/`` holds, beside ``processor``); ``callbacks``: told of every checkpoint written and
    removed. ``record`` is the newest step's logged metrics, so a checkpoint of that step can record its
    ``metric_for_best_model`` value.
    """

    def __init__(
        self,
        out: Path | None,
        train: TrainSettings,
        accelerator: Any,
        model: Any,
        processor: Any,
        uses_lora: bool,
        callbacks: CallbackList,
        optimizer: Any = None,
        ref_model: Any = None,
        sharded: bool = False,
        state_dict_type: str = "sharded",
    ):
        self.out = out
        # a sharded run (FSDP2) writes shards of the weights and the optimizer state (training.sharded_checkpoint)
        self.sharded = sharded
        self.state_dict_type = state_dict_type  # "full": model/ holds the gathered weights too, beside the shards
        self.optimizer = optimizer
        self.ref_model = ref_model
        # resume loaded the weights, the optimizer state and any moved reference from a sharded checkpoint's shards
        self.from_shards = False
        self.train = train
        self.accelerator = accelerator
        self.model = model
        self.processor = processor
        self.uses_lora = uses_lora
        self.callbacks = callbacks
        self.saved_step: int | None = None  # the step whose state the newest checkpoint holds (None: moved on)
        self.record: tuple[int, dict[str, float]] = (-1, {})  # the newest step's logged metrics (for checkpoints)

    def note_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """The metrics logged for ``step``, added to those already logged for it (an evaluation of its own)."""
        last, logged = self.record
        self.record = (step, {**(logged if last == step else {}), **metrics})

    def moved_on(self) -> None:
        """The run's state changed since the newest checkpoint (a step, an evaluation): the next save writes."""
        self.saved_step = None

    def save_if_changed(self, step: int, state: Callable[[], TrainerState]) -> Path | None:
        """Save, unless the newest checkpoint already holds this very state (a cancel right after resuming)."""
        if self.saved_step == step:
            return None
        return self.save(step, state)

    def save(self, step: int, state: Callable[[], TrainerState]) -> Path | None:
        """Write the checkpoint of ``step`` (``state``: called on the writing process only); every process calls
        this, each one's random state goes in it. The folder written, on the main process."""
        from accelerate.utils import gather_object

        rngs = gather_object([rng_state()])
        if self.sharded:
            return self._save_sharded(step, state, rngs)
        path = None
        if self.accelerator.is_main_process and self.out is not None:
            unwrapped = self.accelerator.unwrap_model(self.model)
            kind = "adapter" if self.uses_lora else "full"
            metric = self._metric(step)
            saved = state().to_dict()
            path, size = save_checkpoint(self.out, step, unwrapped, self.processor, saved, rngs, kind, metric)
            value = read_info(path) or {}
            info = CheckpointInfo(step, str(path), kind, size, value.get("metric_value"))
            self.callbacks.on_checkpoint(step, str(path), info)
            self._apply_retention()
        self.saved_step = step
        self.accelerator.wait_for_everyone()
        return path

    def _save_sharded(self, step: int, state: Callable[[], TrainerState], rngs: list[Any]) -> Path | None:
        """Every process writes its shards into the staging folder, then the main process adds the model's config,
        the processor, the trainer state and the manifest, and renames it into place."""
        from .sharded_checkpoint import save_shards, write_manifest

        if self.out is None:
            return None
        main = self.accelerator.is_main_process
        if main:
            staging_dir(self.out, step)
        self.accelerator.wait_for_everyone()
        tmp = staging_dir(self.out, step, fresh=False)
        try:
            groups = save_shards(tmp, self.model, _torch_optimizer(self.optimizer), self.uses_lora, self.ref_model)
        except BaseException as exc:  # DCP gathers every process's write result: they all fail together
            failed = shards_failed(exc, checkpoint_dir(self.out, step))
            self._remove_staging(tmp, main)
            if failed is exc:
                raise
            raise failed from exc
        self.accelerator.wait_for_everyone()
        path = None
        if main:
            write_manifest(tmp, self.accelerator.num_processes)
            saved = {**state().to_dict(), "optimizer": {"param_groups": groups}, "ref_model": None}
            kind = "adapter" if self.uses_lora else "full"
            full = tmp if self.state_dict_type == "full" else None
            config_only = _ConfigOnly(self.accelerator.unwrap_model(self.model), self.uses_lora, full)
            path, size = save_checkpoint(
                self.out, step, config_only, self.processor, saved, rngs, kind, self._metric(step), staged=True
            )
            size += size_of_shards(path)
            value = read_info(path) or {}
            self.callbacks.on_checkpoint(
                step, str(path), CheckpointInfo(step, str(path), kind, size, value.get("metric_value"))
            )
            self._apply_retention()
        self.saved_step = step
        self.accelerator.wait_for_everyone()
        return path

    def _remove_staging(self, tmp: Path, main: bool) -> None:
        """After a failed write of the shards: once every process has judged the failure (a full disk is judged by
        the space the partial shards leave), the main process removes them. Every process is here (DCP failed on
        all of them together); a peer already gone makes the barrier fail, and the folder goes anyway."""
        try:
            self.accelerator.wait_for_everyone()
        except Exception:  # noqa: BLE001 - the failure being raised is the one to report
            pass
        if main:
            shutil.rmtree(tmp, ignore_errors=True)

    def _metric(self, step: int) -> tuple[str, float | None] | None:
        """``(metric_for_best_model, its value at this step)``; the value is None when the step did not log it (a
        cancel between evaluations, a step without a generation)."""
        name = self.train.metric_for_best_model
        if name is None:
            return None
        logged_step, metrics = self.record
        return name, metrics.get(name) if logged_step == step else None

    def _apply_retention(self) -> None:
        """``save_total_limit``: delete all but the newest checkpoints and the best (``metric_for_best_model``),
        counting those an earlier worker attempt wrote (linked into this attempt's folder)."""
        t = self.train
        if t.save_total_limit is None or self.out is None:
            return
        found = list_checkpoints(self.out)
        values = []
        for step, folder in found:
            info = read_info(folder) or {}
            same = info.get("metric") == t.metric_for_best_model and t.metric_for_best_model is not None
            values.append((step, info.get("metric_value") if same else None))
        doomed = set(checkpoints_to_remove(values, t.save_total_limit, t.best_is_greater))
        for step, folder in found:
            if step in doomed:
                removed = remove_checkpoint(folder)
                self.callbacks.on_checkpoint_removed(step, str(removed))

    def resume(self, world: int, rank: int) -> TrainerState:
        """Read the newest checkpoint back: the policy's weights are loaded into ``model`` and this process's random
        state is put back (``rank``); the trainer state is returned for the trainer to take up. ``world``: this
        run's number of processes, which must be the checkpoint's."""
        assert self.out is not None  # the trainer refuses resume without an output folder
        path = latest_checkpoint(self.out)
        if path is None:
            raise TrainingError(f"resume: no checkpoint in {self.out / 'checkpoints'}")
        saved = load_state(path)
        sharded = is_sharded_checkpoint(path)
        if sharded:
            # DCP reshards: another number of processes is fine, unless a generation batch is half used (each
            # process holds its own part of it)
            every = self.train.generation_steps * self.train.num_iterations
            if saved["world"] != world and saved["micro"] % every:
                raise TrainingError(
                    f"resume: the checkpoint at step {saved['step']} was written by {saved['world']} processes in "
                    f"the middle of a generation batch, which only {saved['world']} processes can take up; resume "
                    "with as many, or from a checkpoint at a generation boundary"
                )
            check_manifest(path)
            load_shards(path, self.model, _torch_optimizer(self.optimizer), saved["optimizer"]["param_groups"],
                        self.uses_lora, self.ref_model)  # fmt: skip
            self.from_shards = True
        else:
            if saved["world"] != world:
                raise TrainingError(f"resume: the checkpoint was written by {saved['world']} processes, not {world}")
            if self.sharded:
                raise TrainingError(
                    f"resume: {path} is a whole-model checkpoint of a run without resources.strategy: fsdp; resume "
                    "it with the strategy it was written with"
                )
            load_model_weights(self.accelerator.unwrap_model(self.model), path, self.uses_lora)
        state = TrainerState.from_dict(saved)
        self.saved_step = state.step
        name = self.train.metric_for_best_model
        info = read_info(path) or {}
        if name is not None and info.get("metric") == name and info.get("metric_value") is not None:
            self.record = (state.step, {name: info["metric_value"]})  # a save at this step keeps the checkpoint's value
        if rank < len(saved["rng"]):  # a process the checkpoint did not have keeps its own seeded state
            set_rng_state(saved["rng"][rank])
        return state


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under accelerate's wrapper (what DCP's state-dict helpers take)."""
    return getattr(optimizer, "optimizer", optimizer)


def size_of_shards(folder: Path) -> int:
    shards = folder / SHARDS
    return folder_bytes(shards) if shards.is_dir() else 0


class _ConfigOnly:
    """What a sharded checkpoint's ``model/`` holds: the model's config and generation config, or the LoRA
    adapter's config; the weights are in the shards beside it."""

    def __init__(self, model: Any, uses_lora: bool, full_from: Path | None):
        self.model = model
        self.uses_lora = uses_lora
        self.full_from = full_from  # resources.fsdp.state_dict_type full: the weights gathered from these shards too

    def save_pretrained(self, folder: Path) -> None:
        from .sharded_checkpoint import write_weights

        folder.mkdir(parents=True, exist_ok=True)
        if self.uses_lora:
            self.model.peft_config["default"].save_pretrained(str(folder))
        else:
            self.model.config.save_pretrained(str(folder))
            if getattr(self.model, "generation_config", None) is not None:
                self.model.generation_config.save_pretrained(str(folder))
        if self.full_from is not None:
            write_weights(self.full_from, folder)
