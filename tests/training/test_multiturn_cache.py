"""A multi-turn rollout's later turns continue from the KV cache of the turns before them
(``training.generation.resume``), on every tiny family that supports tools: the model's distribution at every
generated token is the one a fresh prefill of the whole conversation gives (tool images, tiles, separators and
Qwen-VL's 3-D positions included), rollouts batched together see what each sees alone, and the continuation runs
fewer tokens through the model than re-prefilling. (Gemma 3, whose local layers attend over a window of columns,
is the documented exception: its later turns are prefilled afresh, and give the same distribution that way.)

The real model generates (the real ``generate``, cache and processor); a logits processor records the model's
log-probs at each step and then forces a scripted token, so the rollouts call tools (a tiny random model never
writes a call by itself) while every score comes from the model."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from collage.training.batching.batch import collate
from collage.training.batching.forward import base_model
from collage.training.data.rows import Sample
from collage.training.generation import Sampling, backend
from collage.training.rollout import multi_turn, turn_samplers
from tests.training.test_multiturn import FAMILIES, LIMITS, ROTATE, ZOOM, engine_for, scene

TOL = 1e-4  # float32 log-probs of a cached vs an uncached attention: the order of the sums differs
ZOOM_WIDE = '<tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [0, 0, 90, 76], "label": "all"}}</tool_call>'
SCRIPTS = {  # per question, the text of each of its turns: different lengths, so rows pad and finish apart
    "alpha": [ZOOM, ROTATE, "<answer>2</answer>"],
    "bravo": ["<answer>7</answer>"],
    "charlie": [ZOOM_WIDE, "the digit is <answer>4</answer>"],
}


def question(word: str, row: int) -> Sample:
    text = f"Question {word}: what is in the box?"
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return Sample(row, prompt, [scene()], {"answer": "3"})


class Recorder:
    """Wraps ``model.generate``: every call gets a logits processor that records each row's log-probs and then
    forces that row's scripted token. A row is told apart by its question word, its turn by how many calls it was
    in before."""

    def __init__(self, model, tokenizer, eos: int):
        self.tokenizer, self.eos = tokenizer, eos
        self.scripts = {
            word: [tokenizer.encode(t, add_special_tokens=False) + [eos] for t in turns]
            for word, turns in SCRIPTS.items()
        }
        self.turns: dict[str, int] = defaultdict(int)
        self.logps: dict[tuple[str, int], list[torch.Tensor]] = defaultdict(list)
        self.original = model.generate

    def generate(self, *args, **kwargs):
        kwargs["logits_processor"] = LogitsProcessorList([_Step(self)])
        return self.original(*args, **kwargs)

    def identify(self, row: torch.Tensor) -> str:
        text = self.tokenizer.decode(row.tolist())
        (word,) = [w for w in SCRIPTS if f"Question {w}" in text]
        return word


class _Step(LogitsProcessor):
    def __init__(self, recorder: Recorder):
        self.recorder, self.keys, self.step = recorder, None, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rec = self.recorder
        if self.keys is None:
            self.keys = [rec.identify(row) for row in input_ids]
            for key in self.keys:
                rec.turns[key] += 1
        forced = torch.full_like(scores, float("-inf"))
        for b, key in enumerate(self.keys):
            turn = rec.turns[key] - 1
            script = rec.scripts[key][turn]
            if self.step < len(script):
                rec.logps[(key, turn)].append(torch.log_softmax(scores[b].float(), dim=-1))
                forced[b, script[self.step]] = 0.0
            else:  # finished: generate pads this row whatever comes
                forced[b, rec.eos] = 0.0
        self.step += 1
        return forced


def run(tiny, family, words, monkeypatch, cached: bool):
    """Rollouts of the questions ``words`` (one each), with the cache continued or each turn re-prefilled;
    returns the trajectories, the recorder and the tokens the model ran (every forward's input length summed)."""
    model, processor, fam, enc, engine, stop = engine_for(tiny, family)
    eos = sorted(stop)[0]
    rec = Recorder(model, processor.tokenizer, eos)
    monkeypatch.setattr(model, "generate", rec.generate)
    ran = [0]

    def count(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        ran[0] += ids.shape[0] * ids.shape[1]

    hook = base_model(model).register_forward_pre_hook(count, with_kwargs=True)
    samples = [question(w, i) for i, w in enumerate(words)]
    encoded = [enc.encode(s) for s in samples]
    prompts = collate(encoded, fam, processor.tokenizer.pad_token_id)
    generate, resume = turn_samplers(backend("hf"), model, fam, processor.tokenizer, enc.image_token_id,
                                     enc.protected, Sampling(greedy=True))  # fmt: skip
    if not cached:
        plain = backend("hf")

        def generate(batch, g, max_new, features):
            return plain(model, batch, g, fam, processor.tokenizer, enc.image_token_id, enc.protected, max_new,
                         Sampling(greedy=True), features)  # fmt: skip

        resume = None
    try:
        _, trajs = multi_turn(engine, model, samples, encoded, prompts, 1, LIMITS, generate, lambda b: None,
                              lambda b: b, resume)  # fmt: skip
    finally:
        hook.remove()
        monkeypatch.undo()
    return trajs, rec, ran[0]


def same_logps(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        finite = torch.isfinite(x)
        assert torch.equal(finite, torch.isfinite(y))  # the same tokens suppressed
        assert (x[finite] - y[finite]).abs().max().item() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_continuation_equals_a_fresh_prefill(tiny, family, monkeypatch):
    words = list(SCRIPTS)
    cached, rec_c, ran_c = run(tiny, family, words, monkeypatch, cached=True)
    fresh, rec_f, ran_f = run(tiny, family, words, monkeypatch, cached=False)
    # the scripts ran as written: alpha zoomed and rotated (two tool images), charlie zoomed once, bravo answered
    assert [t.tool_calls for t in cached] == [2, 0, 1]
    assert [t.tool_image_count for t in cached] == [2, 0, 1]
    assert all(t.tool_errors == 0 for t in cached)
    for c, f in zip(cached, fresh, strict=True):
        assert c.tail == f.tail and c.generated == f.generated
    assert set(rec_c.logps) == set(rec_f.logps) == {(w, k) for w, turns in SCRIPTS.items() for k in range(len(turns))}
    for key in rec_c.logps:
        same_logps(rec_c.logps[key], rec_f.logps[key])
    if family == "gemma3":  # its local layers' window counts columns: every later turn is prefilled afresh
        assert ran_c == ran_f
    else:  # the later turns ran only their new tokens: fewer than re-prefilling each whole conversation
        assert ran_c < ran_f


@pytest.mark.parametrize("family", ["qwen2-vl", "idefics3", "internvl"])
def test_batched_rollouts_see_what_each_sees_alone(tiny, family, monkeypatch):
    together, rec, _ = run(tiny, family, list(SCRIPTS), monkeypatch, cached=True)
    for i, word in enumerate(SCRIPTS):
        (alone,), rec_alone, _ = run(tiny, family, [word], monkeypatch, cached=True)
        assert alone.tail == together[i].tail
        for k in range(len(SCRIPTS[word])):
            same_logps(rec_alone.logps[(word, k)], rec.logps[(word, k)])
