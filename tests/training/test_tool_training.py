"""A whole run with tools through the real Trainer: a scripted policy (half the rollouts zoom into their image, then
answer; the rest answer at once) stands in for sampling, and everything else is real: the turn loop, the tools,
the loss over the generated tokens only, rewards that see the trajectory, tool metrics in training and in
evaluation, and rollout rows whose trajectories carry the crops to samples.jsonl."""

from __future__ import annotations

import json

import pytest
import torch

from collage.training import generation
from collage.training.generation import Completions
from collage.training.output import OutputFolder
from collage.training.trainer import Trainer
from tests.support.training import Recorder, make_config

ZOOM = '<tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [0, 0, 40, 40], "image": 0}}</tool_call>'


@pytest.fixture
def scripted_policy(monkeypatch):
    """Replaces sampling: a context that already holds a tool turn is answered; otherwise even rows zoom."""
    calls = []

    def scripted(model, batch, g, family, tokenizer, image_token_id, protected, max_new, sampling, features=None):
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        rows = []
        for i in range(batch.batch_size * g):
            answered = "<tool_response>" in tokenizer.decode(batch.input_ids[i // g])
            text = "<answer>1</answer>" if answered or i % 2 else ZOOM
            rows.append(tokenizer.encode(text, add_special_tokens=False)[: max_new - 1] + [eos])
        calls.append(batch.batch_size * g)
        return Completions(rows, [False] * len(rows))

    monkeypatch.setitem(generation.BACKENDS, "hf", scripted)
    return calls


def test_a_run_with_tools(tmp_path, scripted_policy):
    config = make_config(
        tools=[{"name": "image_zoom_in"}],
        dataset={"source": "synth:count-red", "rows": 24, "min_images": 1, "max_images": 2, "eval_fraction": 0.2},
        rewards=[{"name": "accuracy"}, {"name": "tool_format", "weight": 0.5}],
        train={"max_completion_length": 400, "max_tool_calling_iterations": 2, "eval_strategy": "steps",
               "eval_steps": 1, "eval_max_tool_calling_iterations": 3, "per_device_eval_batch_size": 4},
    )  # fmt: skip
    rec = Recorder()
    Trainer(config, tmp_path, [OutputFolder(tmp_path), rec]).train()
    assert rec.ended == ("succeeded", None)
    train = [m for _, m in rec.metrics if "tools/call_frequency" in m]
    assert len(train) == 2
    for m in train:
        assert m["tools/call_frequency"] == pytest.approx(0.5)  # every even rollout zoomed once
        assert m["tools/used_fraction"] == pytest.approx(0.5)
        assert m["tools/image_zoom_in/calls"] == pytest.approx(0.5)
        assert m["tools/failure_frequency"] == 0.0 and m["images/added_mean"] == pytest.approx(0.5)
        assert m["turns/mean"] == pytest.approx(1.5)
        assert m["tools/with_call/tool_format"] == 1.0  # well-formed calls
        assert torch.isfinite(torch.tensor(m["loss"]))
    evals = [m for _, m in rec.metrics if "eval/tools/call_frequency" in m]
    assert evals and evals[-1]["eval/tools/used_fraction"] > 0
    zoomed = [r for r in rec.samples if r.trajectory and len(r.trajectory) == 3]
    direct = [r for r in rec.samples if len(r.trajectory) == 1]
    assert zoomed and direct
    row = zoomed[0]
    assert [t.role for t in row.trajectory] == ["assistant", "tool", "assistant"]
    assert row.trajectory[0].tool_call == {
        "name": "image_zoom_in",
        "arguments": {"bbox_2d": [0, 0, 40, 40], "image": 0},
    }
    assert row.trajectory[1].sources == [{"image": 0, "bbox_2d": [0, 0, 40, 40]}]
    assert row.completion == "<answer>1</answer>"
    assert any(r.split == "eval" and len(r.trajectory) == 3 for r in rec.samples)
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    with_crops = [x for x in lines if len(x["trajectory"]) == 3]
    crop = with_crops[0]["trajectory"][1]["images"][0]
    assert crop["width"] == 40 and crop["height"] == 40 and crop["source"]["bbox_2d"] == [0, 0, 40, 40]
