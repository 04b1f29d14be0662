"""The rollout engine on every tiny family, in-process: each prompt prefilled once and forked to its group, each
distinct sample's vision features computed once and reused, each distinct prompt run once, and bucketed, trimmed
micro-batches, all with the same samples, log-probs and gradients as the plain path; and the images a run's vision
tower encodes, logged per step."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from collage.training.batching.batch import collate
from collage.training.batching.encoding import PromptEncoder
from collage.training.batching.forward import generation_kwargs
from collage.training.batching.logprobs import completion_logprobs_and_entropy
from collage.training.batching.prefix import prompt_groups
from collage.training.batching.vision import SHARED, VisionFeatures
from collage.training.data.loader import load_dataset
from collage.training.generation import Sampling, eos_ids, generate
from collage.training.models.families import TINY_FAMILIES
from tests.support.canary import CANARY_MARGIN, assert_only_rows_move, most_images, repaint

TOL = 1e-5


def _plain_generate(model, processor, fam, image_id, prompts, g, sampling, max_new, protected):
    """HF ``generate`` on the prompts repeated ``g`` times: every row prefilled on its own."""
    pad = processor.tokenizer.pad_token_id
    batch = collate([p for p in prompts for _ in range(g)], fam, pad)
    out = model.generate(
        **generation_kwargs(batch, fam, image_id),
        do_sample=True,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        max_new_tokens=max_new,
        pad_token_id=pad,
        eos_token_id=sorted(eos_ids(model, processor.tokenizer)),
        suppress_tokens=sorted(protected) or None,
    )
    return out[:, batch.prompt_length :].tolist()


def _cut(rows, stop, max_new):
    out = []
    for row in rows:
        end = next((i for i, t in enumerate(row) if t in stop), None)
        out.append(row[:max_new] if end is None else row[: end + 1])
    return out


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0), Sampling(temperature=0.7, top_p=0.9, top_k=50)])
def test_prefill_once_samples_what_generate_samples_row_by_row(tiny, family, count_red_dir, sampling):
    """The same seed gives the same completions whether each of the G rows of a group is prefilled on its own
    (HF ``generate`` on the repeated prompts) or the prompt is prefilled once and its KV cache forked; the
    prompts mix text-only rows and rows of 1..3 images, and come out prompt-major."""
    model, processor, fam = tiny(family)
    encoder = PromptEncoder(processor, fam)
    samples = [load_dataset(str(count_red_dir)).load_all()[i] for i in (0, 5, 7, 11)]
    assert 0 in [s.num_images for s in samples] and max(s.num_images for s in samples) >= 2
    prompts = [encoder.encode(s) for s in samples]
    g, max_new = 3, 6
    pad = processor.tokenizer.pad_token_id
    with torch.no_grad():
        torch.manual_seed(11)
        plain = _plain_generate(model, processor, fam, encoder.image_token_id, prompts, g, sampling, max_new,
                                encoder.protected)  # fmt: skip
        torch.manual_seed(11)
        got = generate(model, collate(prompts, fam, pad), g, fam, processor.tokenizer, encoder.image_token_id,
                       encoder.protected, max_new, sampling)  # fmt: skip
    assert len(got.ids) == len(prompts) * g
    assert got.ids == _cut(plain, eos_ids(model, processor.tokenizer), max_new), family
    # a group's completions differ from each other (sampling, not one completion copied G times)
    assert any(len({tuple(c) for c in got.ids[i * g : (i + 1) * g]}) > 1 for i in range(len(prompts)))


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_prefill_once_with_cached_features_matches_greedy_generate(tiny, family, count_red_dir):
    """Generation from cached vision features (and the cache forked per group) gives the greedy tokens of
    plain ``generate``: the features reach the right rows."""
    model, processor, fam = tiny(family)
    encoder = PromptEncoder(processor, fam)
    prompts = [encoder.encode(load_dataset(str(count_red_dir)).load_all()[i]) for i in (0, 5, 7, 11)]
    pad = processor.tokenizer.pad_token_id
    batch = collate(prompts, fam, pad)
    cache = VisionFeatures(fam)
    with torch.no_grad():
        features = cache.encoder_outputs(model, batch, SHARED)
        torch.manual_seed(3)
        got = generate(model, batch, 2, fam, processor.tokenizer, encoder.image_token_id, encoder.protected, 5,
                       Sampling(temperature=1e-4))  # fmt: skip
        torch.manual_seed(3)
        cached = generate(model, batch, 2, fam, processor.tokenizer, encoder.image_token_id, encoder.protected, 5,
                          Sampling(temperature=1e-4), features)  # fmt: skip
    assert cached.ids == got.ids, family
    assert cache.images_encoded == sum(p.num_images for p in prompts)


def _grouped_batch(processor, fam, encoder, samples, g, seed):
    """Each sample's prompt repeated ``g`` times with different random completions, shuffled."""
    prompts = [encoder.encode(s) for s in samples]
    repeated = [p for p in prompts for _ in range(g)]
    rng = random.Random(seed)
    completions = [[rng.randrange(60, len(processor.tokenizer) - 1) for _ in range(rng.randint(1, 6))]
                   for _ in repeated]  # fmt: skip
    batch = collate(repeated, fam, processor.tokenizer.pad_token_id, completions)
    order = list(range(batch.batch_size))
    rng.shuffle(order)
    return batch.select(order, fam.layout)


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("share_prompts", [False, True], ids=["row-by-row", "shared-prompts"])
def test_cached_features_and_shared_prompts_give_the_same_logprobs(tiny, family, varied_dir, share_prompts):
    """Rows of 0..5 images of varied sizes (the families' real tiling and anyres defaults), each repeated as a
    group, shuffled and cut into micro-batches: log-probs and entropies from cached features, with or without each
    distinct prompt run once, equal the plain row-by-row forward from pixels; the tower encodes each distinct
    row's images exactly once across every micro-batch. The canary: with one image of the 5-image row repainted,
    the same cache encodes that row again (it is keyed by content) and only that group's log-probs move."""
    model, processor, fam = tiny(family)
    encoder = PromptEncoder(processor, fam)
    samples = load_dataset(str(varied_dir)).load_all()
    cache = VisionFeatures(fam)

    def engine_logps(samples):
        shuffled = _grouped_batch(processor, fam, encoder, samples, 3, seed=2)
        worst = 0.0
        shared_any = False
        parts = []
        with torch.no_grad():
            for lo in range(0, shuffled.batch_size, 6):
                mb = shuffled.slice(lo, min(lo + 6, shuffled.batch_size), fam.layout)
                plain, plain_ent = completion_logprobs_and_entropy(model, mb, fam, encoder.image_token_id)
                got, ent = completion_logprobs_and_entropy(
                    model, mb, fam, encoder.image_token_id, share_prompts=share_prompts,
                    vision=lambda b: cache.encoder_outputs(model, b, SHARED),
                )  # fmt: skip
                shared_any |= len({tuple(r) for r in mb.input_ids[:, : mb.prompt_length].tolist()}) < mb.batch_size
                m = mb.completion_mask
                worst = max(worst, ((plain - got) * m).abs().max().item(), ((plain_ent - ent) * m).abs().max().item())
                parts.append(torch.nn.functional.pad(got, (0, shuffled.completion_mask.shape[1] - got.shape[1])))
        assert worst <= TOL, f"{family}: max |diff| {worst}"
        assert shared_any, "some micro-batch must hold two rows of one group"
        return shuffled, torch.cat(parts)

    shuffled, before = engine_logps(samples)
    assert cache.images_encoded == sum(s.num_images for s in samples), "each distinct row's images once"
    k = most_images(samples)
    changed = list(samples)
    changed[k] = repaint(samples[k], image=2)
    _, after = engine_logps(changed)
    assert cache.images_encoded == sum(s.num_images for s in samples) + samples[k].num_images
    group = [j for j, row in enumerate(shuffled.rows) if row == samples[k].row]
    assert len(group) == 3
    assert_only_rows_move(before, after, shuffled.completion_mask, group, family)


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("tower", ["frozen", "trainable"])
def test_shared_prompts_keep_the_gradients(tiny, family, count_red_dir, tower):
    """Each distinct prompt run once gives the same gradients as the row-by-row forward from pixels: every row's
    gradient flows back into its shared prompt. With the vision side frozen the features come from the cache (no
    gradients) and the language model's gradients match; with a trainable tower it is encoded with gradients
    and every parameter's gradient matches, the tower's included."""
    model, processor, fam = tiny(family)
    encoder = PromptEncoder(processor, fam)
    samples = [load_dataset(str(count_red_dir)).load_all()[i] for i in (0, 5, 7)]  # 1, 3 and 0 images
    batch = _grouped_batch(processor, fam, encoder, samples, 3, seed=4)
    if tower == "frozen":
        params = [p for n, p in model.named_parameters() if "language_model" in n or "text_model" in n]
    else:
        params = list(model.parameters())
    assert params

    def grads(**kwargs):
        model.zero_grad(set_to_none=True)
        logps, ent = completion_logprobs_and_entropy(model, batch, fam, encoder.image_token_id, entropy_grad=True,
                                                     **kwargs)  # fmt: skip
        ((logps + 0.1 * ent) * batch.completion_mask).sum().backward()
        return [None if p.grad is None else p.grad.clone() for p in params]

    cache = VisionFeatures(fam)
    vision = (lambda b: cache.encoder_outputs(model, b, SHARED)) if tower == "frozen" else None
    with torch.enable_grad():
        plain = grads()
        shared = grads(share_prompts=True, vision=vision)
    model.zero_grad(set_to_none=True)
    assert sum(g is not None for g in plain) > len(params) // 2
    for a, b in zip(plain, shared, strict=True):
        assert (a is None) == (b is None)
        if a is not None:  # float32 noise scales with the tensor (Gemma 3's projector gradient reaches 2e4)
            torch.testing.assert_close(a, b, atol=1e-5 * max(1.0, a.abs().max().item()), rtol=1e-4)


