"""Qwen3-VL, Gemma 3, LLaVA-OneVision, InternVL and SmolVLM as tiny models in-process: each built through `collage
models build-tiny` with its processor's shipped defaults, fed by the batch path exactly what its own processor
feeds the model (its family extras from the padded batch), and Gemma 3's pan-and-scan crops kept with their row.

The mixed-batch equality (a row inside a shuffled batch of 0..5-image rows of different sizes = the row alone) runs
for these families in tests/training/test_batching.py, which is parametrized over every tiny family.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from PIL import Image

from collage.app.cli.main import main as cli
from collage.training.batching.batch import collate
from collage.training.batching.encoding import PromptEncoder
from collage.training.batching.forward import forward_kwargs
from collage.training.batching.logprobs import completion_logprobs
from collage.training.data.rows import Sample
from collage.training.models.families import FAMILIES, family_for_model_type
from collage.training.models.loading import load_processor
from tests.support.canary import assert_only_rows_move, most_images, repaint

NEW_FAMILIES = ("qwen3-vl", "gemma3", "llava-onevision", "internvl", "smolvlm")


TOL = 1e-5


# what `AutoProcessor` / `AutoModelForImageTextToText` must give back: the families' real classes
CLASSES = {
    "qwen3-vl": ("Qwen3VLProcessor", "Qwen2VLImageProcessor", "Qwen3VLForConditionalGeneration"),
    "gemma3": ("Gemma3Processor", "Gemma3ImageProcessor", "Gemma3ForConditionalGeneration"),
    "llava-onevision": (
        "LlavaOnevisionProcessor",
        "LlavaOnevisionImageProcessor",
        "LlavaOnevisionForConditionalGeneration",
    ),
    "internvl": ("InternVLProcessor", "GotOcr2ImageProcessor", "InternVLForConditionalGeneration"),
    "smolvlm": ("SmolVLMProcessor", "SmolVLMImageProcessor", "SmolVLMForConditionalGeneration"),
}


# how the family's chat template writes one image part
IMAGE_MARKUP = {
    "qwen3-vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
    "llava-onevision": "<image>",
    "internvl": "<IMG_CONTEXT>\n",
    "smolvlm": "<image>",
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each family built once through the CLI, ``collage models build-tiny FAMILY --out DIR``."""
    folders: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in folders:
            out = tmp_path_factory.mktemp("built") / family
            assert cli(["models", "build-tiny", family, "--out", str(out)]) == 0
            folders[family] = out
        return folders[family]

    return get


def _image(width: int, height: int, color=(200, 30, 30)) -> Image.Image:
    return Image.new("RGB", (width, height), color)


def _one_image_prompt(processor, image: Image.Image):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which is red?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=[[image]], return_tensors="pt")


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_build_tiny_through_the_cli_and_reload(family, built, capsys):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = built(family)
    assert f"built tiny {family} model in {out}" in capsys.readouterr().out
    processor = AutoProcessor.from_pretrained(out)
    model = AutoModelForImageTextToText.from_pretrained(out)
    classes = (type(processor).__name__, type(processor.image_processor).__name__, type(model).__name__)
    assert classes == CLASSES[family]
    assert family_for_model_type(model.config.model_type).name == family
    checked, fam = load_processor(str(out))  # Collage's own loader accepts it (image processor + tokenizer)
    assert fam is FAMILIES[family] and checked.image_processor is not None

    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which is red?"}, {"type": "image"}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count(IMAGE_MARKUP[family]) == 2
    images = [_image(56, 56), _image(84, 56, (20, 20, 200))]
    enc = processor(text=[text], images=[images], return_tensors="pt")
    vocab = processor.tokenizer.get_vocab()
    assert all(t in vocab for t in fam.vision_tokens), "every vision token of the family is one token"
    assert int((enc["input_ids"] == vocab[fam.image_token]).sum()) > 0
    with torch.no_grad():
        assert torch.isfinite(model(**enc).logits).all()
    eos = model.generation_config.eos_token_id
    assert processor.tokenizer.convert_ids_to_tokens(eos) in text  # stops on the template's end of turn


