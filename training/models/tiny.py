"""Tiny random-weight VLMs built entirely offline.

Each build trains a small byte-level BPE tokenizer with the family's special tokens, writes an image processor
sized so a 56x56 image costs a handful of image tokens, a chat template that renders ``{"type": "image"}`` parts
the family's way, and a generation config, all through ``save_pretrained``. The result reloads with
``AutoProcessor`` + ``AutoModelForImageTextToText`` like any hub checkpoint, so the loading code that users hit
with real models is the code the tests exercise.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .families import TINY_FAMILIES, UnsupportedModelError

HIDDEN = 64
VOCAB_SIZE = 1024
SEED = 1234

# Text the tokenizer is trained on: the words of the synthetic tasks plus general English, so both the demo
# tasks and ordinary user prompts tokenise into reasonably few pieces.
_WORDS = (
    "how many of the images are red count answer with a number which image is the odd one out differs from others "
    "do images show same shape yes no circle square triangle cross star color colour picture photo look at "
    "first second third fourth fifth one two three four five six seven eight zero is a an and or not in on "
    "what where why when who this that these those there here it they we you i please reply only final think "
    "step by the answer <answer> </answer> <think> </think> true false left right top bottom green blue yellow "
    "purple orange black white gray describe compare between both each every all none some more less than"
).split()


def _training_corpus(n_lines: int = 4000) -> list[str]:
    rng = random.Random(SEED)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 20)))
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ":", ""]))
    lines.extend(" ".join(str(i) for i in range(k, k + 10)) for k in range(0, 100, 10))
    return lines


def _train_tokenizer(special_tokens: list[str], bos: str | None, eos: str, pad: str, unk: str | None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    named = {"eos_token": eos, "pad_token": pad}
    if bos:
        named["bos_token"] = bos
    if unk:
        named["unk_token"] = unk
    extra = [t for t in special_tokens if t not in named.values()]
    # left padding, as for any decoder used for generation (Collage pads prompts itself, but other tools that
    # batch through the processor, TRL included, rely on the tokenizer's side)
    return PreTrainedTokenizerFast(tokenizer_object=tok, extra_special_tokens=extra, padding_side="left", **named)


def _template(role_open: str, role_close: str, image: str, generation_prompt: str, role_map: str = "") -> str:
    """A chat template: string or multi-part content, one ``image`` string per ``{"type": "image"}`` part."""
    return (
        "{% for message in messages %}"
        + (role_map or "{% set role = message['role'] %}")
        + role_open
        + "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' or part['type'] == 'image_url' %}" + image + ""
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}" + role_close + "{% endfor %}"
        "{% if add_generation_prompt %}" + generation_prompt + "{% endif %}"
    )


# Qwen2.5-VL's tool support, as its real template has it: the tools' JSON schemas in a system turn, and a tool result
# as a user turn inside <tool_response> tags
QWEN_TOOLS = (
    "{%- if tools %}<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or more "
    "functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> "
    "XML tags:\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
)
QWEN_TEMPLATE = QWEN_TOOLS + _template(
    "<|im_start|>{{ role }}\n{% if message['role'] == 'tool' %}<tool_response>\n{% endif %}",
    "{% if message['role'] == 'tool' %}\n</tool_response>{% endif %}<|im_end|>\n",
    "<|vision_start|><|image_pad|><|vision_end|>",
    "<|im_start|>assistant\n",
    role_map="{% set role = 'user' if message['role'] == 'tool' else message['role'] %}",
)
LLAVA_TEMPLATE = _template(
    "{{ role }}: ",  # LLaVA-1.5 layout: USER: <image> ... ASSISTANT:
    "{{ '</s>' if message['role'] == 'assistant' else ' ' }}",
    "<image>\n",
    "ASSISTANT:",
    role_map="{% set role = 'ASSISTANT' if message['role'] == 'assistant' else message['role'].upper() %}",
)
IDEFICS3_TEMPLATE = _template(
    "<|im_start|>{{ role }}:",
    "<end_of_utterance>\n",
    "<image>",
    "<|im_start|>Assistant:",
    role_map="{% set role = message['role'] | capitalize %}",
)


def _text_config(vocab: int, **extra) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        **extra,
    )


def _qwen_tokens() -> list[str]:
    return [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ]


def _build_qwen(out: Path, version: str) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    tokenizer = _train_tokenizer(_qwen_tokens(), None, "<|im_end|>", "<|endoftext|>", None)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _qwen_tokens()}
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    # head_dim 16 -> 8 rotary frequencies split over (temporal, height, width)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = _text_config(
        len(tokenizer),
        rope_parameters=rope,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
    )
    if version == "2":
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLImageProcessor as ImageProcessor
        from transformers import Qwen2VLProcessor as Processor
        from transformers import Qwen2VLVideoProcessor as VideoProcessor

        vision: dict[str, Any] = dict(
            depth=2,
            embed_dim=32,
            hidden_size=HIDDEN,
            num_heads=4,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
    else:
        from transformers import Qwen2_5_VLConfig as Config  # type: ignore[assignment]
        from transformers import Qwen2_5_VLProcessor as Processor  # type: ignore[assignment]
        from transformers import Qwen2VLImageProcessor as ImageProcessor
        from transformers import Qwen2VLVideoProcessor as VideoProcessor

        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=HIDDEN,
            window_size=56,
            fullatt_block_indexes=[1],
        )
    config = Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **common)
    # Qwen's shipped pixel limits (preprocessor_config.json): min_pixels 56*56, max_pixels 28*28*1280; a 56x56
    # image -> 4x4 patches -> 4 image tokens after the 2x2 merge, a 160x120 one -> 12x8 patches -> 24 tokens
    pixel_kwargs = dict(
        min_pixels=56 * 56, max_pixels=28 * 28 * 1280, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    image_processor = ImageProcessor(**pixel_kwargs)
    video_processor = VideoProcessor(**pixel_kwargs)
    processor = Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=QWEN_TEMPLATE,
    )
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config)
    _save(out, model, processor, ids["<|im_end|>"], ids["<|endoftext|>"], None)


def _build_llava(out: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, CLIPImageProcessor, LlavaConfig, LlavaProcessor

    specials = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
    tokenizer = _train_tokenizer(specials, "<s>", "</s>", "<pad>", "<unk>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    text = _text_config(len(tokenizer), bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"])
    text["model_type"] = "llama"
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=28,
        patch_size=14,
        projection_dim=32,
    )
    # 28x28 input, 14px patches -> 4 patch features (+ CLS, which the "default" strategy drops)
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        image_seq_length=4,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    image_processor = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE,
    )
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config)
    _save(out, model, processor, ids["</s>"], ids["<pad>"], ids["<s>"])


def _build_idefics3(out: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, Idefics3Config, Idefics3ImageProcessor, Idefics3Processor

    row_col = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    specials = [
        "<|endoftext|>",
        "<|im_start|>",
        "<end_of_utterance>",
        "<fake_token_around_image>",
        "<image>",
        "<global-img>",
        *row_col,
    ]
    tokenizer = _train_tokenizer(specials, "<|im_start|>", "<end_of_utterance>", "<|endoftext|>", None)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    text = _text_config(
        len(tokenizer),
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<end_of_utterance>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    text["model_type"] = "llama"
    # The shipped processor splits every image (do_image_splitting=True): resized to a longest edge of 4x the
    # tile size, cut into tiles, plus a global view; tile rows are separated by "\n" inside the image's span.
    # Same rule here with 28 px tiles instead of 364 (a tiny tower): 28x28 tiles, 14 px patches -> 4 patches,
    # pixel-shuffled by 2 -> 1 image token per tile; a 56x56 image becomes 4x4 crops + the global view.
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28, patch_size=14
    )
    config = Idefics3Config(
        vision_config=vision, text_config=text, image_token_id=ids["<image>"], scale_factor=2, tie_word_embeddings=False
    )
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": 4 * 28}, max_image_size={"longest_edge": 28}, do_image_splitting=True
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=1, chat_template=IDEFICS3_TEMPLATE
    )
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config)
    _save(out, model, processor, ids["<end_of_utterance>"], ids["<|endoftext|>"], ids["<|im_start|>"])


# ------------------------------------------------------------------------------------------------------------------
# Families added after the first four. Each mirrors its family's shipped preprocessor_config.json (splitting, anyres
# pinpoints, pan-and-scan, min/max pixels, mean/std, resampling); only the tile or image side shrinks where the real
# one would make a CPU test slow, and then every size that derives from it (pinpoints, longest edges) shrinks by the
# same factor, so a small test image is tiled the way a photo is on the real model.


def _named_tokenizer(special_tokens: list[str], named: dict[str, str], bos: str | None, eos: str, pad: str):
    """A tiny tokenizer whose ``named`` special tokens are attributes (``tokenizer.image_token``, ...), as the
    family's shipped ``tokenizer_config.json`` has them; the processors of Gemma 3 and InternVL read them."""
    from transformers import PreTrainedTokenizerFast

    base = _train_tokenizer(special_tokens, bos, eos, pad, None)
    kwargs = {"eos_token": eos, "pad_token": pad}
    if bos:
        kwargs["bos_token"] = bos
    return PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, extra_special_tokens=named, padding_side="left", **kwargs
    )