@pytest.mark.parametrize("mode", ["frozen", "lora", "unfrozen"])
def test_a_run_logs_the_images_its_vision_tower_encodes(mode):
    """``vision/images_encoded`` per step: with the vision side frozen (LoRA on the language model or none) each
    distinct row's images once per generation batch, although every image is in G completions and goes through
    generation, the old-policy and reference passes and two training forwards. A trainable tower is encoded with
    gradients in every training forward (once per distinct prompt there), and once more for the reference."""
    from collage.training.trainer import Trainer
    from tests.support.training import Recorder, make_config

    model = {"path": "tiny:qwen2-vl", "dtype": "float32", "freeze_vision": mode != "unfrozen"}
    if mode == "lora":
        model["lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    train = {"max_steps": 2, "beta": 0.1, "num_iterations": 2, "steps_per_generation": 2, "gradient_accumulation_steps": 4,
             "per_device_train_batch_size": 4}  # fmt: skip
    recorder = Recorder()
    Trainer(make_config(model=model, train=train, dataset={"min_images": 1}), None, [recorder]).train()
    for step, metrics in recorder.metrics:
        rows = [r for r in recorder.samples if r.step == step]
        groups = {r.group: len(r.images) for r in rows}
        distinct = sum(groups.values())
        assert distinct > 0 and metrics["num_images"] == 4 * distinct  # G = 4 completions per prompt
        if mode == "unfrozen":
            # generation + old policy share one encoding and the reference has its own; the training forwards
            # encode with gradients, once per distinct prompt of a micro-batch: the rows of a step are regrouped
            # so that each micro-batch of 4 is one whole group, and each is used twice (num_iterations)
            assert metrics["vision/images_encoded"] == distinct + distinct + 2 * distinct, step
        else:
            assert metrics["vision/images_encoded"] == distinct, (step, metrics["vision/images_encoded"], distinct)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_trimmed_micro_batch_gives_the_same_logprobs(tiny, family, count_red_dir):
    """A micro-batch cut from a generation batch drops the columns that are padding in all its rows; its
    log-probs are those of the untrimmed micro-batch on the columns it keeps."""
    model, processor, fam = tiny(family)
    encoder = PromptEncoder(processor, fam)
    samples = load_dataset(str(count_red_dir)).load_all()
    encoded = sorted((encoder.encode(s) for s in samples), key=lambda p: -len(p.input_ids))
    prompts = [encoded[0], *encoded[-3:]]  # the longest first: the micro-batch of the others has less to pad
    assert len(prompts[0].input_ids) > len(prompts[1].input_ids) and any(p.num_images for p in prompts[1:])
    completions = [[70, 71, 72, 73, 74, 75], [80], [81, 82], [90, 91]]
    batch = collate(prompts, fam, processor.tokenizer.pad_token_id, completions)
    mb = batch.slice(1, 4, fam.layout)
    trimmed = mb.trimmed()
    assert trimmed.prompt_length < mb.prompt_length and trimmed.completion_mask.shape[1] == 2
    with torch.no_grad():
        full = completion_logprobs_and_entropy(model, mb, fam, encoder.image_token_id)[0]
        cut = completion_logprobs_and_entropy(model, trimmed, fam, encoder.image_token_id)[0]
    m = trimmed.completion_mask
    assert ((full[:, :2] - cut) * m).abs().max().item() <= TOL
    assert trimmed.trimmed() is trimmed


