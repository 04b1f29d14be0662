"""The playground process's multi-turn generation in-process, on a real tiny Qwen2-VL sampled by the real backend:
its logits are forced to a scripted conversation (zoom on the prompt's image, zoom on that crop, answer), so the
turns after a tool call continue from the KV cache exactly as in training (``training.rollout.turn_samplers``),
and every turn, crop and source box comes back in the answer. (The worker-side tests, in a real playground process,
script the backend instead: tests/processes/test_playground_worker.py.)"""

from __future__ import annotations

import base64
import hashlib
import io

import pytest
from PIL import Image

from tests.support.scripted import call

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FIRST, SECOND = [8, 6, 72, 54], [4, 4, 40, 36]
TURNS = [
    call("image_zoom_in", image=0, bbox_2d=FIRST),
    call("image_zoom_in", image=1, bbox_2d=SECOND),
    "<answer>1</answer>",
]


def board() -> Image.Image:
    image = Image.new("RGB", (96, 72), (240, 240, 240))
    for x in range(0, 96, 8):
        image.paste((x * 2, 120, 255 - x * 2), (x, 60, x + 8, 72))
    image.paste((230, 20, 20), (10, 10, 40, 40))
    return image


def _store(artifacts, image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    sha = hashlib.sha256(buf.getvalue()).hexdigest()
    file = artifacts / "images" / sha[:2] / sha[2:4] / f"{sha}.png"
    file.parent.mkdir(parents=True)
    file.write_bytes(buf.getvalue())
    return sha


@pytest.fixture
def forced(monkeypatch, tiny_model_dir):
    """Every ``generate`` of transformers picks the scripted conversation's next token (the turn: the tool results so
    far; the place in it: the tokens since the last assistant header); ``resumed`` counts the continued turns."""
    import torch
    from transformers import GenerationMixin, LogitsProcessor, LogitsProcessorList

    from collage.training import generation, rollout
    from collage.training.models.loading import load_processor

    tokenizer = load_processor(str(tiny_model_dir("qwen2-vl")))[0].tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    scripts = [tokenizer.encode(t, add_special_tokens=False) + [end] for t in TURNS]

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            out = torch.full_like(scores, -1e9)
            for r in range(input_ids.shape[0]):
                text = tokenizer.decode(input_ids[r])
                want = scripts[min(text.count("<tool_response>"), len(scripts) - 1)]
                done = len(tokenizer.encode(text.rsplit("<|im_start|>assistant\n", 1)[1], add_special_tokens=False))
                out[r, want[min(done, len(want) - 1)]] = 0.0
            return out

    real = GenerationMixin.generate

    def generate(self, *args, **kwargs):
        kwargs["logits_processor"] = LogitsProcessorList([Force()])
        return real(self, *args, **kwargs)

    resumed = []
    real_resume = rollout.resume_generation

    def resume(*args, **kwargs):
        resumed.append(args[2])  # the rows that go on
        return real_resume(*args, **kwargs)

    assert generation.BACKENDS["hf"] is generation.generate  # the built-in backend: it continues from the cache
    monkeypatch.setattr(GenerationMixin, "generate", generate)
    monkeypatch.setattr(rollout, "resume_generation", resume)
    return resumed


def test_later_turns_continue_from_the_cache_and_every_crop_comes_back(forced, tmp_path):
    from collage.worker.playground.process import Playground

    events = []
    artifacts = tmp_path / "artifacts"
    sha = _store(artifacts, board())
    request = {"op": "generate", "model": {"kind": "base", "path": "tiny:qwen2-vl", "label": "tiny:qwen2-vl"},
               "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many red?"}]}],
               "images": [sha], "artifacts": str(artifacts), "answer": "1", "columns": {},
               "rewards": [{"name": "accuracy"}, {"name": "tool_format"}], "reward_modules": [], "num_generations": 2,
               "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 900, "seed": 0, "tools": [{"name": "image_zoom_in"}],
               "tool_modules": [], "max_tool_calling_iterations": 4, "cancel": None}  # fmt: skip
    result = Playground(events.append).generate(request)
    assert forced == [[0, 1], [0, 1]]  # both later turns of both rollouts continued from the cache
    assert [e["event"] for e in events] == ["loading", "generating", "scoring"]
    crop1 = board().crop(tuple(FIRST))
    crop2 = crop1.crop(tuple(SECOND))
    for completion in result["completions"]:
        trajectory = completion["trajectory"]
        assert [t["role"] for t in trajectory["turns"]] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert (trajectory["tool_calls"], trajectory["tool_errors"], trajectory["capped"]) == (2, 0, False)
        for turn, crop, source in [(trajectory["turns"][1], crop1, {"image": 0, "bbox_2d": FIRST}),
                                   (trajectory["turns"][3], crop2, {"image": 1, "bbox_2d": SECOND})]:  # fmt: skip
            (image,) = turn["images"]
            assert image["source"] == source and (image["width"], image["height"]) == crop.size
            shown = Image.open(io.BytesIO(base64.b64decode(image["png"]))).convert("RGB")
            assert shown.tobytes() == crop.tobytes()
        assert completion["text"] == "<answer>1</answer>" and completion["reward"] is not None
    assert result["rewards"]["accuracy"] == [1.0, 1.0] and result["rewards"]["tool_format"] == [1.0, 1.0]