def test_qwen3_vl_keeps_the_shipped_min_and_max_pixels(built):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(built("qwen3-vl"))
    ip = processor.image_processor
    assert ip.size == {"shortest_edge": 65536, "longest_edge": 16777216}  # 256x256 .. 4096x4096 pixels
    assert (ip.patch_size, ip.temporal_patch_size, ip.merge_size) == (16, 2, 2)
    assert list(ip.image_mean) == [0.5] * 3 and list(ip.image_std) == [0.5] * 3
    assert processor.video_processor.size == {"shortest_edge": 4096, "longest_edge": 25165824}
    # a small image is upscaled to the 65536-pixel minimum: 256x256 -> 16x16 patches -> 64 tokens
    small = _one_image_prompt(processor, _image(56, 56))
    assert small["image_grid_thw"].tolist() == [[1, 16, 16]]
    assert int((small["input_ids"] == processor.image_token_id).sum()) == 64
    # a 640x480 photo keeps its size (far below the maximum): 40x30 patches
    assert _one_image_prompt(processor, _image(640, 480))["image_grid_thw"].tolist() == [[1, 30, 40]]


def test_gemma3_pan_and_scan_is_off_as_shipped_and_works_when_asked(built):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(built("gemma3"))
    ip = processor.image_processor
    # shipped preprocessor_config.json leaves pan-and-scan null: the processor's own defaults decide
    assert ip.do_pan_and_scan is None and ip.pan_and_scan_min_crop_size is None
    assert processor.images_kwargs == {
        "do_convert_rgb": True,
        "do_pan_and_scan": False,
        "pan_and_scan_min_crop_size": 256,
        "pan_and_scan_max_num_crops": 4,
        "pan_and_scan_min_ratio_to_activate": 1.2,
    }
    assert ip.resample == 2 and list(ip.image_mean) == [0.5] * 3  # bilinear, mean/std 0.5
    assert ip.size == {"height": 224, "width": 224}  # shipped 896: reduced for CPU (docs/models.md)
    wide = _image(900, 300)
    assert _one_image_prompt(processor, wide)["pixel_values"].shape[0] == 1  # off: the image alone
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which is red?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    crops = processor(text=[text], images=[[wide]], return_tensors="pt", do_pan_and_scan=True)
    assert crops["pixel_values"].shape[0] == 4  # the image + 3 crops of 300x300 (>= the 256 minimum)
    soft = processor.tokenizer.image_token_id
    assert int((crops["input_ids"] == soft).sum()) == 4 * processor.image_seq_length


def test_llava_onevision_gives_a_variable_number_of_anyres_patches(built):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(built("llava-onevision"))
    ip = processor.image_processor
    tile = ip.size["height"]
    # the shipped grid: every (rows, cols) of 1..6 tiles; padding on; anyres_max_9; SigLIP features in full
    assert sorted(map(tuple, ip.image_grid_pinpoints)) == [
        (tile * r, tile * c) for r in range(1, 7) for c in range(1, 7)
    ]
    assert ip.do_pad and processor.vision_aspect_ratio == "anyres_max_9"
    assert processor.vision_feature_select_strategy == "full"
    patches = {
        size: _one_image_prompt(processor, _image(*size))["pixel_values"].shape[1]
        for size in [(28, 28), (56, 56), (112, 56), (200, 60)]
    }
    # the base view + a grid of tiles chosen from the pinpoints by the image's size and aspect ratio
    assert patches == {(28, 28): 2, (56, 56): 5, (112, 56): 9, (200, 60): 13}
    # several images in one row: the base view of each only (the model is told through batch_num_images)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    two = processor(text=[text], images=[[_image(200, 60), _image(56, 56)]], return_tensors="pt")
    assert two["batch_num_images"].tolist() == [2]
    assert int((two["input_ids"] == processor.image_token_id).sum()) == 2 * (processor.num_image_tokens + 1)