def _ids(tokenizer, tokens: list[str]) -> dict[str, int]:
    return {t: tokenizer.convert_tokens_to_ids(t) for t in tokens}


def _build_qwen3_vl(out: Path) -> None:
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    tokenizer = _train_tokenizer(_qwen_tokens(), None, "<|im_end|>", "<|endoftext|>", None)
    ids = _ids(tokenizer, _qwen_tokens())
    text = _text_config(
        len(tokenizer),
        head_dim=HIDDEN // 4,
        # interleaved M-RoPE as shipped ([24, 20, 20] of 64 frequencies), scaled to 8 frequencies
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=HIDDEN,
        num_position_embeddings=2304,  # the shipped 48x48 learned grid, interpolated to each image
        # DeepStack (shipped: blocks 8, 16, 24 feed LLM layers 0-2): block 0 feeds LLM layer 0. Not layer 1 too: the
        # last layer's image positions reach no completion token, so that merger would never get a gradient
        deepstack_visual_indexes=[0],
    )
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    # Qwen3-VL's shipped preprocessor_config.json, unchanged: 16px patches, 2x2 merge, min 65536 (256x256) and max
    # 16777216 (4096x4096) pixels, mean/std 0.5. A 56x56 image is upscaled to 256x256: 256 patches, 64 tokens.
    qwen3 = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": 65536, "longest_edge": 16777216}, **qwen3)
    video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": 4096, "longest_edge": 25165824}, **qwen3)
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=QWEN_TEMPLATE,
    )
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config)
    _save(out, model, processor, ids["<|im_end|>"], ids["<|endoftext|>"], None)


