"""examples/grpo-zoom.yaml's budget on the tiny Qwen2-VL: a find-digit prompt (one 640x640 image) fits its
max_prompt_length whole, and the digit's crop costs a few image tokens of its max_completion_length."""

from __future__ import annotations

from pathlib import Path

from collage.training.batching.encoding import PromptEncoder
from collage.training.config import load_config
from collage.training.data.loader import load_dataset

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-zoom.yaml"


def test_a_find_digit_prompt_fits_the_examples_prompt_budget_untruncated(tiny):
    config = load_config(EXAMPLE)
    model, processor, fam = tiny("qwen2-vl")
    encoder = PromptEncoder(processor, fam, config.train.max_prompt_length)
    d = config.dataset
    samples = load_dataset(d.source, limit=6, rows=d.rows, min_images=d.min_images, max_images=d.max_images,
                           seed=d.seed).load_all()  # fmt: skip
    assert len(samples) == 6 and all(s.num_images == 1 for s in samples)
    for sample in samples:
        prompt = encoder.encode(sample)
        assert prompt.truncated_tokens == 0
        assert prompt.num_image_tokens >= 500  # 46x46 patches merged 2x2: the image is not shrunk
        assert len(prompt.input_ids) <= config.train.max_prompt_length
        x1, y1, x2, y2 = sample.columns["region"]
        crop = sample.images[0].crop((max(0, x1 - 40), max(0, y1 - 40), min(640, x2 + 40), min(640, y2 + 40)))
        ids, _ = encoder.encode_segment("<|vision_start|><|image_pad|><|vision_end|>", [crop], sample.row)
        assert len(ids) < config.train.max_completion_length // 2
