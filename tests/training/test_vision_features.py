"""Cached vision features are encoded in eval mode and never touch the global random stream.

The feature cache encodes while the policy is in train mode (before ``generate`` switches to eval). With dropout on
the vision side (LoRA dropout on a trainable tower, attention dropout) a train-mode encode perturbs the features the
generation, old-policy and reference passes take, and draws from the global random stream, which changes the
completions sampled next.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from collage.training.batching.batch import collate
from collage.training.batching.encoding import PromptEncoder
from collage.training.batching.layouts import split_pixels
from collage.training.batching.logprobs import completion_logprobs
from collage.training.batching.vision import POLICY, VisionFeatures, _model_inner
from collage.training.config import LoraSettings, ModelSettings
from collage.training.data.loader import load_dataset
from collage.training.generation import Sampling, generate
from collage.training.modeling import is_vision_param, prepare_policy
from collage.training.models.families import TINY_FAMILIES
from collage.training.models.loading import load_model, load_processor
from tests.support.training import make_config

TOL = 1e-5


def _policy_with_vision_dropout(folder):
    """A tiny policy as the trainer holds one with ``freeze_vision: false`` and LoRA dropout 0.5: adapters on the
    vision tower's attention too, their B matrices moved off zero as by some training (at zero the dropout could not
    change an output, though it still draws), in train mode."""
    settings = ModelSettings(
        path=str(folder),
        freeze_vision=False,
        lora=LoraSettings(r=4, alpha=8, dropout=0.5, target_modules=["q_proj", "v_proj", "qkv"]),
    )
    policy = prepare_policy(load_model(str(folder), "float32"), settings, gradient_checkpointing=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.5)
    assert any(is_vision_param(n) and n.endswith("lora_dropout") for n, _ in policy.named_modules())
    return policy.train()


def _prompts(folder, count_red_dir):
    processor, fam = load_processor(str(folder))
    encoder = PromptEncoder(processor, fam)
    samples = [load_dataset(str(count_red_dir)).load_all()[i] for i in (0, 5, 7, 11)]
    assert 0 in [s.num_images for s in samples] and max(s.num_images for s in samples) >= 2
    batch = collate([encoder.encode(s) for s in samples], fam, processor.tokenizer.pad_token_id)
    return processor, fam, encoder, batch


def _outputs_equal(a, b) -> bool:
    return (
        torch.equal(a.pooler_output, b.pooler_output)
        if isinstance(a.pooler_output, torch.Tensor)
        else all(torch.equal(x, y) for x, y in zip(a.pooler_output, b.pooler_output, strict=True))
    )


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_cached_features_are_an_eval_mode_encode_and_leave_the_rng_alone(tiny_model_dir, family, count_red_dir):
    policy = _policy_with_vision_dropout(tiny_model_dir(family))
    _, fam, _, batch = _prompts(tiny_model_dir(family), count_red_dir)
    inner = _model_inner(policy)
    language = getattr(inner, "language_model", None) or inner.text_model
    language.eval()  # a part in another mode than the rest keeps its own mode
    modes = [m.training for m in policy.modules()]

    # the dropout is real: two train-mode encodes of one sample differ
    s = next(i for i, n in enumerate(batch.num_images) if n)
    one = split_pixels(fam.layout, batch.pixels, batch.num_images)[s]
    with torch.no_grad():
        first, second = (VisionFeatures(fam)._encode(inner, one, batch.num_images[s]) for _ in range(2))
    assert not _outputs_equal(first, second), "the test needs dropout on the vision side"

    torch.manual_seed(7)
    rng = torch.get_rng_state()
    cached = VisionFeatures(fam).encoder_outputs(policy, batch, POLICY)
    assert torch.equal(torch.get_rng_state(), rng), "the encode drew from the global random stream"
    assert [m.training for m in policy.modules()] == modes, "every module's mode is restored"

    policy.eval()
    want = VisionFeatures(fam).encoder_outputs(policy, batch, POLICY)
    policy.train()
    language.eval()
    assert _outputs_equal(cached, want)

    # a batch without content keys (restored from an older checkpoint) is encoded the same way, and not kept
    unkeyed = VisionFeatures(fam)
    rng = torch.get_rng_state()
    got = unkeyed.encoder_outputs(policy, dataclasses.replace(batch, image_keys=[]), POLICY)
    assert torch.equal(torch.get_rng_state(), rng) and [m.training for m in policy.modules()] == modes
    assert _outputs_equal(got, want) and unkeyed.entries == {}
    assert unkeyed.images_encoded == sum(batch.num_images)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_completions_sampled_with_cached_features_are_those_sampled_without(tiny_model_dir, family, count_red_dir):
    """Same seed, plain temperature sampling: the completions from features the cache encoded (the policy in train
    mode, dropout on its vision side) equal those of ``generate`` encoding the pixels itself."""
    policy = _policy_with_vision_dropout(tiny_model_dir(family))
    processor, fam, encoder, batch = _prompts(tiny_model_dir(family), count_red_dir)
    args = (batch, 3, fam, processor.tokenizer, encoder.image_token_id, encoder.protected, 6, Sampling())
    torch.manual_seed(11)
    plain = generate(policy, *args)
    torch.manual_seed(11)
    features = VisionFeatures(fam).encoder_outputs(policy, batch, POLICY)
    cached = generate(policy, *args, features)
    assert policy.training
    assert cached.ids == plain.ids, family
    assert any(len({tuple(c) for c in cached.ids[i * 3 : (i + 1) * 3]}) > 1 for i in range(4)), "really sampled"


def test_reference_logprobs_with_vision_attention_dropout_are_the_reference_models(tiny_model_dir, tmp_path):
    """A model whose vision tower has attention dropout, frozen (so every pass shares the generation's cached
    features), with a KL term: the reference log-probs of a generation batch equal the reference model's own
    forward of each row from its pixels (it is in eval mode), not log-probs from dropped-out features."""
    from collage.training.trainer import Trainer

    folder = tmp_path / "llava-attention-dropout"
    shutil.copytree(tiny_model_dir("llava"), folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["vision_config"]["attention_dropout"] = 0.5
    config_file.write_text(json.dumps(config))

    run = make_config(model={"path": str(folder), "dtype": "float32"}, train={"beta": 0.1}, dataset={"min_images": 2})
    trainer = Trainer(run, None, [])
    trainer.setup()
    assert trainer.passes.scope("reference") == trainer.passes.scope("policy"), "frozen tower: one shared cache"
    trainer.model.train()  # as in the training loop
    gen = trainer._generate_and_score()
    assert gen.ref_logps is not None
    batch, pad, t = gen.batch, trainer.tokenizer.pad_token_id, run.train.temperature
    worst = 0.0
    with torch.no_grad():
        for j in range(batch.batch_size):
            keep = batch.attention_mask[j, batch.prompt_length :].bool()
            completion = batch.input_ids[j, batch.prompt_length :][keep].tolist()
            sample = trainer.dataset.rows[batch.rows[j]].to_sample()
            single = collate([trainer.encoder.encode(sample)], trainer.family, pad, [completion])
            alone = completion_logprobs(trainer.ref_model, single, trainer.family, trainer.image_token_id, t)[0]
            mask = single.completion_mask[0].bool()
            worst = max(worst, (gen.ref_logps[j, : len(completion)][mask] - alone[mask]).abs().max().item())
    assert worst <= TOL, f"max |diff| {worst}"