# Gemma 3: BOS, then <start_of_turn>user / model turns; an image part is <start_of_image>, which the processor
# expands to "\n\n<start_of_image>" + soft tokens + "<end_of_image>\n\n".
GEMMA3_TEMPLATE = "{{ bos_token }}" + _template(
    "<start_of_turn>{{ role }}\n",
    "<end_of_turn>\n",
    "<start_of_image>",
    "<start_of_turn>model\n",
    role_map="{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}",
)


def _build_gemma3(out: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, Gemma3Config, Gemma3ImageProcessor, Gemma3Processor

    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", *named.values()]
    tokenizer = _named_tokenizer(specials, named, "<bos>", "<eos>", "<pad>")
    ids = _ids(tokenizer, specials)
    text = _text_config(
        len(tokenizer),
        head_dim=HIDDEN // 4,
        query_pre_attn_scalar=HIDDEN // 4,  # shipped: head_dim
        # one local (sliding) and one global layer, as the shipped 5:1 pattern has both kinds; a short window so
        # that the test prompts cross it
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=32,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"],
    )
    text["model_type"] = "gemma3_text"
    # SigLIP at 224 (shipped 896), 14px patches -> 16x16 patches, average-pooled with the shipped 4x4 kernel to 16
    # soft tokens per image (shipped: 64x64 patches -> 256). At 896 each image is 4096 patches: far too slow for CPU.
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=224,
        patch_size=14,
        vision_use_head=False,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=16,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=False,
    )
    # The shipped preprocessor_config.json: bilinear resize to a square, mean/std 0.5, and pan-and-scan left null,
    # so the processor's defaults apply: off, with min crop 256, at most 4 crops, from an aspect ratio of 1.2.
    image_processor = Gemma3ImageProcessor(
        size={"height": 224, "width": 224},
        resample=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        do_pan_and_scan=None,
        pan_and_scan_min_crop_size=None,
        pan_and_scan_max_num_crops=None,
        pan_and_scan_min_ratio_to_activate=None,
    )
    processor = Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=16, chat_template=GEMMA3_TEMPLATE
    )
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config)
    # transformers initialises the projection from vision to text space to zeros (a real checkpoint loads it): left
    # so, every image becomes the same all-zero soft tokens and the model is blind
    _fill_normal(model.model.multi_modal_projector.mm_input_projection_weight, config.text_config)
    _save(out, model, processor, ids["<end_of_turn>"], ids["<pad>"], ids["<bos>"])


