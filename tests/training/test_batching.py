"""The multi-image batch path on every tiny family, with tiny models in-process: log-probs and greedy generation of a
row in shuffled mixed batches and micro-batches equal the row alone (with the canary), text-only micro-batches,
truncation that keeps every image token, and generated image tokens never fed back as images."""

from __future__ import annotations

import random

import pytest
import torch

from collage.training.batching.batch import collate
from collage.training.batching.encoding import (
    PromptEncoder,
    PromptTooLongError,
    image_span_mask,
)
from collage.training.batching.forward import generation_kwargs
from collage.training.batching.logprobs import completion_logprobs
from collage.training.data.loader import load_dataset
from collage.training.models.families import TINY_FAMILIES
from tests.support.canary import assert_only_rows_move, most_images, repaint

TOL = 1e-5


def _setup(tiny, family, count_red_dir, max_prompt_length=None):
    model, processor, fam = tiny(family)
    samples = load_dataset(str(count_red_dir)).load_all()
    encoder = PromptEncoder(processor, fam, max_prompt_length)
    image_id = encoder.image_token_id
    return model, processor, fam, samples, encoder, image_id


def _random_completions(n, vocab, seed):
    rng = random.Random(seed)
    # ids past the special tokens (which every tiny tokenizer puts first)
    return [[rng.randrange(60, vocab - 1) for _ in range(rng.randint(1, 7))] for _ in range(n)]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_logprobs_in_a_shuffled_mixed_batch_equal_each_sample_alone(tiny, family, varied_dir):
    """Rows of 0..5 images of different sizes, with the family's real processor defaults (tiles for
    Idefics3/SmolVLM, variable patch grids for anyres): a row's log-probs inside a shuffled batch and inside
    micro-batches cut from it equal the row alone. The canary: repainting one image in the middle of the 5-image row
    moves that row's log-probs, in the batch and in its micro-batch, and no other row's."""
    model, processor, fam, samples, encoder, image_id = _setup(tiny, family, varied_dir)
    counts = [s.num_images for s in samples]
    assert 0 in counts and max(counts) == 5, "the fixture must mix text-only and many-image rows"
    prompts = [encoder.encode(s) for s in samples]
    if fam.layout == "batch_padded":
        # the real processor splits large images into crops + a global view: more tiles than images
        assert any(p.pixels["pixel_values"].shape[0] > p.num_images for p in prompts if p.num_images)
    completions = _random_completions(len(prompts), len(processor.tokenizer), seed=1)
    pad = processor.tokenizer.pad_token_id
    order = list(range(len(prompts)))
    random.Random(5).shuffle(order)
    half = len(order) // 2

    def batch_and_micro(prompts):
        shuffled = collate(prompts, fam, pad, completions).select(order, fam.layout)
        with torch.no_grad():
            in_batch = completion_logprobs(model, shuffled, fam, image_id)
            # micro-batches cut from the shuffled batch must agree too
            micro = torch.cat(
                [
                    _pad_right(
                        completion_logprobs(model, shuffled.slice(lo, hi, fam.layout), fam, image_id),
                        in_batch.shape[1],
                    )
                    for lo, hi in ((0, half), (half, len(order)))
                ]
            )
        return shuffled, in_batch, micro

    shuffled, in_batch, micro = batch_and_micro(prompts)
    worst = 0.0
    with torch.no_grad():
        for j, i in enumerate(order):
            alone = completion_logprobs(model, collate([prompts[i]], fam, pad, [completions[i]]), fam, image_id)[0]
            n = len(completions[i])
            assert shuffled.rows[j] == samples[i].row
            worst = max(worst, (in_batch[j, :n] - alone[:n]).abs().max().item())
            worst = max(worst, (micro[j, :n] - alone[:n]).abs().max().item())
    assert worst <= TOL, f"{family}: max |diff| {worst}"

    k = most_images(samples)
    repainted = list(prompts)
    repainted[k] = encoder.encode(repaint(samples[k], image=2))
    _, in_batch_after, micro_after = batch_and_micro(repainted)
    mask = shuffled.completion_mask
    assert_only_rows_move(in_batch, in_batch_after, mask, [order.index(k)], f"{family} in the batch")
    assert_only_rows_move(micro, micro_after, mask, [order.index(k)], f"{family} in its micro-batch")


