"""Tiny VLMs, in-process: built offline, reloaded through the Auto classes, chat templates render images the family's
way, no all-zero weights between the pixels and the logits (the model sees its images), generation stops at the end
of a turn; ``tiny:`` models built once and cached, and a processor without its image processor refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from PIL import Image, ImageOps
from transformers import AutoModelForImageTextToText, AutoProcessor

from collage.training.modeling import is_vision_param
from collage.training.models.families import TINY_FAMILIES, family_for_model_type
from collage.training.models.loading import ProcessorError, check_processor, load_processor, resolve_model_path
from collage.training.models.tiny import build_tiny
from tests.support.canary import CANARY_MARGIN

IMAGE_MARKUP = {
    "qwen2-vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2.5-vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "llava": "<image>",
    "idefics3": "<image>",
    "qwen3-vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
    "llava-onevision": "<image>",
    "internvl": "<IMG_CONTEXT>",
    "smolvlm": "<image>",
}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_build_reload_and_run(family, tmp_path):
    out = build_tiny(family, tmp_path / family)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    processor = AutoProcessor.from_pretrained(out)
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert processor.image_processor is not None
    assert family_for_model_type(model.config.model_type).name == family
    # no weight matrix, embedding or token between the pixels and the language model is left all zeros (biases and
    # Gemma's 1-centred norm weights are zeros by design; transformers zero-initialises Gemma 3's projection and
    # InternViT's class token and position embeddings, which a real checkpoint loads)
    zeros = [n for n, p in model.named_parameters() if is_vision_param(n) and p.dim() >= 2 and not p.any()]
    assert not zeros, f"{family}: all-zero vision-side weights {zeros}"

    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "Which is red?"}, {"type": "image"}],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count(IMAGE_MARKUP[family]) == 2
    assert text.index("Which is red?") > text.index(IMAGE_MARKUP[family])  # images stay where the parts put them

    images = [Image.new("RGB", (56, 56), (200, 20, 20)), Image.new("RGB", (56, 56), (20, 20, 200))]
    enc = processor(text=[text], images=[images], return_tensors="pt")
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    per_image = int((enc["input_ids"] == image_id).sum()) // 2
    if model.config.model_type in ("idefics3", "smolvlm"):
        # the shipped default splits every image: 4x4 crops of the 4x-upscaled image + the global view, one
        # token each in the tiny tower, and the pixel tensor holds every tile
        assert per_image == 17 and enc["pixel_values"].shape[1] == 2 * 17, (per_image, enc["pixel_values"].shape)
    elif model.config.model_type == "qwen3_vl":
        # the shipped min_pixels (65536) upscales a 56x56 image to 256x256: 16x16 patches of 16 px -> 64 tokens
        assert per_image == 64, per_image
    else:
        assert 1 <= per_image <= 8, f"a 56x56 image should cost a handful of tokens, got {per_image}"
    with torch.no_grad():
        logits = model(**enc).logits
    assert torch.isfinite(logits).all()
    # the model sees its images: each one's colour negative (same sizes, so the same tokens) moves the next-token
    # logits; a builder that leaves a zero weight on the path from pixels to logits (transformers initialises Gemma
    # 3's projection so) makes a blind model that passes every equality test
    for k in range(2):
        other = list(images)
        other[k] = ImageOps.invert(images[k])
        moved = processor(text=[text], images=[other], return_tensors="pt")
        assert torch.equal(moved["input_ids"], enc["input_ids"])
        with torch.no_grad():
            shift = (model(**moved).logits[0, -1] - logits[0, -1]).abs().max().item()
        assert shift > CANARY_MARGIN, f"{family}: image {k} repainted moves the logits by {shift:.2e} only"
    generated = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > enc["input_ids"].shape[1]
    # the generation config stops on the chat template's end-of-turn token
    eos = model.generation_config.eos_token_id
    assert (
        eos is not None and processor.tokenizer.convert_ids_to_tokens(eos) in text + "</s><|im_end|><end_of_utterance>"
    )


def test_tiny_prefix_builds_once_and_caches(tiny_model_dir):
    first = resolve_model_path("tiny:llava")
    stamp = (tiny_model_dir("llava") / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("tiny:llava") == first
    assert (tiny_model_dir("llava") / "model.safetensors").stat().st_mtime_ns == stamp


def test_processor_without_image_processor_is_refused(tiny_model_dir, tmp_path):
    """AutoProcessor quietly returns a bare tokenizer when it cannot find a processor: Collage must refuse it."""
    src = tiny_model_dir("qwen2-vl")
    folder = tmp_path / "tokenizer-only"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, folder / name)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("processor_class", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    bare = AutoProcessor.from_pretrained(folder)
    assert getattr(bare, "image_processor", None) is None  # the silent trap itself
    with pytest.raises(ProcessorError, match="no image processor"):
        check_processor(bare, str(folder))


def test_model_folder_missing_its_image_processor_is_refused(tiny_model_dir, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_dir("qwen2-vl"), folder)
    (folder / "processor_config.json").unlink()
    with pytest.raises(ProcessorError, match="broken"):
        load_processor(str(folder))


def test_a_model_whose_chat_template_never_ends_makes_its_rows_unusable_naming_the_bound(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A model folder (or hub id) brings its chat template: one that loops for ever is stopped by Collage's bound
    on a rendering, through the real processor's apply_chat_template, as a row error the check and the trainer
    report."""
    import shutil

    from collage.training import templates
    from collage.training.batching.encoding import PromptEncoder
    from collage.training.data.errors import RowError
    from collage.training.data.rows import Sample
    from collage.training.models.loading import load_processor

    folder = tmp_path / "looping"
    shutil.copytree(tiny_model_dir("qwen2-vl"), folder)
    (folder / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
    )
    monkeypatch.setattr(templates, "RENDER_SECONDS", 0.5)
    processor, family = load_processor(str(folder))
    encoder = PromptEncoder(processor, family)
    sample = Sample(row=7, prompt=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], images=[])
    with pytest.raises(RowError, match=r"row 7: the model's chat template ran for more than"):
        encoder.render(sample)
