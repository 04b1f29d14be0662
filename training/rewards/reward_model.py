"""A text reward model: a sequence-classification checkpoint scoring prompt + completion as text.

It cannot see images. Rows with images are refused (``on_images_for_text_reward: error``) before training
starts, or scored on their text alone (``drop``) with a warning recorded as a run event by the trainer.
"""

from __future__ import annotations

from typing import Any

import torch

from .builtins import completion_text


class TextRewardModel:
    def __init__(self, path: str, on_images: str = "error", device: str | torch.device = "cpu", batch_size: int = 16):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from ..templates import install as install_template_bounds

        install_template_bounds()  # its chat template is the reward model folder's code too
        self.path = path
        self.on_images = on_images
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device
        self.batch_size = batch_size
        self.__name__ = path

    @staticmethod
    def text_only(prompt: list[dict[str, Any]]) -> list[dict[str, str]]:
        """The conversation with image parts removed and content flattened to strings."""
        out = []
        for message in prompt:
            content = message["content"]
            if not isinstance(content, str):
                content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
            out.append({"role": message["role"], "content": content})
        return out

    def render(self, prompt: list[dict[str, Any]], completion: str) -> str:
        messages = [*self.text_only(prompt), {"role": "assistant", "content": completion}]
        if getattr(self.tokenizer, "chat_template", None):
            return str(self.tokenizer.apply_chat_template(messages, tokenize=False))
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages)

    @torch.no_grad()
    def __call__(self, prompts: list[Any], completions: list[Any], images: list[list[Any]], **_: Any) -> list[float]:
        if self.on_images == "error" and any(images):
            row = next(i for i, sample in enumerate(images) if sample)
            raise ValueError(
                f"text reward model {self.path} cannot see images but sample {row} has {len(images[row])}; "
                "set on_images_for_text_reward: drop to score the text alone"
            )
        texts = [self.render(p, completion_text(c)) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True)
            logits = self.model(**enc.to(self.device)).logits
            scores.extend(logits[:, 0].float().tolist())
        return scores
