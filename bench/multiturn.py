"""What a multi-turn rollout's later turns cost: continuing from the KV cache against re-prefilling each turn.

A 3-turn rollout (zoom, zoom again, answer) of ``G`` rollouts of one prompt, through Collage's own turn loop
(``training.rollout.multi_turn``, the real ``generate``, the real tool, the real processor):

- **continued** (Collage): each later turn runs only its new tokens (the tool turn, its crop) on top of the cache of
  the turns before (``training.generation.resume``);
- **re-prefilled**: each later turn is generated from the whole conversation so far as a fresh prompt, its prefill
  (image and earlier crops included) run again: what TRL 1.16's tool loop does (``_generate_single_turn`` on the
  concatenated ids) and what Collage does with a backend that keeps no cache;
- **one generation** of the same number of generated tokens from the prompt: a floor that leaves out the tool turns'
  own tokens and crops, which any continuation still has to prefill.

Every side generates the same tokens: a logits processor forces each turn's text (``--tokens`` tokens of thought,
then the call; the answer last), so the model's compute, not its random choices, is measured. Method: the ``mid``
model of bench/models.py (about 12M parameters: its compute dominates), a 336 px image, greedy; interleaved
rounds (the order rotates each repetition), ``--reps`` of them, one pinned thread, median CPU time
(``time.process_time``) and wall time of each side.

    .venv/bin/python -m bench.multiturn --tokens 48 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("COLLAGE_HOME", str(Path(tempfile.gettempdir()) / "collage-bench-home"))

import torch
from PIL import Image
from transformers import LogitsProcessor, LogitsProcessorList

from bench.models import model_path
from collage.training.batching.batch import collate
from collage.training.batching.encoding import PromptEncoder
from collage.training.config import ToolSettings
from collage.training.data.rows import Sample
from collage.training.generation import Sampling, eos_ids
from collage.training.generation import backend as generation_backend
from collage.training.models.loading import load_model, load_processor
from collage.training.rollout import multi_turn, turn_samplers
from collage.training.tools.multiturn import MultiTurnEngine, TurnLimits
from collage.training.tools.registry import resolve_tools

ZOOMS = (
    '<tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [40, 40, 240, 240]}}</tool_call>',
    '<tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [10, 10, 110, 110]}}</tool_call>',
)


class Force(LogitsProcessor):
    """Makes every row write ``script`` (token ids, EOS last), whatever the model would."""

    def __init__(self, script: list[int]):
        self.script, self.step = script, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, float("-inf"))
        out[:, self.script[min(self.step, len(self.script) - 1)]] = 0.0
        self.step += 1
        return out


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--model", default="mid")
    args.add_argument("--tokens", type=int, default=48, help="tokens of thought before each turn's call")
    args.add_argument("--rollouts", type=int, default=4, help="rollouts of the prompt (G)")
    args.add_argument("--reps", type=int, default=5)
    opts = args.parse_args()
    torch.set_num_threads(1)
    path = model_path(opts.model, Path(os.environ["COLLAGE_HOME"]) / "bench-models")
    processor, fam = load_processor(str(path))
    model = load_model(str(path), "float32").eval()
    tok = processor.tokenizer
    stop = eos_ids(model, tok)
    eos = sorted(stop)[0]
    enc = PromptEncoder(processor, fam)
    tools = resolve_tools([ToolSettings(name="image_zoom_in")], None, None)
    engine = MultiTurnEngine(enc, tok, fam, tools, None, stop)
    image = Image.effect_noise((336, 336), 64).convert("RGB")
    sample = Sample(0, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
                    [image], {})  # fmt: skip
    encoded = enc.encode(sample)
    prompts = collate([encoded], fam, tok.pad_token_id)
    thought = tok.encode(" look" * opts.tokens, add_special_tokens=False)[: opts.tokens]
    scripts = [thought + tok.encode(z, add_special_tokens=False) + [eos] for z in ZOOMS]
    scripts.append(thought + tok.encode("<answer>1</answer>", add_special_tokens=False) + [eos])
    limits = TurnLimits(4, 8, 8192)
    original = model.generate
    calls = [0]

    def forced(*a, **kw):  # each call of generate writes the next turn's script
        script = scripts[min(calls[0], len(scripts) - 1)]
        calls[0] += 1
        kw["logits_processor"] = LogitsProcessorList([Force(script)])
        return original(*a, **kw)

    model.generate = forced
    sampling = Sampling(greedy=True)
    hf = generation_backend("hf")
    g = opts.rollouts

    def rollout(cached: bool) -> list:
        calls[0] = 0
        generate, resume = turn_samplers(hf, model, fam, tok, enc.image_token_id, enc.protected, sampling)
        if not cached:

            def generate(batch, n, max_new, features):
                return hf(model, batch, n, fam, tok, enc.image_token_id, enc.protected, max_new, sampling, features)

            resume = None
        _, trajs = multi_turn(engine, model, [sample], [encoded], prompts, g, limits, generate, lambda b: None,
                              lambda b: b, resume)  # fmt: skip
        return trajs

    generated = sum(len(s) for s in scripts)

    def single() -> None:
        calls[0] = len(scripts)  # the answer's script, long enough: force the same count of tokens
        model.generate = lambda *a, **kw: original(*a, **{**kw, "min_new_tokens": generated})
        try:
            hf(model, prompts, g, fam, tok, enc.image_token_id, enc.protected, generated, sampling)
        finally:
            model.generate = forced

    with torch.no_grad():
        first, second = rollout(True), rollout(False)
        assert [t.tail for t in first] == [t.tail for t in second], "both sides must generate the same rollouts"
        assert all(t.tool_calls == 2 for t in first), [t.tool_calls for t in first]
        sides = {"continued (Collage)": lambda: rollout(True), "re-prefilled (TRL 1.16)": lambda: rollout(False),
                 "one generation, same generated count": single}  # fmt: skip
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
        names = list(sides)
        for rep in range(opts.reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                cpu, wall = time.process_time(), time.perf_counter()
                sides[name]()
                times[name].append((time.process_time() - cpu, time.perf_counter() - wall))
    report(opts, encoded, scripts, first[0], generated, times)


def report(opts, encoded, scripts, traj, generated: int, times: dict[str, list[tuple[float, float]]]) -> None:
    g = opts.rollouts
    print(f"model {opts.model}, {g} rollouts, prompt {len(encoded.input_ids)} tokens, 3 turns of {[len(s) for s in scripts]} "
          f"generated tokens, tool turns {len(traj.tail) - generated} tokens in all (2 crops), {opts.reps} rounds, 1 thread")  # fmt: skip
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in times.items()}
    for name, (cpu, wall) in med.items():
        print(f"  {name}: CPU {cpu:.3f} s, wall {wall:.3f} s (median)")
    base = med["continued (Collage)"][0]
    print(f"  re-prefilled / continued (CPU): {med['re-prefilled (TRL 1.16)'][0] / base:.2f}")
    print(f"  continued / one generation (CPU): {base / med['one generation, same generated count'][0]:.2f}")


if __name__ == "__main__":
    main()