def test_internvl_tiles_images_as_shipped(built):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(built("internvl"))
    ip = processor.image_processor
    assert ip.crop_to_patches and (ip.min_patches, ip.max_patches) == (1, 12)
    assert list(ip.image_mean) == [0.485, 0.456, 0.406] and ip.resample == 3  # ImageNet mean/std, bicubic
    tiles = {
        size: _one_image_prompt(processor, _image(*size))["pixel_values"].shape[0]
        for size in [(28, 28), (56, 56), (112, 56), (200, 60)]
    }
    # one tile when the image fits one; else a grid of up to 12 tiles plus a thumbnail of the whole image
    assert tiles == {(28, 28): 1, (56, 56): 5, (112, 56): 9, (200, 60): 13}


def test_smolvlm_splits_images_as_shipped(built):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(built("smolvlm"))
    ip = processor.image_processor
    assert ip.do_image_splitting and ip.do_pad
    assert ip.size["longest_edge"] == 4 * ip.max_image_size["longest_edge"]  # shipped: 2048 for 512 px tiles
    assert list(ip.image_mean) == [0.5] * 3 and ip.resample == 1  # Lanczos
    tiles = {
        size: _one_image_prompt(processor, _image(*size))["pixel_values"].shape[1]
        for size in [(28, 28), (56, 56), (112, 56)]
    }
    # every image is resized to a longest edge of 4 tiles, cut into crops, and a global view is added
    assert tiles == {(28, 28): 17, (56, 56): 17, (112, 56): 9}


def _varied_samples(seed: int, counts=(0, 3, 1, 0, 2, 1), sizes=((28, 28), (56, 56), (112, 56), (60, 150))):
    rng = random.Random(seed)
    samples = []
    for row, n in enumerate(counts):
        images = [_image(*rng.choice(sizes), color=tuple(rng.randrange(256) for _ in range(3))) for _ in range(n)]
        content = [{"type": "image"} for _ in range(n)] + [{"type": "text", "text": "How many are red?"}]
        samples.append(Sample(row, [{"role": "user", "content": content}], images))
    return samples


