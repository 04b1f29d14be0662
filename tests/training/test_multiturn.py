"""Multi-turn rollouts with image tools on every tiny family that supports them, in-process, with a scripted policy
(a tiny random model never writes a tool call by itself): the tokens that count in the loss are exactly the ones
the model generated, the log-probs of a whole trajectory equal one plain forward over the conversation as the
processor encodes it, a tool image reaches the model (the canary), and every way a call can go wrong has its
documented outcome."""

from __future__ import annotations

import time

import pytest
import torch
from PIL import Image, ImageOps

from collage.training.batching.batch import collate
from collage.training.batching.encoding import PromptEncoder
from collage.training.batching.forward import extra_inputs
from collage.training.batching.logprobs import completion_logprobs_and_entropy
from collage.training.config import ToolSettings
from collage.training.data.rows import Sample
from collage.training.generation import Completions, eos_ids
from collage.training.models.families import TINY_FAMILIES
from collage.training.rollout import multi_turn
from collage.training.tools.image_tools import image_zoom_in
from collage.training.tools.multiturn import MultiTurnEngine, TurnLimits
from collage.training.tools.registry import Tool, resolve_tools, tool_schema
from collage.training.tools.turns import tool_message
from collage.training.tools.types import ToolCall, ToolResult
from tests.support.canary import CANARY_MARGIN

TOL = 1e-5
FAMILIES = [f for f in TINY_FAMILIES if f != "llava-onevision"]  # refused with tools: see test_onevision_refused
ZOOM = '<tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [30, 10, 80, 70]}}</tool_call>'
ROTATE = '<tool_call>{"name": "image_rotate", "arguments": {"angle": 90}}</tool_call>'


def scene() -> Image.Image:
    img = Image.new("RGB", (96, 80), (200, 30, 30))
    for x in range(40, 70):
        for y in range(20, 60):
            img.putpixel((x, y), ((x * 7) % 256, (y * 11) % 256, 90))
    return img


def sample(row: int = 0) -> Sample:
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the box?"}]}]
    return Sample(row, prompt, [scene()], {"answer": "3"})


class Script:
    """A policy that writes given texts: ``turns[k][i]`` is rollout ``i``'s text at call ``k`` of generate (rows
    beyond a list's length take its last entry), each ended with the model's EOS."""

    def __init__(self, tokenizer, eos: int, turns: list[list[str]]):
        self.tokenizer, self.eos, self.turns, self.calls = tokenizer, eos, turns, 0
        self.batches: list[int] = []

    def __call__(self, batch, g, max_new, features):
        texts = self.turns[self.calls]
        self.calls += 1
        rows = batch.batch_size * g
        self.batches.append(rows)
        ids = [self.tokenizer.encode(texts[min(i, len(texts) - 1)], add_special_tokens=False) + [self.eos]
               for i in range(rows)]  # fmt: skip
        return Completions([x[:max_new] for x in ids], [len(x) > max_new for x in ids])


def engine_for(tiny, family: str, tools: list[Tool] | None = None):
    model, processor, fam = tiny(family)
    enc = PromptEncoder(processor, fam)
    stop = eos_ids(model, processor.tokenizer)
    if tools is None:
        tools = resolve_tools([ToolSettings(name="image_zoom_in"), ToolSettings(name="image_rotate")], None, None)
    return model, processor, fam, enc, MultiTurnEngine(enc, processor.tokenizer, fam, tools, None, stop), stop


LIMITS = TurnLimits(4, 8, 1000)


def rollouts(engine, enc, fam, samples, g, script, limits=LIMITS):
    encoded = [enc.encode(s) for s in samples]
    prompts = collate(encoded, fam, enc.processor.tokenizer.pad_token_id)
    return multi_turn(engine, None, samples, encoded, prompts, g, limits, script, lambda b: None, lambda b: b)


def two_turns(tiny, family, tools=None):
    """Rollout 0 zooms, then rotates the crop, then answers; rollout 1 answers at once."""
    model, processor, fam, enc, engine, stop = engine_for(tiny, family, tools)
    script = Script(
        processor.tokenizer, sorted(stop)[0], [[ZOOM, "<answer>2</answer>"], [ROTATE], ["<answer>3</answer>"]]
    )
    batch, trajs = rollouts(engine, enc, fam, [sample()], 2, script)
    return model, processor, fam, enc, batch, trajs, script


