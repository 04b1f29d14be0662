"""Chunked log-probs and entropies (hidden states through the LM head a chunk at a time) equal the full-logits
computation, in values and in gradients, on every tiny family in-process; entropy without its gradient, the no-grad
path, and the LM head restored when the forward fails."""

from __future__ import annotations

import random

import pytest
import torch

from collage.training import algorithms as alg
from collage.training.batching.batch import collate
from collage.training.batching.encoding import PromptEncoder
from collage.training.batching.logprobs import (
    _completion_logits,
    _lm_head_slot,
    completion_logprobs,
    completion_logprobs_and_entropy,
)
from collage.training.data.loader import load_dataset
from collage.training.models.families import TINY_FAMILIES

TOL = 1e-5


def _batch(tiny, family, count_red_dir):
    model, processor, fam = tiny(family)
    by_count = {}
    for s in load_dataset(str(count_red_dir)).load_all():
        by_count.setdefault(s.num_images, s)
    samples = [by_count[k] for k in sorted(by_count)][:4]
    assert len({s.num_images for s in samples}) > 1, "the batch must mix image counts"
    encoder = PromptEncoder(processor, fam)
    rng = random.Random(3)
    vocab = len(processor.tokenizer)
    completions = [[rng.randrange(60, vocab - 1) for _ in range(rng.randint(1, 7))] for _ in samples]
    batch = collate([encoder.encode(s) for s in samples], fam, processor.tokenizer.pad_token_id, completions)
    return model, fam, batch, encoder.image_token_id


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _grads(model, loss):
    params = _params(model)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def _loss(logps, ent, weights, mask):
    return ((logps * weights + 0.3 * ent) * mask).sum()


def _max_diff(a, b):
    """Worst |a - b| over the tensors, relative to each reference tensor's largest entry when that is above 1
    (Gemma 3's projector gradients reach ~1e4, where fp32 summation order alone moves them by ~1e-3)."""
    return max(((x - y).abs().max() / y.abs().max().clamp(min=1.0)).item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_logits_in_values_and_gradients(tiny, family, count_red_dir, temperature):
    model, fam, batch, image_id = _batch(tiny, family, count_red_dir)
    mask = batch.completion_mask.float()
    weights = torch.randn(batch.completion_ids.shape, generator=torch.Generator().manual_seed(0))

    logits = _completion_logits(model, batch, fam, image_id)
    ref_logps, ref_ent = alg.token_logps_and_entropy(logits, batch.completion_ids, temperature)
    ref_grads = _grads(model, _loss(ref_logps, ref_ent, weights, mask))
    del logits

    n_tokens = batch.completion_ids.numel()
    for chunk in (1, 3, n_tokens + 5):
        logps, ent = completion_logprobs_and_entropy(
            model, batch, fam, image_id, temperature, entropy_grad=True, chunk_size=chunk
        )
        assert logps.shape == ent.shape == batch.completion_ids.shape
        assert (logps - ref_logps).abs().max().item() <= TOL, (family, chunk)
        assert (ent - ref_ent).abs().max().item() <= TOL, (family, chunk)
        worst = _max_diff(_grads(model, _loss(logps, ent, weights, mask)), ref_grads)
        assert worst <= TOL, f"{family} chunk={chunk}: max |grad diff| {worst}"
    assert _lm_head_slot(model)[2] is model.get_output_embeddings()


def test_entropy_without_grad_and_no_grad_path(tiny, count_red_dir):
    model, fam, batch, image_id = _batch(tiny, "qwen2-vl", count_red_dir)
    logps, ent = completion_logprobs_and_entropy(model, batch, fam, image_id, 0.9, chunk_size=2)
    assert logps.requires_grad and not ent.requires_grad
    with torch.no_grad():
        ref = alg.token_logps_and_entropy(_completion_logits(model, batch, fam, image_id), batch.completion_ids, 0.9)
        plain = completion_logprobs(model, batch, fam, image_id, 0.9, chunk_size=3)
        _, no_ent = completion_logprobs_and_entropy(model, batch, fam, image_id, entropy=False)
    assert no_ent is None
    assert (plain - ref[0]).abs().max().item() <= TOL
    assert (logps.detach() - ref[0]).abs().max().item() <= TOL
    assert (ent - ref[1]).abs().max().item() <= TOL


def test_lm_head_is_restored_when_the_forward_fails(tiny, count_red_dir):
    model, fam, batch, image_id = _batch(tiny, "llava", count_red_dir)
    head = model.get_output_embeddings()
    broken = batch.slice(0, 2, fam.layout)
    broken.input_ids = broken.input_ids[:, :-1]  # ids no longer match the attention mask
    with pytest.raises(Exception):  # noqa: B017 - whatever the model raises
        completion_logprobs(model, broken, fam, image_id)
    assert model.get_output_embeddings() is head


def _measure(variant: str, chunk: int) -> None:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from collage.training.batching.batch import ModelBatch
    from collage.training.models.families import FAMILIES

    torch.manual_seed(0)
    text = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [4, 2, 2]})  # fmt: skip
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision)).float()
    fam = FAMILIES["qwen2-vl"]
    b, p, c = 2, 16, 128
    ids = torch.randint(1000, 150000, (b, p + c))
    batch = ModelBatch(ids, torch.ones_like(ids), p, torch.ones(b, c), {}, [0, 0], [0, 1])
    image_id = model.config.image_token_id

    def status(key: str) -> int:  # kB in /proc/self/status
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    for p_ in model.parameters():  # allocate the parameter grads up front: they are not the logits' cost
        p_.grad = torch.zeros_like(p_)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the kernel's peak RSS (VmHWM) to the current RSS
    base = status("VmRSS:")
    if variant == "full":
        logps, ent = alg.token_logps_and_entropy(_completion_logits(model, batch, fam, image_id), batch.completion_ids)
    else:
        logps, ent = completion_logprobs_and_entropy(model, batch, fam, image_id, entropy_grad=True, chunk_size=chunk)
    (logps.sum() + 0.1 * ent.sum()).backward()
    print(f"{variant:>7} chunk={chunk:<4} peak RSS rise {(status('VmHWM:') - base) / 2**20:8.1f} MiB")


if __name__ == "__main__":
    import subprocess
    import sys

    if len(sys.argv) > 1:
        _measure(sys.argv[1], int(sys.argv[2]))
    else:
        for variant, chunk in (("full", 0), ("chunked", 256), ("chunked", 128), ("chunked", 64), ("chunked", 16)):
            subprocess.run([sys.executable, __file__, variant, str(chunk)], check=True)
