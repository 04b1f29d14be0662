"""FSDP2's parts in one process (a one-rank gloo group on a file store): which blocks each family shards, the
full weights gathered once for a whole generation (not per decoded token), sharded checkpoints that consolidate
back into the model, and the weights-only reading of their files (a pickle in the metadata, a non-tensor item, a
missing shard). The two-rank behaviour (DDP parity, resume, the worker path) is tests/processes/test_fsdp.py's."""

from __future__ import annotations

import copy
import io
import os
import pickle

import pytest
import torch
import torch.distributed as dist

from collage.app.store.checkpoints import SHARDS as STORE_SHARDS
from collage.training.checkpoint import CheckpointRefused
from collage.training.config import parse_config
from collage.training.infra.errors import InputError
from collage.training.models.loading import load_model
from collage.training.sharded_checkpoint import (
    SHARDS,
    check_manifest,
    consolidate,
    load_shards,
    save_shards,
    with_weights,
    write_manifest,
)
from collage.training.sharding import block_classes, gathered, shard
from tests.support.training import make_config


@pytest.fixture
def one_rank(tmp_path):
    """A one-process gloo group for FSDP2 to shard over (nothing to shard across, but every hook and collective
    runs as with more ranks)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("tiny:qwen2-vl", {"Qwen2VLDecoderLayer", "Qwen2VLVisionBlock"}),
        ("tiny:idefics3", {"LlamaDecoderLayer", "Idefics3VisionAttention"}),  # what Idefics3 names
        ("tiny:gemma3", {"Gemma3DecoderLayer", "SiglipEncoderLayer"}),
    ],
)
def test_the_blocks_sharded_are_those_each_family_names_in_no_split_modules(path, expected):
    """accelerate's transformer-based wrap with no class list: the decoder layers and the vision blocks (or what
    the family names instead), found on the model rather than listed per checkpoint."""
    model = load_model(path, "float32")
    classes = {c.__name__ for c in block_classes(model)}
    assert expected <= classes, classes
    named = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    assert classes <= named
    assert not classes & {"Qwen2VLForConditionalGeneration", "Embedding", "Linear"}


def _count_gathers(monkeypatch) -> list[int]:
    """Counts FSDP2's gathers: each time a shard group that is sharded is unsharded (with more ranks, one
    all-gather; on one rank FSDP2 skips the collective but goes through the same step)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    calls = [0]
    real = FSDPParamGroup.unshard

    def counting(self, *args, **kwargs):
        if not self.is_unsharded and self._all_gather_result is None:
            calls[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FSDPParamGroup, "unshard", counting)
    return calls


def _prompt(processor):
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many red?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(text=[text], images=[[Image.new("RGB", (56, 56), (220, 20, 20))]], return_tensors="pt")


def test_a_generation_gathers_each_shard_group_once_and_decodes_as_the_whole_model(one_rank, monkeypatch):
    from collage.training.models.loading import load_processor

    processor, _ = load_processor("tiny:qwen2-vl")
    whole = load_model("tiny:qwen2-vl", "float32").eval()
    sharded = copy.deepcopy(whole)
    plan = shard(sharded, reshard_after_forward=True, cpu_offload=False, device="cpu")
    groups = sum(plan.classes.values()) + 1  # each block, and the root's own parameters
    inputs = _prompt(processor)
    gathers = _count_gathers(monkeypatch)
    with torch.no_grad():
        expected = whole.generate(**inputs, max_new_tokens=8, do_sample=False, synced_gpus=False)
        with gathered(sharded):
            got = sharded.generate(**inputs, max_new_tokens=8, do_sample=False, synced_gpus=False)
    assert torch.equal(expected, got)
    assert gathers[0] == groups, "one all-gather per shard group for the whole generation"
    gathers[0] = 0
    with torch.no_grad():
        sharded(**inputs)  # a forward of its own (training's): each block gathers as it runs
    assert gathers[0] >= groups - 1


