"""FSDP2 for a run's policy and reference: which modules become their own shard group, and gathering the full
weights once for the passes that call parts of the model directly (generation, the vision cache, no-grad log-probs).

The wrap rule is accelerate's FSDP2 auto-wrap by transformer blocks (``fsdp_auto_wrap_policy:
TRANSFORMER_BASED_WRAP`` with no class list): every class the model names in ``_no_split_modules`` and actually
instantiates (each family's decoder layer and vision block), bottom-up, then the root. Collage applies torch's
``fully_shard`` itself rather than through ``Accelerator(fsdp_plugin=...)`` because accelerate only enables FSDP for
GPU-type runs (a CPU run with gloo silently stays plain DDP), and one code path is what the CPU tests can hold to.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ShardPlan:
    """How a model was sharded: the block classes that became their own groups, and how many modules of each."""

    classes: dict[str, int]
    reshard_after_forward: bool
    cpu_offload: bool


def block_classes(model: torch.nn.Module) -> list[type]:
    """The module classes FSDP2 shards one by one: those the model's ``_no_split_modules`` names (through a PEFT
    wrapper too) that this model instantiates, found per family rather than listed per checkpoint."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    found: dict[str, type] = {}
    for module in model.modules():
        if type(module).__name__ in names:
            found.setdefault(type(module).__name__, type(module))
    return list(found.values())


def shard(model: torch.nn.Module, reshard_after_forward: bool, cpu_offload: bool, device: Any) -> ShardPlan:
    """Apply FSDP2 in place: each block of :func:`block_classes` is a shard group, the rest belongs to the root's.
    Parameters are sharded over every process of the default group (a 1-D mesh on ``device``'s type); a model still
    on the CPU has each process's shards moved to its device (so no process holds the whole model there)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    world = torch.distributed.get_world_size()
    kind = torch.device(device).type
    mesh = init_device_mesh(kind, (world,))
    cpu_offload = cpu_offload and kind != "cpu"  # a CPU run already keeps everything in CPU memory
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    classes = tuple(block_classes(model))
    counts: dict[str, int] = {}
    for module in reversed(list(model.modules())):  # bottom-up: a nested block is sharded before its parent
        if module is not model and isinstance(module, classes):
            name = type(module).__name__  # before fully_shard swaps the class for its FSDP subclass
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload)
            counts[name] = counts.get(name, 0) + 1
    # the root keeps its own parameters (embeddings, norms, LM head, projector) gathered between forward and
    # backward: they are needed at both ends of the pass, so resharding them would only gather them again
    fully_shard(model, mesh=mesh, reshard_after_forward=False, offload_policy=offload)
    # FSDP2 settles which module is the root at the first forward through it; the vision cache calls the tower
    # directly before any forward of the whole model, which would make each vision block a root of its own
    model._get_fsdp_state()._lazy_init()  # type: ignore[operator]  # private, idempotent; no public equivalent
    model._collage_reshard = reshard_after_forward  # type: ignore[assignment]  # what gathered() puts back
    return ShardPlan(counts, reshard_after_forward, cpu_offload)


def broadcast_from_first(params: list[torch.nn.Parameter], device: Any) -> None:
    """Give every process the first process's values of ``params`` (in place). FSDP2 shards each process's own
    copy, so parameters created at random at start-up (LoRA's adapters: each process seeds its own generator)
    must agree before sharding, as DDP makes them agree at wrapping. Through ``device``: NCCL moves only GPU
    tensors."""
    for param in params:
        moved = param.data.to(device)
        torch.distributed.broadcast(moved, src=0)
        param.data.copy_(moved)


def is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _fsdp_modules(model: Any) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered(model: Any) -> Iterator[None]:
    """The model's full weights on every process for the duration: one all-gather per shard group on entry, none
    per forward inside (a decoding loop would otherwise gather every layer for every token), resharded on exit.
    Costs the full (unsharded) parameters for that time. A no-op for an unsharded model and when already inside."""
    modules = _fsdp_modules(model) if model is not None else []
    root = modules[0] if modules else None  # modules() is pre-order: the outermost shard group is the root
    if root is None or getattr(root, "_collage_gathered", False):  # (on the root: a wrapper may differ)
        yield
        return
    reshard = getattr(root, "_collage_reshard", True)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    handles = [module.unshard(async_op=True) for module in modules]
    for handle in handles:
        if handle is not None:
            handle.wait()
    root._collage_gathered = True
    try:
        yield
    finally:
        root._collage_gathered = False
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(reshard if module is not root else False, recurse=False)


def full_grad_norm(norm: Any) -> torch.Tensor:
    """A gradient norm as a plain tensor (a sharded model's ``clip_grad_norm_`` returns a DTensor)."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm
