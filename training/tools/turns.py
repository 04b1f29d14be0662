"""A tool turn as tokens: the tool's result rendered through the model's own chat template, then its processor.

What follows a generated turn that called a tool is the template's text after the model's end-of-turn token, the
tool message(s) and the next generation prompt. It is found by rendering a fixed two-message conversation with and
without the tool messages and keeping the difference (as TRL does), so the real conversation's earlier turns are
never re-rendered or re-tokenised: the ids the model generated stay exactly as generated, and the loss sees the
tokens generation saw. The processor then expands each new image's placeholder into that family's image tokens,
tiles and separators (:meth:`~training.batching.encoding.PromptEncoder.encode_segment`).

A template with no tool role (it raises on one, or renders nothing for it) gets the documented fallback turn: a
``user`` message "Tool result (name): ..." with the images, which every chat template renders.
"""

from __future__ import annotations

from typing import Any

from .types import ToolCall, ToolResult

MARK = "\u2063collage-turn\u2063"  # an assistant text no real turn contains: where the dummy assistant turn ends


def tool_message(call: ToolCall, result: ToolResult, fallback: bool) -> dict[str, Any]:
    """The chat message of one tool result: its images (one ``{"type": "image"}`` part each) and its text."""
    text = f"Error: {result.error}" if result.error is not None else result.text
    if fallback:
        name = call.name or "tool call"
        text = f"Tool result ({name}): {text}"
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in result.images]
    parts.append({"type": "text", "text": text})
    return {"role": "user" if fallback else "tool", "content": parts}


def _render(processor: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    return processor.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


class TurnRenderer:
    """Renders tool turns for one processor. ``eos_text``: the end-of-turn text the model generates."""

    def __init__(self, processor: Any):
        self.processor = processor
        self._dummy = [{"role": "user", "content": [{"type": "text", "text": "x"}]},
                       {"role": "assistant", "content": [{"type": "text", "text": MARK}]}]  # fmt: skip
        self._base = _render(processor, self._dummy, False)
        self._close = self._base[self._base.rfind(MARK) + len(MARK) :]  # the template's end of an assistant turn
        self.fallback = not self._renders_tool_role()

    def _renders_tool_role(self) -> bool:
        probe = {"role": "tool", "content": [{"type": "text", "text": MARK + "probe"}]}
        try:
            text = _render(self.processor, [*self._dummy, probe], True)
        except Exception:  # noqa: BLE001 - a template that refuses the tool role (Gemma's "roles must alternate")
            return False
        return text.startswith(self._base) and MARK + "probe" in text[len(self._base) :]

    def after_turn(self, eos_text: str) -> str:
        """The template's text that follows the model's end-of-turn token (Qwen's ``\\n`` after ``<|im_end|>``);
        the whole close of an assistant turn when the model stopped on another stop token."""
        if eos_text and eos_text in self._close:
            return self._close[self._close.index(eos_text) + len(eos_text) :]
        return self._close

    def text(self, calls: list[ToolCall], results: list[ToolResult], eos_text: str) -> str:
        """The text of the tool turn(s) after a generated turn, up to and including the next generation prompt."""
        messages = [tool_message(c, r, self.fallback) for c, r in zip(calls, results, strict=True)]
        full = _render(self.processor, [*self._dummy, *messages], True)
        if not full.startswith(self._base):
            raise ValueError("the chat template renders earlier turns differently once a tool turn follows them")
        return self.after_turn(eos_text) + full[len(self._base) :]