def test_a_sharded_checkpoint_consolidates_into_the_model_it_was_written_from(one_rank, tmp_path):
    model = load_model("tiny:qwen2-vl", "float32")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    shard(model, reshard_after_forward=True, cpu_offload=False, device="cpu")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    folder = tmp_path / "step-1"
    groups = save_shards(folder, model, optimizer, adapter_only=False)
    write_manifest(folder, 1)
    model.config.save_pretrained(folder / "model")
    consolidate(folder, tmp_path / "plain")
    from transformers import AutoModelForImageTextToText

    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "plain").state_dict()
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert with_weights(folder / "model", tmp_path / "scratch") == tmp_path / "scratch" / "model"
    assert STORE_SHARDS == SHARDS  # the web tier (no torch) tells a sharded checkpoint by the same folder name
    # and back into a fresh, unsharded model and optimizer (resume on one process)
    again = load_model("tiny:qwen2-vl", "float32")
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    fresh = torch.optim.AdamW([p for p in again.parameters() if p.requires_grad], lr=1e-3)
    load_shards(folder, again, fresh, groups, adapter_only=False)
    assert all(torch.equal(again.state_dict()[k], expected[k]) for k in expected)


def _written(tmp_path):
    from torch.distributed.checkpoint import FileSystemWriter, save

    folder = tmp_path / "ckpt"
    save({"model": {"w": torch.ones(3)}}, storage_writer=FileSystemWriter(str(folder / "shards")), no_dist=True)
    write_manifest(folder, 1)
    (folder / "model").mkdir()
    return folder


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/collage-owned",))


def test_shards_whose_metadata_names_anything_else_are_refused_before_it_runs(tmp_path):
    folder = _written(tmp_path)
    (folder / "shards" / ".metadata").write_bytes(pickle.dumps(_Boom()))
    write_manifest(folder, 1)
    with pytest.raises(CheckpointRefused, match="posix.system|os.system"):
        consolidate(folder, tmp_path / "out")
    assert not os.path.exists("/tmp/collage-owned")


def test_a_non_tensor_item_in_the_shards_is_refused_not_unpickled(tmp_path):
    from torch.distributed.checkpoint import FileSystemWriter, save

    folder = tmp_path / "ckpt"
    save({"model": {"w": torch.ones(3), "note": io.BytesIO(b"x")}}, storage_writer=FileSystemWriter(str(folder / "shards")),
         no_dist=True)  # fmt: skip
    write_manifest(folder, 1)
    with pytest.raises(CheckpointRefused, match="model.note"):
        from collage.training.sharded_checkpoint import _load

        _load({"model": {"w": torch.empty(3), "note": io.BytesIO()}}, folder / "shards", alone=True)


def test_a_shard_missing_or_cut_short_is_named_before_loading(tmp_path):
    folder = _written(tmp_path)
    shard_file = next((folder / "shards").glob("*.distcp"))
    shard_file.write_bytes(shard_file.read_bytes()[:-1])
    with pytest.raises(InputError, match=shard_file.name):
        check_manifest(folder)
    shard_file.unlink()
    with pytest.raises(InputError, match="missing or different"):
        check_manifest(folder)
    (folder / "shards.json").unlink()
    with pytest.raises(InputError, match="needs its manifest"):
        check_manifest(folder)


def test_strategy_and_fsdp_settings_parse_and_default_to_ddp():
    config = make_config(resources={"gpus": 0, "processes": 2, "strategy": "fsdp",
                                    "fsdp": {"reshard_after_forward": False, "state_dict_type": "full"}})  # fmt: skip
    r = config.resources
    assert r.sharded and not r.fsdp.reshard_after_forward and r.fsdp.state_dict_type == "full"
    assert not r.fsdp.cpu_offload
    assert not make_config().resources.sharded  # ddp by default
    assert not make_config(resources={"gpus": 0, "strategy": "fsdp"}).resources.sharded  # one process ignores it
    with pytest.raises(ValueError, match="state_dict_type"):
        parse_config({**make_config().model_dump(mode="json"), "resources": {"fsdp": {"state_dict_type": "half"}}})