def _pad_right(t, width):
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_generation_on_a_mixed_batch(tiny, family, count_red_dir):
    model, processor, fam, samples, encoder, image_id = _setup(tiny, family, count_red_dir)
    """Greedy generation of a row inside a left-padded mixed batch (0..3 images) gives the same tokens and
    the same scores as generating that row alone: pixels reach the right row, padding changes nothing."""
    pad = processor.tokenizer.pad_token_id
    prompts = [encoder.encode(s) for s in samples[:6]]
    assert len({p.num_images for p in prompts}) > 1, "the batch must mix image counts"
    batch = collate(prompts, fam, pad)
    assert batch.completion_ids.shape[1] == 0

    def greedy(b):
        with torch.no_grad():
            out = model.generate(**generation_kwargs(b, fam, image_id), max_new_tokens=4, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)  # fmt: skip
        return out.sequences[:, b.prompt_length :], torch.stack(out.scores, dim=1)

    tokens, scores = greedy(batch)
    for i, prompt in enumerate(prompts):
        alone_tokens, alone_scores = greedy(collate([prompt], fam, pad))
        assert tokens[i].tolist() == alone_tokens[0].tolist(), (family, i)
        torch.testing.assert_close(scores[i], alone_scores[0], atol=1e-4, rtol=1e-4)
    # the canary: repainting the last image of the row with the most images moves the scores of that row's first
    # token (after it, the greedy tokens may differ) and leaves every other row's tokens and scores as they were
    k = most_images(samples[:6])
    repainted = list(prompts)
    repainted[k] = encoder.encode(repaint(samples[k]))
    tokens_after, scores_after = greedy(collate(repainted, fam, pad))
    others = [i for i in range(len(prompts)) if i != k]
    assert tokens_after[others].tolist() == tokens[others].tolist(), family
    first_before, first_after = scores[:, 0], scores_after[:, 0]
    assert_only_rows_move(first_before, first_after, torch.ones_like(first_before), [k], family)
    torch.testing.assert_close(scores_after[others], scores[others], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_micro_batch_without_images_gets_no_pixel_inputs(tiny, family, count_red_dir):
    model, processor, fam, samples, encoder, image_id = _setup(tiny, family, count_red_dir)
    text_only = [encoder.encode(s) for s in samples if s.num_images == 0]
    batch = collate(text_only, fam, processor.tokenizer.pad_token_id, [[70, 71]] * len(text_only))
    assert batch.pixels == {}
    with torch.no_grad():
        assert torch.isfinite(completion_logprobs(model, batch, fam, image_id)).all()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_truncation_keeps_every_image_token_and_the_model_runs(tiny, family, varied_dir):
    model, processor, fam, samples, _, image_id = _setup(tiny, family, varied_dir)
    sample = max(samples, key=lambda s: s.num_images)
    sample.prompt[0]["content"].insert(0, {"type": "text", "text": "please look carefully at every image " * 20})
    full = PromptEncoder(processor, fam).encode(sample)
    limit = full.num_image_tokens + 5
    assert len(full.input_ids) > limit
    cut = PromptEncoder(processor, fam, max_prompt_length=limit).encode(sample)
    assert len(cut.input_ids) == limit
    assert cut.truncated_tokens == len(full.input_ids) - limit
    encoder = PromptEncoder(processor, fam)

    def spans(ids):  # every token of every image span (tile-row separators included), in order
        return [
            t for t, keep in zip(ids, image_span_mask(ids, encoder.protected, encoder.separators), strict=True) if keep
        ]

    assert spans(cut.input_ids) == spans(full.input_ids) and len(spans(full.input_ids)) == full.num_image_tokens
    # what is kept is the newest text: the tail of the prompt is intact
    assert cut.input_ids[-3:] == full.input_ids[-3:]
    batch = collate(
        [cut, PromptEncoder(processor, fam, limit).encode(samples[0])],
        fam,
        processor.tokenizer.pad_token_id,
        [[80, 81], [82]],
    )
    with torch.no_grad():
        assert torch.isfinite(completion_logprobs(model, batch, fam, image_id)).all()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_images_alone_over_the_limit_name_the_row(tiny, family, count_red_dir):
    _, processor, fam, samples, _, _ = _setup(tiny, family, count_red_dir)
    sample = max(samples, key=lambda s: s.num_images)
    full = PromptEncoder(processor, fam).encode(sample)
    with pytest.raises(PromptTooLongError, match=rf"row {sample.row}: its images alone take {full.num_image_tokens}"):
        PromptEncoder(processor, fam, max_prompt_length=full.num_image_tokens - 1).encode(sample)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_generated_image_tokens_are_not_fed_back_as_images(tiny, family, count_red_dir):
    model, processor, fam, samples, encoder, image_id = _setup(tiny, family, count_red_dir)
    sample = next(s for s in samples if s.num_images >= 1)
    prompt = encoder.encode(sample)
    a, b = processor.tokenizer.encode(" yes no", add_special_tokens=False)[:2]
    completion = [a, image_id, image_id, b]
    batch = collate([prompt], fam, processor.tokenizer.pad_token_id, [completion], protected=encoder.protected)
    assert image_id not in batch.completion_ids[0].tolist()
    assert batch.completion_mask[0].tolist() == [1, 0, 0, 1]
    # same count of image tokens as the prompt alone: the model sees the right number of image slots
    assert int((batch.input_ids == image_id).sum()) == sum(1 for t in prompt.input_ids if t == image_id)
    with torch.no_grad():
        assert torch.isfinite(completion_logprobs(model, batch, fam, image_id)).all()