# LLaVA-OneVision's shipped template: every image of a turn first, then each text part on a new line (string
# content allowed too).
LLAVA_ONEVISION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['content'] is string %}{{ '\n' + message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{ '<image>' }}{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ '\n' + part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAVA_ONEVISION_TILE = 28  # shipped 384 (SigLIP 384/14 = 27x27 = 729 tokens a tile)


def _build_llava_onevision(out: Path) -> None:
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        LlavaOnevisionConfig,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
    tokenizer = _train_tokenizer(specials, None, "<|im_end|>", "<|endoftext|>", None)
    ids = _ids(tokenizer, specials)
    text = _text_config(len(tokenizer), eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    text["model_type"] = "qwen2"
    tile = LLAVA_ONEVISION_TILE
    # 28px tiles of 14px patches: 2x2 = 4 features a tile (SigLIP has no CLS: strategy "full", as shipped)
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=tile,
        patch_size=14,
        vision_use_head=False,
    )
    # the shipped anyres grid: every (rows, cols) from 1x1 to 6x6 tiles
    pinpoints = [[tile * r, tile * c] for r in range(1, 7) for c in range(1, 7)]
    config = LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_9",
        image_grid_pinpoints=pinpoints,
        tie_word_embeddings=False,
    )
    pixel = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=3, size={"height": tile, "width": tile})
    image_processor = LlavaOnevisionImageProcessor(image_grid_pinpoints=pinpoints, do_pad=True, **pixel)
    video_processor = LlavaOnevisionVideoProcessor(**pixel)
    processor = LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        num_image_tokens=(tile // 14) ** 2,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
        chat_template=LLAVA_ONEVISION_TEMPLATE,
    )
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config)
    _save(out, model, processor, ids["<|im_end|>"], ids["<|endoftext|>"], None)


INTERNVL_TEMPLATE = _template("<|im_start|>{{ role }}\n", "<|im_end|>\n", "<IMG_CONTEXT>\n", "<|im_start|>assistant\n")
INTERNVL_TILE = 28  # shipped 448 (448/14 = 32x32 patches, pixel-shuffled by 0.5 to 256 tokens a tile)


def _build_internvl(out: Path) -> None:
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLProcessor,
        InternVLVideoProcessor,
    )

    named = {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    }
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *named.values()]
    tokenizer = _named_tokenizer(specials, named, None, "<|im_end|>", "<|endoftext|>")
    ids = _ids(tokenizer, specials)
    text = _text_config(len(tokenizer), eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    text["model_type"] = "qwen2"
    tile = INTERNVL_TILE
    # 28px tiles of 14px patches: 2x2 patches, pixel-shuffled (downsample 0.5, as shipped) to 1 token a tile
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=[tile, tile],
        patch_size=[14, 14],
    )
    seq = int((tile // 14) ** 2 * 0.25)
    config = InternVLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=seq,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    # The shipped preprocessor_config.json: crop_to_patches on, 1..12 tiles a image (plus a thumbnail when tiled),
    # bicubic, ImageNet mean/std; only the tile is 28px. A 56x56 image becomes 2x2 tiles + a thumbnail.
    pixel = dict(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225], resample=3)
    image_processor = GotOcr2ImageProcessor(
        size={"height": tile, "width": tile}, crop_to_patches=True, min_patches=1, max_patches=12, **pixel
    )
    video_processor = InternVLVideoProcessor(size={"height": tile, "width": tile}, **pixel)
    processor = InternVLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        image_seq_length=seq,
        chat_template=INTERNVL_TEMPLATE,
    )
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config)
    # transformers initialises InternViT's class token and learned position embeddings to zeros (a real checkpoint
    # loads them): left so, the tower cannot tell where in a tile a patch lies
    embeddings = model.model.vision_tower.embeddings
    for param in (embeddings.cls_token, embeddings.position_embeddings):
        _fill_normal(param, config.vision_config)
    _save(out, model, processor, ids["<|im_end|>"], ids["<|endoftext|>"], None)


SMOLVLM_TILE = 56  # shipped 512 (SmolVLM2-256M; SigLIP 512/16 = 32x32 patches, pixel-shuffled by 4 to 64 tokens)


