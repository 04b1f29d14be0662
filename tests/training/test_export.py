"""``training/export.py``, in-process: real checkpoints of Collage's trainer on a tiny model (full fine-tune and LoRA)
exported as plain transformers folders, loaded back with ``AutoModelForImageTextToText`` / ``AutoProcessor`` as a
user would, and run on a two-image prompt: the export's logits are the checkpoint's (merged LoRA within 1e-4 of the
adapter), the model sees the images, and it generates. Bad exports (an ``--out`` in use, a merge of a full model, a
link inside the checkpoint, a failure half way) leave nothing behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from collage.training.export import ExportError, export_checkpoint
from tests.support.checkpoints import checkpoint_model, fresh_dir, model_inputs, trained

BASE = "tiny:qwen2-vl"


def _load(folder: Path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return model, processor


@torch.no_grad()
def _logits(model, inputs) -> torch.Tensor:
    return model(**inputs).logits.float()


@pytest.fixture(scope="module")
def full_export():
    out = fresh_dir() / "full"
    result = export_checkpoint(trained("full") / "checkpoints" / "step-2", BASE, out)
    return out, result


@pytest.fixture(scope="module")
def adapter_exports():
    root = fresh_dir()
    checkpoint = trained("lora") / "checkpoints" / "step-2"
    adapter = export_checkpoint(checkpoint, BASE, root / "adapter")
    merged = export_checkpoint(checkpoint, BASE, root / "merged", merge_lora=True)
    return adapter, merged


def test_a_full_checkpoint_exports_as_a_folder_that_loads_sees_its_images_and_generates(full_export):
    out, result = full_export
    assert result.kind == "full" and not result.merged and result.path == out
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "chat_template.jinja",
            "processor_config.json", "tokenizer.json"} <= names, names  # fmt: skip
    assert result.bytes == sum(p.stat().st_size for p in out.iterdir())
    model, processor = _load(out)
    assert processor.image_processor is not None and processor.chat_template
    inputs = model_inputs(processor)
    assert int(inputs["image_grid_thw"].shape[0]) == 2  # both images reach the model
    exported = _logits(model, inputs)
    expected = _logits(checkpoint_model("full", trained("full") / "checkpoints" / "step-2"), inputs)
    assert torch.equal(exported, expected)  # the checkpoint's weights, unchanged
    # the model sees its images: other pictures, other logits
    assert not torch.allclose(_logits(model, model_inputs(processor, seed=1)), exported)
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > inputs["input_ids"].shape[1]


def test_a_lora_adapter_exports_for_peft_and_merged_and_both_give_the_checkpoints_logits(adapter_exports):
    adapter, merged = adapter_exports
    assert adapter.kind == "adapter" and not adapter.merged and merged.merged
    adapter_names = {p.name for p in adapter.path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "generation_config.json", "chat_template.jinja",
            "tokenizer.json"} <= adapter_names  # fmt: skip
    assert "config.json" not in adapter_names  # else transformers would take the folder for a whole model
    config = json.loads((adapter.path / "adapter_config.json").read_text())
    from collage.training.models.loading import resolve_model_path

    assert config["base_model_name_or_path"] == str(Path(resolve_model_path(BASE)).resolve())
    merged_names = {p.name for p in merged.path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "chat_template.jinja"} <= merged_names
    assert not merged_names & {"adapter_config.json", "adapter_model.safetensors"}

    from_adapter, processor = _load(adapter.path)  # transformers + peft: the base, then the adapter
    from_merged, _ = _load(merged.path)
    inputs = model_inputs(processor)
    checkpoint = _logits(checkpoint_model("lora", trained("lora") / "checkpoints" / "step-2"), inputs)
    via_adapter, via_merged = _logits(from_adapter, inputs), _logits(from_merged, inputs)
    assert torch.allclose(via_adapter, checkpoint, atol=1e-5, rtol=0)
    assert (via_merged - via_adapter).abs().max().item() < 1e-4
    # the adapter was trained (its logits are not the base model's), so the merge had something to merge
    base, _ = _load(Path(resolve_model_path(BASE)))
    assert (_logits(base, inputs) - via_merged).abs().max().item() > 1e-3
    assert not torch.allclose(_logits(from_merged, model_inputs(processor, seed=1)), via_merged)
    generated = from_merged.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > inputs["input_ids"].shape[1]


def test_an_out_folder_in_use_is_refused_and_an_empty_one_is_taken(tmp_path):
    checkpoint = trained("full") / "checkpoints" / "step-1"
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_checkpoint(checkpoint, BASE, used)
    assert [p.name for p in used.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_checkpoint(checkpoint, BASE, empty).path == empty and (empty / "config.json").is_file()


def test_a_link_inside_a_checkpoint_is_refused_and_nothing_is_copied(tmp_path):
    import shutil

    checkpoint = tmp_path / "step-1"
    shutil.copytree(trained("full") / "checkpoints" / "step-1", checkpoint)
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the checkpoint")
    os.symlink(secret, checkpoint / "model" / "notes.txt")
    with pytest.raises(ExportError, match="notes.txt is a symbolic link"):
        export_checkpoint(checkpoint, BASE, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_export_stopped_half_way_leaves_nothing(tmp_path):
    class Stop(Exception):
        pass

    seen = []

    def progress(fraction, message):
        seen.append(message)
        if fraction >= 0.5:
            raise Stop

    with pytest.raises(Stop):
        export_checkpoint(trained("lora") / "checkpoints" / "step-1", BASE, tmp_path / "out", True, progress)
    assert "saving the merged model" in seen
    assert list(tmp_path.iterdir()) == []  # neither the export nor its temporary folder


def test_merging_a_full_checkpoint_is_refused(tmp_path):
    with pytest.raises(ExportError, match="no LoRA adapter to merge"):
        export_checkpoint(trained("full") / "checkpoints" / "step-1", BASE, tmp_path / "out", merge_lora=True)
    assert not (tmp_path / "out").exists()
