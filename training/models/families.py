"""What Collage needs to know about each vision-language model family.

A family fixes two things the training core cares about: how ``pixel_values`` is laid out across a batch
(see ``training.batching.layouts``) and which token strings belong to the vision part of a prompt (they are
never truncated, never generated, and never fed back as image tokens from a completion).
"""

from __future__ import annotations

from dataclasses import dataclass

from collage.training.infra.errors import InputError

GRID = "grid"  # Qwen-VL: flat patch rows for the whole batch + image_grid_thw per image
IMAGE_INDEXED = "image_indexed"  # LLaVA / Gemma3: one entry per image, no per-sample axis
BATCH_PADDED = "batch_padded"  # Idefics3 / SmolVLM: (batch, max_images, 3, H, W) + pixel_attention_mask

LAYOUTS = (GRID, IMAGE_INDEXED, BATCH_PADDED)


@dataclass(frozen=True)
class Family:
    name: str  # the name used in `tiny:<name>` and `collage models build-tiny`
    model_types: tuple[str, ...]  # transformers `config.model_type` values that belong to this family
    layout: str
    pixel_keys: tuple[str, ...]  # processor outputs that carry images, first one is the pixel tensor
    image_token: str  # the token repeated once per image feature
    vision_tokens: tuple[str, ...]  # every token that is part of an image's span in the prompt
    tiny: bool  # whether `collage models build-tiny` can build it offline
    # image_indexed families whose pixel_values holds a variable number of tiles (crops) per image rather than one
    # entry per image: InternVL's dynamic tiling, Gemma 3's pan-and-scan crops. `collate` keeps each sample's
    # tiles together so the per-image split of the layout stays right (see training.batching.batch).
    tiled: bool = False
    # model inputs the batch path derives from the final, padded batch (never from the per-sample encoding, so they
    # cannot drift from the padding): "token_type_ids" (Gemma 3: 1 on image soft tokens, which attend to each other
    # both ways), "batch_num_images" (LLaVA-OneVision: images per sample; anyres patches only for single-image rows)
    extra_inputs: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="qwen2-vl",
            model_types=("qwen2_vl",),
            layout=GRID,
            pixel_keys=("pixel_values", "image_grid_thw"),
            image_token="<|image_pad|>",
            vision_tokens=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
            tiny=True,
        ),
        Family(
            name="qwen2.5-vl",
            model_types=("qwen2_5_vl",),
            layout=GRID,
            pixel_keys=("pixel_values", "image_grid_thw"),
            image_token="<|image_pad|>",
            vision_tokens=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
            tiny=True,
        ),
        Family(
            name="qwen3-vl",
            model_types=("qwen3_vl",),
            layout=GRID,
            pixel_keys=("pixel_values", "image_grid_thw"),
            image_token="<|image_pad|>",
            vision_tokens=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
            tiny=True,
        ),
        Family(
            name="llava",
            model_types=("llava",),
            layout=IMAGE_INDEXED,
            pixel_keys=("pixel_values",),
            image_token="<image>",
            vision_tokens=("<image>",),
            tiny=True,
        ),
        Family(
            name="llava-next",
            model_types=("llava_next",),
            layout=IMAGE_INDEXED,
            pixel_keys=("pixel_values", "image_sizes"),
            image_token="<image>",
            vision_tokens=("<image>",),
            tiny=False,
        ),
        Family(
            name="gemma3",
            model_types=("gemma3",),
            layout=IMAGE_INDEXED,
            pixel_keys=("pixel_values",),
            image_token="<image_soft_token>",
            vision_tokens=("<image_soft_token>", "<start_of_image>", "<end_of_image>"),
            tiny=True,
            tiled=True,  # pan-and-scan (off as shipped) adds crops after each image
            extra_inputs=("token_type_ids",),
        ),
        Family(
            name="idefics3",
            model_types=("idefics3", "smolvlm"),
            layout=BATCH_PADDED,
            pixel_keys=("pixel_values", "pixel_attention_mask"),
            image_token="<image>",
            vision_tokens=("<image>", "<fake_token_around_image>", "<global-img>")
            + tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
            tiny=True,
        ),
        Family(
            name="llava-onevision",
            model_types=("llava_onevision",),
            layout=IMAGE_INDEXED,
            pixel_keys=("pixel_values", "image_sizes"),  # (images, max_patches, 3, H, W): anyres patches per image
            image_token="<image>",
            vision_tokens=("<image>", "<video>"),
            tiny=True,
            extra_inputs=("batch_num_images",),
        ),
        Family(
            name="internvl",
            model_types=("internvl",),
            layout=IMAGE_INDEXED,
            pixel_keys=("pixel_values",),  # (tiles, 3, H, W): 1..12 tiles (+ a thumbnail) per image
            image_token="<IMG_CONTEXT>",
            vision_tokens=("<img>", "</img>", "<IMG_CONTEXT>"),
            tiny=True,
            tiled=True,
        ),
        Family(
            name="smolvlm",
            model_types=("smolvlm",),  # SmolVLM2; SmolVLM (v1) checkpoints say idefics3
            layout=BATCH_PADDED,
            pixel_keys=("pixel_values", "pixel_attention_mask"),  # (batch, max_tiles, 3, H, W)
            image_token="<image>",
            vision_tokens=("<image>", "<fake_token_around_image>", "<global-img>")
            + tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
            tiny=True,
        ),
    )
}

TINY_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.tiny)


class UnsupportedModelError(InputError):
    pass


def family_by_name(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError as exc:
        raise UnsupportedModelError(
            f"unknown model family {name!r}: known families are {', '.join(sorted(FAMILIES))}"
        ) from exc


def family_for_model_type(model_type: str) -> Family:
    # a family whose own model type this is comes first: `smolvlm` is SmolVLM's, though idefics3 shares its layout
    for family in sorted(FAMILIES.values(), key=lambda f: f.model_types[0] != model_type):
        if model_type in family.model_types:
            return family
    supported = sorted({t for f in FAMILIES.values() for t in f.model_types})
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not a supported vision-language family; supported: {', '.join(supported)}"
    )
