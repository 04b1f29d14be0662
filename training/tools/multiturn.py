"""Multi-turn rollouts: the model generates, calls tools, sees their results (text and images), and goes on.

Turn by turn, for a generation batch's prompts:

1. The first turn is the single-turn engine's: each distinct prompt (with its images) is prefilled once and its KV
   cache forked to its ``num_generations`` rollouts (:func:`training.generation.generate`).
2. Every rollout whose turn called a tool (``<tool_call>{json}</tool_call>``, :mod:`training.tools.calls`) has the
   calls run (:mod:`training.tools.runner`); their results are rendered through the chat template and the processor
   as the next tokens of that rollout (:mod:`training.tools.turns`), the tool images appended to its images. A
   rollout ends on a turn without a call, on its length budget (``max_completion_length`` counts every assistant
   and tool token), or when ``max_tool_calling_iterations`` calls are used up.
3. The rollouts still going are generated from together, one completion each; finished rollouts leave the batch
   and take no compute. With the built-in generation backend each later turn continues from the KV cache of the
   turns before it (:func:`training.generation.resume`): only the tool turn's tokens are run through the model, and
   each tool image is encoded once, when its turn is prefilled. A backend that keeps no cache (``generate`` returns
   no ``state``) gets each later turn as a fresh prompt: the whole conversation so far, re-prefilled.

The result, per rollout: every token after the prompt (``tail``) with a flag per token saying whether the model
generated it (``generated``: the loss, old-policy, reference log-probs, KL and entropy count only those, TRL's
``tool_mask``), the pixels of the tool images, and the trajectory a person reads and rewards see.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..batching.batch import collate
from ..batching.encoding import EncodedPrompt, PromptEncoder
from ..batching.layouts import Pixels, concat_sample_pixels, pixel_key
from ..data.rows import Sample
from ..generation import Completions
from ..models.families import Family
from .calls import parse_tool_calls
from .registry import (
    Tool,
    UnknownToolError,
    environment_methods,
    environment_tools,
    resolve_environment,
    resolve_tools,
    tool_schema,
)
from .runner import run_tool_call
from .turns import TurnRenderer
from .types import ToolCall, ToolResult, Turn

# generate(batch of distinct prompts on the device, completions per prompt, max new tokens) -> Completions
Generate = Callable[[Any, int, int], Completions]
# resume(the previous turn's state, the rows of it that go on, their new tokens collated as prompts on the device,
# max new tokens) -> Completions: one completion per row, continuing from the cache (training.generation.resume)
Resume = Callable[[Any, list[int], Any, int], Completions]


@dataclass(frozen=True)
class TurnLimits:
    """How far a rollout may go (``train`` keys of the same names)."""

    max_tool_calling_iterations: int
    max_images_per_rollout: int
    max_completion_length: int


@dataclass
class Trajectory:
    """One multi-turn rollout. ``tail``: every token after the prompt; ``generated[i]``: whether the model generated
    ``tail[i]``; ``parts``: each tool turn's pixels; ``images``: every image of the conversation, the row's first."""

    sample: Sample
    prompt: EncodedPrompt
    tools: list[Tool]
    environment: Any = None
    tail: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    parts: list[Pixels] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    calls_by_tool: dict[str, int] = field(default_factory=dict)
    done: bool = False
    truncated: bool = False  # the length budget ran out (no final answer)
    capped: bool = False  # it still called a tool when max_tool_calling_iterations ran out
    segment: EncodedPrompt | None = None  # its last tool turn (ids and pixels), until the next turn is generated

    @property
    def tool_image_count(self) -> int:
        return len(self.images) - self.sample.num_images

    @property
    def completion_text(self) -> str:
        """The final assistant text (a rollout row's ``completion``)."""
        return next((t.text for t in reversed(self.turns) if t.role == "assistant"), "")

    @property
    def generated_ids(self) -> list[int]:
        return [t for t, g in zip(self.tail, self.generated, strict=True) if g]

    def context(self, family: Family) -> EncodedPrompt:
        """The conversation so far as one prompt to generate from (or, finished, as the loss forward's prompt)."""
        pixels = concat_sample_pixels(family.layout, [self.prompt.pixels, *self.parts])
        n = len(self.images)
        return EncodedPrompt(self.prompt.row, self.prompt.input_ids + self.tail, pixels, n,
                             self.prompt.num_image_tokens, 0, pixel_key(pixels, n))  # fmt: skip

    def as_prompt(self, family: Family) -> EncodedPrompt:
        """The row's prompt with every image of the finished rollout (its tool images lie in the completion)."""
        pixels = concat_sample_pixels(family.layout, [self.prompt.pixels, *self.parts])
        n = len(self.images)
        return EncodedPrompt(self.prompt.row, self.prompt.input_ids, pixels, n, self.prompt.num_image_tokens,
                             self.prompt.truncated_tokens, pixel_key(pixels, n))  # fmt: skip


class MultiTurnEngine:
    """Runs multi-turn rollouts for one model. ``tools``: the run's tools; ``environment``: an environment class
    (one instance per rollout, its methods tools beside ``tools``) or None."""

    def __init__(
        self,
        encoder: PromptEncoder,
        tokenizer: Any,
        family: Family,
        tools: Sequence[Tool],
        environment: type | None,
        stop_ids: set[int],
    ):
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.family = family
        self.tools = list(tools)
        self.environment = environment
        self.stop_ids = stop_ids
        self.renderer = TurnRenderer(encoder.processor)

    @property
    def tool_names(self) -> list[str]:
        """Every tool the model may call, in a fixed order (the run's, then the environment's methods)."""
        names = [t.name for t in self.tools]
        if self.environment is not None:
            names += [m.__name__ for m in environment_methods(self.environment)]
        return names

    def start(self, sample: Sample, prompt: EncodedPrompt) -> Trajectory:
        tools = list(self.tools)
        env = None
        if self.environment is not None:
            env = self.environment()
            env.reset({"prompt": sample.prompt, **sample.columns})  # its return value is not used (docs/tools.md)
            tools += environment_tools(env)
        return Trajectory(sample, prompt, tools, env, images=list(sample.images))

    def run(
        self,
        samples: Sequence[Sample],
        prompts: Sequence[EncodedPrompt],
        num_generations: int,
        limits: TurnLimits,
        first_turn: Completions,
        generate: Generate,
        to_device: Callable[[Any], Any],
        resume: Resume | None = None,
    ) -> list[Trajectory]:
        """Rollouts of ``samples`` (``prompts``: each encoded once), prompt-major, their first turn already sampled
        (``first_turn``: ``num_generations`` completions per prompt). Later turns continue from the previous turn's
        cache with ``resume`` when the turn before left a ``state``, else ``generate`` samples them from the whole
        conversation."""
        trajectories = [self.start(s, p) for s, p in zip(samples, prompts, strict=True) for _ in range(num_generations)]
        self._take_turn(trajectories, first_turn, limits)
        pad = self.tokenizer.pad_token_id
        rows, state = trajectories, first_turn.state  # rows: the trajectories of the state's rows, in order
        while active := [t for t in trajectories if not t.done]:
            budget = max(limits.max_completion_length - len(t.tail) for t in active)
            if state is not None and resume is not None:
                position = {id(t): r for r, t in enumerate(rows)}
                kept = [position[id(t)] for t in active]
                segments = [self._segment(t, state.pending[r]) for t, r in zip(active, kept, strict=True)]
                batch = to_device(collate(segments, self.family, pad))
                completions = resume(state, kept, batch, budget)
            else:
                batch = to_device(collate([t.context(self.family) for t in active], self.family, pad))
                completions = generate(batch, 1, budget)
            rows, state = active, completions.state
            self._take_turn(active, completions, limits)
        return trajectories

    @staticmethod
    def _segment(traj: Trajectory, pending: list[int]) -> EncodedPrompt:
        """What a rollout's next turn adds to its cache: the tokens of its last turn not cached yet, then its tool
        turn, with the tool turn's images."""
        assert traj.segment is not None
        seg = traj.segment
        ids = list(pending) + seg.input_ids
        return EncodedPrompt(seg.row, ids, seg.pixels, seg.num_images, seg.num_image_tokens, 0, seg.image_key)

    def _take_turn(self, trajectories: list[Trajectory], completions: Completions, limits: TurnLimits) -> None:
        for traj, ids, truncated in zip(trajectories, completions.ids, completions.truncated, strict=True):
            room = limits.max_completion_length - len(traj.tail)
            if len(ids) > room:
                ids, truncated = ids[:room], True
            self._extend(traj, ids, generated=True)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            # calls are read with special tokens kept: a tokenizer may make <tool_call> a special token
            raw = self.tokenizer.decode([i for i in ids if i not in self.stop_ids], skip_special_tokens=False)
            calls = parse_tool_calls(raw) if not truncated else []
            traj.turns.append(Turn("assistant", text, calls[0] if calls else None))
            if truncated:
                traj.done = traj.truncated = True
            elif not calls:
                traj.done = True
            else:
                self._call_tools(traj, calls, ids, limits)

    def _extend(self, traj: Trajectory, ids: list[int], generated: bool) -> None:
        traj.tail.extend(ids)
        traj.generated.extend([1 if generated else 0] * len(ids))

    def _call_tools(self, traj: Trajectory, calls: list[ToolCall], ids: list[int], limits: TurnLimits) -> None:
        left = limits.max_tool_calling_iterations - traj.tool_calls
        if left <= 0:
            traj.done = traj.capped = True
            return
        calls = calls[:left]
        images = list(traj.images)  # a later call of the same turn may act on an earlier call's image
        results = []
        for call in calls:
            result = run_tool_call(call, traj.tools, images, traj.sample.columns)
            if result.error is None and len(images) + len(result.images) > limits.max_images_per_rollout:
                result = ToolResult(
                    error=f"image limit reached: a rollout holds at most {limits.max_images_per_rollout} images"
                )
            images.extend(im.image for im in result.images)
            results.append(result)
        eos = self.tokenizer.decode(ids[-1:]) if ids and ids[-1] in self.stop_ids else ""
        text = self.renderer.text(calls, results, eos)
        new_images = images[len(traj.images) :]
        seg_ids, pixels = self.encoder.encode_segment(text, new_images, traj.sample.row)
        if len(traj.tail) + len(seg_ids) >= limits.max_completion_length:
            # TRL drops a tool result that would pass the length limit, and the rollout ends there
            traj.done = traj.truncated = True
            return
        self._extend(traj, seg_ids, generated=False)
        if pixels:
            traj.parts.append(pixels)
        n_new = len(new_images)
        traj.segment = EncodedPrompt(
            traj.sample.row, seg_ids, pixels, n_new, 0, 0, pixel_key(pixels, n_new) if n_new else None
        )
        traj.images = images
        for call, result in zip(calls, results, strict=True):
            traj.tool_calls += 1
            name = call.name or "(malformed)"
            traj.calls_by_tool[name] = traj.calls_by_tool.get(name, 0) + 1
            traj.tool_errors += result.error is not None
            text = result.error if result.error is not None else result.text
            traj.turns.append(Turn("tool", text, call, list(result.images), result.error))


def processor_max_side(processor: Any, family: Family) -> int | None:
    """The longest image side the processor takes without shrinking it: Qwen-VL's ``max_pixels`` as a square's
    side, Idefics3/SmolVLM's ``longest_edge``; None for processors that resize every image to a fixed size anyway
    (LLaVA, Gemma 3, InternVL's tiles), where a crop needs no limit of its own."""
    ip = getattr(processor, "image_processor", None)
    longest = _size_field(getattr(ip, "size", None), "longest_edge")
    if family.layout == "grid":  # Qwen-VL keeps its pixel budget as max_pixels, or as size's longest_edge
        pixels = getattr(ip, "max_pixels", None) or longest
        return int(pixels**0.5) if pixels else None
    if family.layout == "batch_padded" and longest:
        return int(longest)
    return None


def _size_field(size: Any, key: str) -> Any:
    """One field of an image processor's ``size``: a dict, or transformers 5's ``SizeDict`` (attributes)."""
    if size is None:
        return None
    if isinstance(size, dict):
        return size.get(key)
    return getattr(size, key, None)


def resolve_run_tools(
    config: Any, encoder: PromptEncoder, family: Family, tool_modules: Sequence[str] | None
) -> tuple[list[Tool], type | None]:
    """The run's tools and environment class, resolved under the allowlist, their schemas handed to the encoder
    (so prompts are checked and encoded with the tools the template shows). Raises
    :class:`~training.tools.registry.UnknownToolError` naming one that may not run."""
    if not config.uses_tools:
        return [], None
    if "batch_num_images" in family.extra_inputs:
        raise UnknownToolError(
            f"tools: not supported for {family.name}: its processor lays out a lone image (anyres patches) unlike one "
            "among several, so a tool image would change how the prompt's own image is tokenised"
        )
    tools = resolve_tools(config.tools, tool_modules, processor_max_side(encoder.processor, family))
    environment = resolve_environment(config.environment, tool_modules)
    schemas = [t.schema for t in tools]
    if environment is not None:
        schemas += [tool_schema(m, m.__name__) for m in environment_methods(environment)]
    encoder.tools = schemas
    return tools, environment


def build_engine(
    config: Any,
    encoder: PromptEncoder,
    tokenizer: Any,
    family: Family,
    tool_modules: Sequence[str] | None,
    stop_ids: set[int],
) -> MultiTurnEngine | None:
    """The run's multi-turn engine, or None without tools (see :func:`resolve_run_tools`)."""
    if not config.uses_tools:
        return None
    tools, environment = resolve_run_tools(config, encoder, family, tool_modules)
    return MultiTurnEngine(encoder, tokenizer, family, tools, environment, stop_ids)