def test_bucketed_micro_batches_give_the_same_gradients(monkeypatch):
    """With a composition-invariant loss (dapo), regrouping rows within an optimizer step's micro-batches (and
    trimming their padding, and sharing their prompts) gives the optimizer step the gradients TRL's shuffled
    order gives it. (Gradients, not parameters after AdamW: its first update is about lr * sign(g), so float noise
    on a near-zero component flips a whole lr.)"""
    from collage.training import rollout as rollout_module
    from collage.training.trainer import Trainer
    from tests.support.training import make_config

    train = {"max_steps": 1, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4, "seed": 3,
             "max_completion_length": 8}  # fmt: skip

    def first_step_grads():
        trainer = Trainer(make_config(train=train), None, [])
        trainer.setup()
        named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
        seen: dict[str, torch.Tensor] = {}
        step = trainer.optimizer.step

        def record(*args, **kwargs):
            seen.update({n: p.grad.clone() for n, p in named if p.grad is not None})
            return step(*args, **kwargs)

        trainer.optimizer.step = record
        trainer.train()
        return seen

    bucketed = first_step_grads()
    monkeypatch.setattr(rollout_module, "composition_invariant", lambda *args: False)
    shuffled = first_step_grads()
    assert bucketed.keys() == shuffled.keys() and bucketed
    assert any(g.abs().max() > 0 for g in bucketed.values())
    for name, grad in bucketed.items():
        torch.testing.assert_close(grad, shuffled[name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_equal_padded_ids_with_different_masks_are_different_prompts(tiny, family, count_red_dir):
    """A prompt whose first real token is the pad id, next to the same prompt without that token: left-padded, their
    ids are equal and only their attention masks differ. They are two prompts, so running each distinct prompt once
    gives every row its own log-probs, those of the row-by-row forward."""
    model, processor, fam = tiny(family)
    encoder = PromptEncoder(processor, fam)
    sample = next(s for s in load_dataset(str(count_red_dir)).load_all() if s.num_images)
    short = encoder.encode(sample)
    pad = processor.tokenizer.pad_token_id
    long = dataclasses.replace(short, input_ids=[pad, *short.input_ids])
    batch = collate([short, long, short, long], fam, pad, [[70, 71, 72], [73, 74], [75], [70, 71, 72]])
    p = batch.prompt_length
    assert torch.equal(batch.input_ids[0, :p], batch.input_ids[1, :p]) and batch.image_keys[0] == batch.image_keys[1]
    assert not torch.equal(batch.attention_mask[0, :p], batch.attention_mask[1, :p])
    with torch.no_grad():
        plain = completion_logprobs_and_entropy(model, batch, fam, encoder.image_token_id)[0]
        shared = completion_logprobs_and_entropy(model, batch, fam, encoder.image_token_id, share_prompts=True)[0]
    m = batch.completion_mask
    assert (plain[0] - plain[3]).abs().max().item() > CANARY_MARGIN, "the extra real token changes the prompt"
    assert ((plain - shared) * m).abs().max().item() <= TOL, family
    assert prompt_groups(batch) == ([0, 1], [0, 1, 0, 1])