def _build_smolvlm(out: Path) -> None:
    import num2words  # noqa: F401  # SmolVLMProcessor refuses to exist without it: fail here, naming the package
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        SmolVLMConfig,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    row_col = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    specials = [
        "<|endoftext|>",
        "<|im_start|>",
        "<end_of_utterance>",
        "<fake_token_around_image>",
        "<image>",
        "<global-img>",
        "<video>",
        *row_col,
    ]
    tokenizer = _train_tokenizer(specials, "<|im_start|>", "<end_of_utterance>", "<|endoftext|>", None)
    ids = _ids(tokenizer, specials)
    text = _text_config(
        len(tokenizer),
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<end_of_utterance>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    text["model_type"] = "llama"
    tile = SMOLVLM_TILE
    # 56px tiles of 14px patches: 4x4 patches, pixel-shuffled by the shipped factor 4 to 1 token a tile
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=tile, patch_size=14
    )
    config = SmolVLMConfig(
        vision_config=vision, text_config=text, image_token_id=ids["<image>"], scale_factor=4, tie_word_embeddings=False
    )
    # The shipped preprocessor_config.json: image splitting on, every image resized to a longest edge of 4 tiles
    # (2048 for 512px tiles; 224 here) and cut into tiles plus a global view, Lanczos, mean/std 0.5, padding on.
    pixel = dict(
        size={"longest_edge": 4 * tile},
        max_image_size={"longest_edge": tile},
        resample=1,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    image_processor = SmolVLMImageProcessor(do_image_splitting=True, do_pad=True, **pixel)
    video_processor = SmolVLMVideoProcessor(**pixel)
    processor = SmolVLMProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        image_seq_len=(tile // 14) ** 2 // 16,
        chat_template=DEFAULT_CHAT_TEMPLATE,
    )
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config)
    _save(out, model, processor, ids["<end_of_utterance>"], ids["<|endoftext|>"], ids["<|im_start|>"])


def _fill_normal(param, sub_config: Any) -> None:
    """Random weights where transformers' own initialisation leaves zeros on the path from pixels to logits, drawn as
    it draws every other weight (normal, the sub-config's ``initializer_range``), continuing the builder's seeded
    stream so that a build stays reproducible."""
    import torch

    with torch.no_grad():
        param.normal_(mean=0.0, std=sub_config.initializer_range)


def _save(out: Path, model, processor, eos_id: int, pad_id: int, bos_id: int | None) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        do_sample=True,
        temperature=1.0,
        max_new_tokens=32,
    )
    model.config.pad_token_id = pad_id
    model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "collage_tiny.json").write_text(json.dumps({"built_by": "collage models build-tiny"}) + "\n")


BUILDERS: dict[str, Callable[[Path], None]] = {
    "qwen2-vl": lambda out: _build_qwen(out, "2"),
    "qwen2.5-vl": lambda out: _build_qwen(out, "2.5"),
    "llava": _build_llava,
    "idefics3": _build_idefics3,
    "qwen3-vl": _build_qwen3_vl,
    "gemma3": _build_gemma3,
    "llava-onevision": _build_llava_onevision,
    "internvl": _build_internvl,
    "smolvlm": _build_smolvlm,
}
assert set(BUILDERS) == set(TINY_FAMILIES)


def build_tiny_reward_model(out: str | Path) -> Path:
    """A tiny random-weight *text* reward model (sequence classification, one label) with a chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(["<pad>", "</s>"], None, "</s>", "<pad>", None)
    tokenizer.chat_template = (
        "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}</s>{% endfor %}"
    )
    config = LlamaConfig(
        **_text_config(len(tokenizer)),
        num_labels=1,  # type: ignore[call-arg]  # a PretrainedConfig keyword the stubs do not list
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(SEED)
    LlamaForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny(family: str, out: str | Path) -> Path:
    """Build the tiny ``family`` model into ``out`` (created; must be empty or absent)."""
    if family not in BUILDERS:
        raise UnsupportedModelError(f"no tiny builder for family {family!r}: choose one of {', '.join(TINY_FAMILIES)}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty: choose a new folder for the tiny model")
    out.mkdir(parents=True, exist_ok=True)
    import torch

    # the builders seed torch for reproducible weights; a run that builds `tiny:<family>` on first use must not
    # have its own random stream reset by that (it would then differ from the same run with the model cached)
    with torch.random.fork_rng(devices=[]):
        BUILDERS[family](out)
    return out


if __name__ == "__main__":  # ``python -m collage.training.models.tiny FAMILY OUT``: a build in a process of its own
    import sys

    build_tiny(sys.argv[1], sys.argv[2])
