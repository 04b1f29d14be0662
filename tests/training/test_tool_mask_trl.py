"""Collage's multi-turn loss mask against TRL 1.16's ``tool_mask`` on a shared case: the same scripted trajectory
(a tool call, its result, an answer) gives the same completion tokens and the same mask as TRL builds them.

TRL's ``GRPOTrainer._tool_call_loop`` appends, after each generated turn, the ids of
``_get_tool_suffix_ids(tool_messages)`` (the chat template's tokens for the tool message(s) and the next generation
prompt, from a dummy conversation) and extends ``tool_mask`` with 0 for them and 1 for the next generated turn; its
loss mask is ``completion_mask * tool_mask``. TRL's own ``_get_tool_suffix_ids`` runs here, bound to a stand-in for
the trainer that holds what it reads (the processor, the tokenizer, the chat-template settings), on the tiny
families whose templates have a tool role (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), for a text tool and for the zoom tool,
whose crop TRL's processor path expands into image tokens as Collage's does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from collage.training.config import ToolSettings
from collage.training.tools.registry import resolve_tools
from tests.training.test_multiturn import ZOOM, Script, engine_for, rollouts, sample

SHOUT = '<tool_call>{"name": "shout", "arguments": {"text": "found it"}}</tool_call>'
ANSWER = "<answer>3</answer>"
QWEN = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"]


def trl_suffix(processor, tool_message: dict) -> list[int]:
    """TRL's tool-result ids for one tool message, by TRL's own method."""
    # the dev extra, never skipped; imported here, not at collection: TRL imports trackio, which reads its
    # TRACKIO_DIR once at import (tests/support/trackers.py sets it first)
    from trl import GRPOTrainer

    trainer = SimpleNamespace(processing_class=processor, chat_template=None, chat_template_kwargs={},
                              _is_vlm=True, _tokenizer=processor.tokenizer)  # fmt: skip
    return GRPOTrainer._get_tool_suffix_ids(trainer, [tool_message])


def trl_tool_mask(turns: list[list[int]], suffixes: list[list[int]]) -> tuple[list[int], list[int]]:
    """TRL's completion ids and tool_mask for generated turns separated by tool suffixes (_tool_call_loop)."""
    ids, mask = list(turns[0]), [1] * len(turns[0])
    for suffix, turn in zip(suffixes, turns[1:], strict=True):
        ids += suffix + turn
        mask += [0] * len(suffix) + [1] * len(turn)
    return ids, mask


@pytest.mark.parametrize("family", QWEN)
@pytest.mark.parametrize("tool", ["text", "image"])
def test_the_mask_is_trl_tool_mask(tiny, family, tool):
    settings = [ToolSettings(name="image_zoom_in"), ToolSettings(name="tests.support.tool_env:shout")]
    tools = resolve_tools(settings, ["tests.support.tool_env"], None)
    model, processor, fam, enc, engine, stop = engine_for(tiny, family, tools)
    tok = processor.tokenizer
    eos = sorted(stop)[0]
    call = SHOUT if tool == "text" else ZOOM
    script = Script(tok, eos, [[call], [ANSWER]])
    _, (traj,) = rollouts(engine, enc, fam, [sample()], 1, script)
    assert traj.tool_calls == 1 and traj.tool_errors == 0, traj.turns
    result = traj.turns[1]
    if tool == "text":
        message = {"role": "tool", "name": "shout", "content": result.text}
    else:  # TRL's multimodal tool response: content blocks, the image first as Collage sends it
        crop = result.images[0].image
        message = {"role": "tool", "name": "image_zoom_in",
                   "content": [{"type": "image", "image": crop}, {"type": "text", "text": result.text}]}  # fmt: skip
    suffix = trl_suffix(processor, message)
    generated = [tok.encode(t, add_special_tokens=False) + [eos] for t in (call, ANSWER)]
    ids, mask = trl_tool_mask(generated, [suffix])
    assert traj.tail == ids
    assert traj.generated == mask
    if tool == "image":  # the crop's image tokens are in the suffix, masked like every tool token
        assert enc.image_token_id in suffix
