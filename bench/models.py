"""The random-weight Qwen2-VL models the training benchmark runs, built locally (no hub).

- ``tiny``: Collage's own ``tiny:qwen2-vl`` (hidden 64, 2 layers, 848-token vocabulary): per-step overhead.
- ``mid``: about 12M parameters (hidden 256, 10 layers, a 4-block vision tower of width 128): big enough that
  the model's compute, not Python, dominates a step on one CPU thread.
- ``vocab``: the tiny body with Qwen's real 151,936-token vocabulary (embedding and LM head): where the
  ``(B, C, V)`` logits, not the body, decide the memory.

Each reuses the tiny model's tokenizer, chat template and image processor (Qwen's real pixel limits: a 168 px
image is 12 x 12 patches, 36 tokens after the 2 x 2 merge). Token ids past the tokenizer's 848 decode to nothing;
both frameworks see the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

KINDS = ("tiny", "mid", "vocab")
VERSION = 1  # bump when a kind's shape changes: the cache folder is keyed by it


def _mid(text: dict[str, Any], vision: dict[str, Any]) -> None:
    text.update(hidden_size=256, intermediate_size=1024, num_hidden_layers=10, num_attention_heads=8,
                num_key_value_heads=4, layer_types=["full_attention"] * 10)  # fmt: skip
    # head_dim 32 -> 16 rotary frequencies split over (temporal, height, width)
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [4, 6, 6]}
    vision.update(embed_dim=128, depth=4, num_heads=4, mlp_ratio=4, hidden_size=256)


def _vocab(text: dict[str, Any], vision: dict[str, Any]) -> None:
    text.update(vocab_size=151_936)


def model_path(kind: str, cache: Path) -> Path:
    """The folder of ``kind``, built on first use under ``cache``."""
    from collage.training.models.loading import resolve_model_path

    tiny = Path(resolve_model_path("tiny:qwen2-vl"))
    if kind == "tiny":
        return tiny
    if kind not in KINDS:
        raise SystemExit(f"unknown benchmark model {kind!r}: choose one of {', '.join(KINDS)}")
    out = cache / f"{kind}-v{VERSION}"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, Qwen2VLConfig

    config = Qwen2VLConfig.from_pretrained(tiny).to_dict()
    text, vision = config["text_config"], config["vision_config"]
    {"mid": _mid, "vocab": _vocab}[kind](text, vision)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(Qwen2VLConfig(**config))
    model.generation_config = AutoModelForImageTextToText.from_pretrained(tiny).generation_config
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    AutoProcessor.from_pretrained(tiny).save_pretrained(tmp)
    tmp.rename(out)
    return out
