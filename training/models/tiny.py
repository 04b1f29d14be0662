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


QWEN_TEMPLATE = _template(
    "<|im_start|>{{ role }}\n",
    "<|im_end|>\n",
    "<|vision_start|><|image_pad|><|vision_end|>",
    "<|im_start|>assistant\n",
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
    BUILDERS[family](out)
    return out