def plain_logps(model, processor, fam, enc, traj) -> tuple[torch.Tensor, list[int]]:
    """The generated tokens' log-probs from one plain forward over the whole conversation, rendered by the chat
    template and encoded by the processor in one call with every image (no cache, no prefix, no Collage batch)."""
    messages = list(traj.sample.prompt)
    turns = traj.turns
    k = 0
    from collage.training.tools.turns import TurnRenderer

    fallback = TurnRenderer(processor).fallback
    while k < len(turns):
        turn = turns[k]
        messages.append({"role": "assistant", "content": [{"type": "text", "text": turn.text}]})
        k += 1
        while k < len(turns) and turns[k].role == "tool":
            t = turns[k]
            result = ToolResult(t.text if t.error is None else "", list(t.images), t.error)
            messages.append(tool_message(t.tool_call or ToolCall("", {}), result, fallback))
            k += 1
    text = processor.apply_chat_template(messages, tokenize=False)
    out = processor(text=[text], images=[list(traj.images)], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    ours = traj.prompt.input_ids + traj.tail
    if ids[: len(ours)] != ours:
        # the text the model generated, tokenised again beside the template's text, may merge differently (LLaVA's
        # "ASSISTANT:<tool_call>"); generation and the loss keep the generated ids, so the forward takes ours, with
        # the processor's pixels of the whole conversation; its image tokens must be the same
        image = enc.image_token_id
        assert [t for t in ids if t == image] == [t for t in ours if t == image], "image tokens differ"
    kwargs = {k: v for k, v in out.items() if k != "input_ids"}
    full = torch.tensor([ours])
    kwargs["attention_mask"] = torch.ones_like(full)
    kwargs.update(extra_inputs(full, collate([traj.as_prompt(fam)], fam, 0), fam, enc.image_token_id))
    if fam.layout == "grid":
        kwargs["mm_token_type_ids"] = (full == enc.image_token_id).long()
    kwargs = {
        k: v[:, : full.shape[1]] if k in ("token_type_ids", "mm_token_type_ids") else v for k, v in kwargs.items()
    }
    with torch.no_grad():
        logits = model(input_ids=full, **kwargs).logits[0].float()
    p = len(traj.prompt.input_ids)
    logps = torch.log_softmax(logits[p - 1 : -1], dim=-1).gather(1, torch.tensor(traj.tail)[:, None])[:, 0]
    return logps, traj.generated


@pytest.mark.parametrize("family", FAMILIES)
def test_trajectory_tokens_mask_and_logprobs(tiny, family):
    model, processor, fam, enc, batch, trajs, script = two_turns(tiny, family)
    zoomed, direct = trajs
    assert [t.role for t in zoomed.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert zoomed.tool_calls == 2 and zoomed.tool_errors == 0 and len(zoomed.images) == 3
    assert [t.role for t in direct.turns] == ["assistant"] and direct.tool_calls == 0
    assert script.batches == [2, 1, 1]  # the finished rollout takes no compute in later turns
    assert batch.num_images == [3, 1] and batch.tool_images == [2, 0]
    # the loss counts exactly the generated tokens: three turns of text + EOS each, no template or tool token
    generated = [len(processor.tokenizer.encode(t, add_special_tokens=False)) + 1
                 for t in (ZOOM, ROTATE, "<answer>3</answer>")]  # fmt: skip
    assert int(batch.completion_mask[0].sum()) == sum(generated) == sum(zoomed.generated)
    width = batch.completion_mask.shape[1]
    assert batch.completion_mask[0].tolist() == zoomed.generated + [0] * (width - len(zoomed.tail))
    logps, _ = completion_logprobs_and_entropy(model, batch, fam, enc.image_token_id, 1.0)
    naive, flags = plain_logps(model, processor, fam, enc, zoomed)
    own = torch.tensor(flags, dtype=torch.bool)
    assert torch.allclose(logps[0, : len(flags)][own], naive[own], atol=TOL), family
    # a generated token changed: the loss changes; the loss never reads a tool or template token's log-prob
    loss = -(logps * batch.completion_mask).sum()
    poked = logps.clone()
    poked[batch.completion_mask == 0] += 5.0
    assert -(poked * batch.completion_mask).sum() == loss
    flipped = batch.input_ids.clone()
    first_generated = batch.prompt_length + zoomed.generated.index(1)
    flipped[0, first_generated] = (flipped[0, first_generated] + 1) % 50
    changed, _ = completion_logprobs_and_entropy(model, type(batch)(**{**batch.__dict__, "input_ids": flipped}),
                                                 fam, enc.image_token_id, 1.0)  # fmt: skip
    assert not torch.allclose(-(changed * batch.completion_mask).sum(), loss)


def inverted_zoom(bbox_2d, image=None, label=None, *, images, coords="pixel", max_side=None):
    result = image_zoom_in(bbox_2d, image, label, images=images, coords=coords, max_side=max_side)
    result.images[0].image = ImageOps.invert(result.images[0].image)
    return result


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_image_reaches_the_model(tiny, family):
    """The canary: the crop's pixels repainted (same size, so the same tokens), the turn after it moves."""
    base = resolve_tools([ToolSettings(name="image_zoom_in"), ToolSettings(name="image_rotate")], None, None)
    swapped = [Tool("image_zoom_in", inverted_zoom, base[0].schema, 10.0, base[0].fixed), base[1]]
    model, _, fam, enc, batch, trajs, _ = two_turns(tiny, family)
    _, _, _, _, other, other_trajs, _ = two_turns(tiny, family, swapped)
    assert batch.input_ids.tolist() == other.input_ids.tolist()  # the same tokens: only pixels differ
    a, _ = completion_logprobs_and_entropy(model, batch, fam, enc.image_token_id, 1.0)
    b, _ = completion_logprobs_and_entropy(model, other, fam, enc.image_token_id, 1.0)
    mask = batch.completion_mask.bool()
    gen = trajs[0].generated
    after_zoom = [i for i in range(len(gen)) if gen[i] and i > gen.index(0)]
    diff = (a[0] - b[0]).abs()
    assert float(diff[after_zoom].max()) > CANARY_MARGIN, f"{family}: the crop's pixels do not reach the model"
    first_turn = [i for i in range(gen.index(0)) if gen[i]]
    assert float(diff[first_turn].max()) <= TOL  # the turn before the tool cannot see it
    assert float((a[1] - b[1]).abs()[mask[1]].max()) <= TOL  # the rollout without a tool is untouched


def test_crop_pixels_equal_a_pil_crop():
    img = scene()
    result = image_zoom_in([30, 10, 80, 70], images=[img])
    crop = result.images[0].image
    assert crop.tobytes() == img.crop((30, 10, 80, 70)).tobytes()
    assert result.images[0].source == {"image": 0, "bbox_2d": [30, 10, 80, 70]}
    clamped = image_zoom_in([50, 40, 500, 500], images=[img])  # runs off the image: clamped to it
    assert clamped.images[0].source["bbox_2d"] == [50, 40, 96, 80]
    normal = image_zoom_in([0.25, 0.25, 0.75, 0.75], images=[img], coords="normalised")
    assert normal.images[0].source["bbox_2d"] == [24, 20, 72, 60]
    big = Image.new("RGB", (2000, 1000))
    assert max(image_zoom_in([0, 0, 2000, 1000], images=[big], max_side=512).images[0].image.size) == 512
    with pytest.raises(ValueError, match="at least 28 px"):
        image_zoom_in([0, 0, 20, 20], images=[img])


def slow_tool(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


def broken_tool(x: int) -> str:
    """Raises.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"broken on {x}")


OUTCOMES = [
    ('<tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [1, 2, 3</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "image_zoom_in"', "no closing </tool_call>"),
    ('<tool_call>{"name": "teleport", "arguments": {}}</tool_call>', "unknown tool 'teleport'"),
    ('<tool_call>{"name": "image_zoom_in", "arguments": {}}</tool_call>', "missing argument bbox_2d"),
    ('<tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": "all"}}</tool_call>', "must be array"),
    ('<tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [0, 0, 10, 10]}}</tool_call>', "at least 28 px"),
    (
        '<tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [0, 0, 50, 50], "image": 7}}</tool_call>',
        "image must be an image number from 0 to 0",
    ),
    ('<tool_call>{"name": "broken_tool", "arguments": {"x": 4}}</tool_call>', "RuntimeError: broken on 4"),
    ('<tool_call>{"name": "slow_tool", "arguments": {"seconds": 30}}</tool_call>', "timed out after 0.2 s"),
]


@pytest.mark.parametrize(("call", "error"), OUTCOMES)
def test_every_failed_call_is_a_tool_error_the_model_sees(tiny, call, error):
    tools = resolve_tools([ToolSettings(name="image_zoom_in")], None, None)
    tools += [Tool("broken_tool", broken_tool, tool_schema(broken_tool), 5.0),
              Tool("slow_tool", slow_tool, tool_schema(slow_tool), 0.2)]  # fmt: skip
    _, processor, fam, enc, engine, stop = engine_for(tiny, "qwen2-vl", tools)
    script = Script(processor.tokenizer, sorted(stop)[0], [[call], ["<answer>3</answer>"]])
    batch, (traj,) = rollouts(engine, enc, fam, [sample()], 1, script)
    assert [t.role for t in traj.turns] == ["assistant", "tool", "assistant"]
    tool_turn = traj.turns[1]
    assert tool_turn.error is not None and error in tool_turn.error, tool_turn.error
    assert traj.tool_calls == 1 and traj.tool_errors == 1 and not traj.images[1:]
    # the model is shown the error as the tool's answer
    assert ("Error: " + tool_turn.error)[:30] in processor.tokenizer.decode(traj.tail)
    assert traj.completion_text == "<answer>3</answer>" and not traj.truncated


def test_limits_end_a_rollout(tiny):
    _, processor, fam, enc, engine, stop = engine_for(tiny, "qwen2-vl")
    eos = sorted(stop)[0]
    # max_tool_calling_iterations: the call after the last allowed one ends the rollout, capped
    script = Script(processor.tokenizer, eos, [[ZOOM], [ZOOM], [ZOOM]])
    _, (traj,) = rollouts(engine, enc, fam, [sample()], 1, script, TurnLimits(2, 8, 1000))
    assert traj.tool_calls == 2 and traj.capped and traj.done and not traj.truncated and script.calls == 3
    # a tool result that would pass max_completion_length is dropped and the rollout ends, truncated
    script = Script(processor.tokenizer, eos, [[ZOOM]])
    n = len(processor.tokenizer.encode(ZOOM, add_special_tokens=False)) + 1
    _, (traj,) = rollouts(engine, enc, fam, [sample()], 1, script, TurnLimits(4, 8, n + 5))
    assert traj.truncated and traj.tool_calls == 0 and len(traj.tail) == n and all(traj.generated)
    # the image cap: a call past it is a tool error, not a new image
    again = ZOOM.replace('"arguments": {', '"arguments": {"image": 0, ')
    script = Script(processor.tokenizer, eos, [[ZOOM], [again], ["<answer>1</answer>"]])
    _, (traj,) = rollouts(engine, enc, fam, [sample()], 1, script, TurnLimits(4, 2, 1000))
    assert len(traj.images) == 2 and traj.tool_errors == 1 and "image limit" in traj.turns[3].error


def test_onevision_refused_with_tools():
    from collage.training.config import RunConfig
    from collage.training.models.families import FAMILIES
    from collage.training.tools.multiturn import build_engine
    from collage.training.tools.registry import UnknownToolError

    config = RunConfig.model_validate({"tools": [{"name": "image_zoom_in"}]})

    class Stub:
        processor = None

    with pytest.raises(UnknownToolError, match="llava-onevision"):
        build_engine(config, Stub(), None, FAMILIES["llava-onevision"], None, set())  # type: ignore[arg-type]


def test_an_environment_keeps_state_per_rollout_and_rewards_it(tiny):
    from collage.training.rewards import resolve_reward, score
    from collage.training.rollout import reward_batch
    from collage.training.tools.registry import resolve_environment

    env = resolve_environment("tests.support.tool_env:LockEnv", ["tests.support.tool_env"])
    model, processor, fam = tiny("qwen2-vl")
    enc = PromptEncoder(processor, fam)
    stop = eos_ids(model, processor.tokenizer)
    engine = MultiTurnEngine(enc, processor.tokenizer, fam, [], env, stop)
    assert engine.tool_names == ["try_code"]
    right = '<tool_call>{"name": "try_code", "arguments": {"code": 3}}</tool_call>'
    wrong = '<tool_call>{"name": "try_code", "arguments": {"code": 5}}</tool_call>'
    script = Script(processor.tokenizer, sorted(stop)[0], [[right, wrong], ["<answer>done</answer>"]])
    _, trajs = rollouts(engine, enc, fam, [sample()], 2, script)
    assert [t.turns[1].text for t in trajs] == ["open", "still locked"]
    assert trajs[0].environment is not trajs[1].environment  # one instance per rollout
    repeated = [t.sample for t in trajs]
    values = score([resolve_reward("environment_reward")],
                   reward_batch(repeated, [t.completion_text for t in trajs], [[1]] * 2, trajs))  # fmt: skip
    assert values == [[1.0], [0.0]]


def test_allowlist_holds_on_the_worker_side():
    """What the API refuses at submit, the worker's resolution refuses again, before importing anything."""
    from collage.training.tools.registry import UnknownToolError, resolve_environment

    with pytest.raises(UnknownToolError, match="not allowlisted for tools"):
        resolve_tools([ToolSettings(name="tests.support.tool_env:shout")], [], None)
    with pytest.raises(UnknownToolError, match="never provides tools"):
        resolve_tools([ToolSettings(name="os:system")], ["os"], None)
    with pytest.raises(UnknownToolError, match="not allowlisted for tools"):
        resolve_environment("tests.support.tool_env:LockEnv", ["tests.support.other"])
    with pytest.raises(UnknownToolError, match="not a function"):
        resolve_tools([ToolSettings(name="tests.support.tool_env:LockEnv")], ["tests.support.tool_env"], None)
    (shout,) = resolve_tools([ToolSettings(name="tests.support.tool_env:shout")], ["tests.support.tool_env"], None)
    assert shout.schema["function"]["parameters"]["required"] == ["text"]


def test_a_tool_argument_is_never_a_path():
    """The built-ins act on the rollout's images in memory: an argument naming a file is only a wrong argument."""
    from collage.training.tools.runner import run_tool_call

    tools = resolve_tools([ToolSettings(name="image_zoom_in")], None, None)
    call = ToolCall("image_zoom_in", {"bbox_2d": [0, 0, 50, 50], "image": "/etc/passwd"})
    result = run_tool_call(call, tools, [scene()], {})
    assert result.error is not None and "image must be integer" in result.error and not result.images


@pytest.mark.parametrize(("family", "side"), [("qwen2-vl", 1001), ("idefics3", 112), ("smolvlm", 224), ("llava", None)])
def test_a_crop_is_shrunk_to_what_the_processor_takes(tiny, family, side):
    """The processors' own limits (transformers 5 keeps ``size`` as a SizeDict): Qwen-VL's pixel budget as a
    square's side, Idefics3/SmolVLM's longest edge, none for processors that resize every image anyway."""
    from collage.training.tools.multiturn import processor_max_side

    _, processor, fam = tiny(family)
    assert processor_max_side(processor, fam) == side
    (zoom,) = resolve_tools([ToolSettings(name="image_zoom_in")], None, processor_max_side(processor, fam))
    big = Image.new("RGB", (1400, 1400), (10, 200, 30))
    result = zoom.fn([0, 0, 1300, 650], images=[big], **zoom.fixed)
    expected = (1300, 650) if side is None or side >= 1300 else (side, round(650 * side / 1300))
    assert result.images[0].image.size == expected