def _processor_logprobs(model, processor, sample: Sample, completion: list[int]) -> torch.Tensor:
    """The completion's log-probs with the model called on its own processor's output, as its model card does."""
    text = processor.apply_chat_template(sample.prompt, add_generation_prompt=True, tokenize=False)
    kwargs = {"text": [text], "return_tensors": "pt"}
    if sample.images:
        kwargs["images"] = [list(sample.images)]
    enc = dict(processor(**kwargs))
    n = enc["input_ids"].shape[1]
    comp = torch.tensor([completion])
    enc["input_ids"] = torch.cat([enc["input_ids"], comp], dim=1)
    enc["attention_mask"] = torch.cat([enc["attention_mask"], torch.ones_like(comp)], dim=1)
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key in enc:
            enc[key] = torch.cat([enc[key], torch.zeros_like(comp)], dim=1)
    logits = model(**enc).logits[0, n - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, comp[0].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_the_batch_path_feeds_the_model_what_its_processor_does(tiny, family):
    """Collage's forward (its pixels re-joined, its family extras: Gemma 3's token_type_ids, LLaVA-OneVision's
    batch_num_images) gives the same log-probs as the model on its own processor's output, row by row."""
    model, processor, fam = tiny(family)
    encoder = PromptEncoder(processor, fam)
    pad = processor.tokenizer.pad_token_id
    completion = [70, 71, 72, 73]

    def both(sample):
        want = _processor_logprobs(model, processor, sample, completion)
        batch = collate([encoder.encode(sample)], fam, pad, [completion])
        with torch.no_grad():
            got = completion_logprobs(model, batch, fam, encoder.image_token_id)[0]
        assert (got - want).abs().max().item() <= TOL, (family, sample.num_images)
        return got

    samples = _varied_samples(3)
    for sample in samples:
        both(sample)
    # the canary: the same equality with the middle image of the 3-image row repainted, which moves its log-probs
    k = most_images(samples)
    assert samples[k].num_images == 3
    before, after = both(samples[k]), both(repaint(samples[k], image=1))
    assert_only_rows_move(before[None], after[None], torch.ones_like(before[None]), [0], family)


@pytest.mark.parametrize("family", ["gemma3", "llava-onevision"])
def test_family_extras_come_from_the_padded_batch(tiny, family):
    model, processor, fam = tiny(family)
    encoder = PromptEncoder(processor, fam)
    samples = _varied_samples(4)
    prompts = [encoder.encode(s) for s in samples]
    batch = collate(prompts, fam, processor.tokenizer.pad_token_id, [[70]] * len(prompts))
    kwargs = forward_kwargs(batch, fam, encoder.image_token_id)
    if family == "gemma3":
        # 1 exactly on image soft tokens, wherever left padding put them
        assert torch.equal(kwargs["token_type_ids"], (batch.input_ids == encoder.image_token_id).long())
    else:
        assert kwargs["batch_num_images"].tolist() == [s.num_images for s in samples]
        text_only = collate([p for p in prompts if not p.num_images], fam, processor.tokenizer.pad_token_id)
        assert "batch_num_images" not in forward_kwargs(text_only, fam, encoder.image_token_id)


class _PanAndScan:
    """The tiny Gemma 3 processor with pan-and-scan on (transformers 5 takes it per call, not from the config)."""

    def __init__(self, processor):
        self._processor = processor

    def __getattr__(self, name):
        return getattr(self._processor, name)

    def __call__(self, *args, **kwargs):
        return self._processor(*args, do_pan_and_scan=True, **kwargs)


def test_gemma3_pan_and_scan_crops_stay_with_their_row(tiny):
    """With pan-and-scan, a Gemma 3 image brings crops: pixel_values counts crops, not images. A row's log-probs
    inside a shuffled mixed batch, and in micro-batches cut from it, equal the row alone."""
    model, processor, fam = tiny("gemma3")
    encoder = PromptEncoder(_PanAndScan(processor), fam)
    sizes = [[], [(900, 300)], [(600, 280), (300, 300)], [], [(280, 800), (900, 300), (300, 300)], [(56, 56)]]
    samples = []
    for row, row_sizes in enumerate(sizes):
        content = [{"type": "image"} for _ in row_sizes] + [{"type": "text", "text": "How many are red?"}]
        images = [_image(w, h, (30 * row, 200, 40 * k)) for k, (w, h) in enumerate(row_sizes)]
        samples.append(Sample(row, [{"role": "user", "content": content}], images))
    prompts = [encoder.encode(s) for s in samples]
    # 7 images + their crops: 3 for each 900x300, 2 for the 600x280, 3 for the 280x800; none for the squares
    assert sum(p.pixels["pixel_values"].shape[0] for p in prompts if p.pixels) == 7 + 3 + 2 + 3 + 3
    pad = processor.tokenizer.pad_token_id
    rng = random.Random(2)
    completions = [[rng.randrange(60, len(processor.tokenizer) - 1) for _ in range(rng.randint(1, 5))] for _ in prompts]
    batch = collate(prompts, fam, pad, completions)
    order = [4, 0, 2, 5, 1, 3]
    shuffled = batch.select(order, fam.layout)
    with torch.no_grad():
        whole = completion_logprobs(model, shuffled, fam, encoder.image_token_id)
        parts = [completion_logprobs(model, shuffled.slice(lo, hi, fam.layout), fam, encoder.image_token_id)
                 for lo, hi in ((0, 3), (3, 6))]  # fmt: skip
        for j, i in enumerate(order):
            alone = completion_logprobs(model, collate([prompts[i]], fam, pad, [completions[i]]), fam,
                                        encoder.image_token_id)[0]  # fmt: skip
            n = len(completions[i])
            micro = parts[j // 3][j % 3]
            assert (whole[j, :n] - alone[:n]).abs().max().item() <= TOL, (i, "in the batch")
            assert (micro[:n] - alone[:n]).abs().max().item() <= TOL, (i, "in a micro-batch")
    # the canary: repainting the 900x300 image (its crops with it) in the middle of row 4 moves that row alone
    repainted = list(prompts)
    repainted[4] = encoder.encode(repaint(samples[4], image=1))
    assert repainted[4].pixels["pixel_values"].shape == prompts[4].pixels["pixel_values"].shape
    with torch.no_grad():
        after = completion_logprobs(model, collate(repainted, fam, pad, completions).select(order, fam.layout), fam,
                                    encoder.image_token_id)  # fmt: skip
    assert_only_rows_move(whole, after, shuffled.completion_mask, [order.index(4)], "gemma3 pan-and-scan")
