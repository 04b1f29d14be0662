"""The trainer's collaborators, each on its own with a real tiny model in-process: the data order's redraws
(training.data_order), the model passes (training.forward_passes), rollouts (training.rollout), the optimisation
step and the synchronised reference (training.optimization) and checkpointing (training.checkpointing). The
end-to-end runs that put them together are tests/training/test_training.py's."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from collage.training import algorithms as alg
from collage.training.batching.batch import ModelBatch, collate
from collage.training.batching.encoding import PromptEncoder
from collage.training.batching.logprobs import completion_logprobs
from collage.training.batching.vision import POLICY, REFERENCE, SHARED
from collage.training.callbacks import Callback, CallbackList, CheckpointInfo
from collage.training.checkpointing import Checkpointer, TrainerState
from collage.training.data.loader import LoadedDataset, load_dataset
from collage.training.data.rows import Sample
from collage.training.data_order import MAX_REDRAWS, DataOrder, DrawCheck
from collage.training.forward_passes import ForwardPasses, batch_to_device
from collage.training.generation_batch import GenerationBatch
from collage.training.modeling import prepare_policy, reference_model
from collage.training.models.loading import load_model
from collage.training.optimization import Optimization, loss_settings
from collage.training.rewards import Reward, resolve_reward
from collage.training.rewards.builtins import completion_text
from collage.training.rollout import Rollouts
from collage.training.trainer import TrainingError
from tests.support.training import make_config

FAMILY = "qwen2-vl"


TOL = 1e-5


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def _rows(n: int, min_images: int = 0) -> LoadedDataset:
    return load_dataset("synth:count-red", rows=n, min_images=min_images, max_images=2, seed=0)


def _fresh_policy(tiny_model_dir) -> torch.nn.Module:
    """A tiny policy of its own (the ``tiny`` fixture's models are shared, and these tests change weights)."""
    torch.manual_seed(0)
    return load_model(str(tiny_model_dir(FAMILY)), "float32")


def _scored_batch(processor, fam, samples: list[Sample], completions: list[list[int]], g: int) -> ModelBatch:
    encoder = PromptEncoder(processor, fam)
    prompts = [encoder.encode(s) for s in samples for _ in range(g)]
    return collate(prompts, fam, processor.tokenizer.pad_token_id, completions, encoder.protected)


def test_a_bad_drawn_row_is_replaced_by_a_seeded_redraw_or_fails_the_run(tiny):
    _, processor, fam = tiny(FAMILY)
    dataset = _rows(10, min_images=1)
    plain = [s.row for s in DataOrder(dataset, 3, 4, 1, 0, None).next_prompts()]
    known_bad = plain[1]  # skipped by the set-up's sample check
    check = DrawCheck(
        PromptEncoder(processor, fam), checked=set(), bad={known_bad}, bad_rows="skip", source=dataset.source
    )
    order = DataOrder(dataset, 3, 4, 1, 0, check)
    drawn = [s.row for s in order.next_prompts()]
    attempt = 1
    replacement = dataset.rows[random.Random(f"redraw:3:0:0:1:{attempt}").randrange(10)].row
    while replacement == known_bad:  # the seeded stream may draw the bad row again: it draws on
        attempt += 1
        replacement = dataset.rows[random.Random(f"redraw:3:0:0:1:{attempt}").randrange(10)].row
    assert drawn == [plain[0], replacement, *plain[2:]], "only the bad row is replaced"
    assert set(drawn) <= check.checked, "a row that passed its check is not checked again"
    assert order.take_draw_warnings() == []  # the set-up reported the rows it skipped

    # every image takes more vision tokens than this prompt budget: each drawn row fails its check now
    strict = PromptEncoder(processor, fam, max_prompt_length=2)
    skipping = DataOrder(dataset, 3, 4, 1, 0, DrawCheck(strict, set(), set(), "skip", dataset.source))
    with pytest.raises(TrainingError, match=rf"{MAX_REDRAWS} rows drawn in a row fail .*\(10 bad rows found so far\)"):
        skipping.next_prompts()
    warnings = skipping.take_draw_warnings()
    assert len(warnings) == 10 and all("skipped when drawn (dataset.bad_rows: skip)" in w for w in warnings)
    assert skipping.take_draw_warnings() == [], "each warning is taken once"
    failing = DataOrder(dataset, 3, 4, 1, 0, DrawCheck(strict, set(), set(), "fail", dataset.source))
    with pytest.raises(TrainingError, match=r"a drawn row fails `collage data check` \(dataset.bad_rows: fail\)"):
        failing.next_prompts()


# ------------------------------------------------------------------------------------------------ model passes
def test_forward_passes_encode_each_distinct_sample_once_and_give_each_row_its_own_logprobs(tiny, count_red_dir):
    model, processor, fam = tiny(FAMILY)
    samples = [s for s in load_dataset(str(count_red_dir)).load_all() if s.num_images][:3]
    g = 2
    completions = [[70 + i, 71, 72, 73][: 1 + i % 4] for i in range(len(samples) * g)]
    batch = _scored_batch(processor, fam, samples, completions, g)
    image_id = PromptEncoder(processor, fam).image_token_id
    passes = ForwardPasses(fam, image_id, 0.7, micro_batch_size=4, vision_trainable=False,
                           gradient_checkpointing=False, world=1)  # fmt: skip
    assert passes.scope("policy") == passes.scope("reference") == passes.scope("train") == SHARED
    logps = passes.batched_logps(model, batch, passes.scope("policy"))
    distinct = sum(s.num_images for s in samples)
    assert passes.images_encoded == distinct, "each sample's images once, though g rows hold them"
    again = passes.batched_logps(model, batch, passes.scope("reference"))
    assert passes.images_encoded == distinct, "a frozen tower: the reference pass reuses the features"
    assert torch.equal(logps, again) and logps.shape == batch.completion_mask.shape
    pad = processor.tokenizer.pad_token_id
    encoder = PromptEncoder(processor, fam)
    with torch.no_grad():
        for j in range(batch.batch_size):
            single = collate([encoder.encode(samples[j // g])], fam, pad, [completions[j]], encoder.protected)
            alone = completion_logprobs(model, single, fam, image_id, 0.7)[0]
            n = len(completions[j])
            assert (logps[j, :n] - alone[:n]).abs().max().item() <= TOL, j
    passes.vision.clear()  # a new generation batch: nothing cached
    passes.batched_logps(model, batch, passes.scope("policy"))
    assert passes.images_encoded == 2 * distinct

    trainable = ForwardPasses(fam, image_id, 0.7, 4, vision_trainable=True, gradient_checkpointing=False, world=1)
    assert (trainable.scope("policy"), trainable.scope("reference"), trainable.scope("train")) == (
        POLICY,
        REFERENCE,
        None,
    )
    moved = batch_to_device(batch, torch.device("cpu"), torch.float64)
    assert moved is batch and all(v.dtype == torch.float64 for v in moved.pixels.values() if v.is_floating_point())
    assert moved.input_ids.dtype == torch.long


# ------------------------------------------------------------------------------------------------ rollouts
def _chars(completions, **_):
    """A reward that differs between completions of one prompt, so every group has advantages."""
    return [float(len(completion_text(c))) for c in completions]


def test_rollouts_score_every_completion_and_give_each_group_its_advantages(tiny, accelerator):
    model, processor, fam = tiny(FAMILY)
    config = make_config(
        train={"beta": 0.04, "steps_per_generation": 2, "per_device_train_batch_size": 4, "max_completion_length": 6},
        logging={"samples_every": 2},
    )
    t = config.train
    rewards = [Reward("chars", _chars), resolve_reward("accuracy", 0.5)]
    encoder = PromptEncoder(processor, fam, t.max_prompt_length)
    passes = ForwardPasses(fam, encoder.image_token_id, t.temperature, t.per_device_train_batch_size, False, False, 1)
    reference = reference_model(model, False)  # a copy of the policy: the same log-probs, for now
    rollouts = Rollouts(config, accelerator, model, reference, False, encoder, processor.tokenizer, fam, rewards,
                        passes)  # fmt: skip
    samples = DataOrder(_rows(24), t.seed, t.generation_batch_size // t.num_generations, 1, 0, None).next_prompts()
    assert len(samples) == 2
    timings = {"timing/generation": 0.0, "timing/rewards": 0.0}
    torch.manual_seed(0)
    gen = rollouts.generate_and_score(samples, step=1, timings=timings)

    g = t.num_generations
    assert gen.batch.batch_size == len(gen.rows) == 2 * g
    assert sorted(gen.batch.rows) == sorted(s.row for s in samples for _ in range(g))
    assert timings["timing/generation"] > 0 and timings["timing/rewards"] > 0
    assert {r.step for r in gen.rows} == {2}, "rows of the step the batch is drawn for"
    for group in {r.group for r in gen.rows}:  # each group's advantages from its own rewards (GRPO, scale: group)
        rows = sorted((r for r in gen.rows if r.group == group), key=lambda r: r.index)
        assert [r.index for r in rows] == list(range(g)) and len({r.row for r in rows}) == 1
        totals = [len(r.completion) + 0.5 * r.rewards["accuracy"] for r in rows]
        assert [r.reward for r in rows] == pytest.approx(totals)
        mean, std = statistics.fmean(totals), statistics.stdev(totals)
        for row, total in zip(rows, totals, strict=True):
            assert row.advantage == pytest.approx((total - mean) / (std + alg.STD_EPS), abs=1e-5)
    assert any(r.advantage != 0 for r in gen.rows)

    # the shuffled batch keeps each row's advantage: a completion's text and prompt find its rollout row
    width = gen.batch.prompt_length
    for j in range(gen.batch.batch_size):
        keep = gen.batch.attention_mask[j, width:].bool()
        text = processor.tokenizer.decode(gen.batch.input_ids[j, width:][keep], skip_special_tokens=True)
        same = {r.advantage for r in gen.rows if r.row == gen.batch.rows[j] and r.completion == text}
        assert same and gen.advantages[j].item() == pytest.approx(same.pop(), abs=1e-6), j
    # generation spans two micro-steps (old log-probs kept) and beta > 0 (reference log-probs): equal, for now
    assert gen.old_logps is not None and gen.ref_logps is not None
    mask = gen.batch.completion_mask.bool()
    assert torch.allclose(gen.old_logps[mask], gen.ref_logps[mask], atol=TOL)
    assert gen.num_items.item() == mask.sum().item()
    assert rollouts.num_tokens == gen.metrics["num_tokens"] == gen.batch.attention_mask.sum().item()
    assert gen.metrics["num_images"] == sum(gen.batch.num_images)
    assert gen.metrics["reward"] == pytest.approx(statistics.fmean(r.reward for r in gen.rows), abs=1e-5)

    torch.manual_seed(0)
    again = rollouts.generate_and_score(samples, step=0, timings=timings)
    assert torch.equal(again.batch.input_ids, gen.batch.input_ids) and torch.equal(again.advantages, gen.advantages)
    assert again.rows == [], "samples_every: 2 logs the rows of every other step"
    assert rollouts.num_tokens == 2 * gen.metrics["num_tokens"]


# ------------------------------------------------------------------------------------------------ optimisation
def _optimization(config, accelerator, policy, passes, ref=None) -> Optimization:
    from transformers import get_scheduler

    t = config.train
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=t.learning_rate)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=t.max_steps)
    model, optimizer = accelerator.prepare(policy, optimizer)
    return Optimization(config, accelerator, model, optimizer, scheduler, loss_settings(t, 1), passes, [], ref)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_micro_steps_accumulate_their_micro_batches_loss_gradients_then_one_optimizer_step(
    tiny, tiny_model_dir, accelerator, count_red_dir
):
    _, processor, fam = tiny(FAMILY)
    config = make_config(train={"per_device_train_batch_size": 2, "num_generations": 2, "loss_type": "dapo"})
    policy = prepare_policy(_fresh_policy(tiny_model_dir), config.model, False).train()  # the vision tower frozen
    samples = load_dataset(str(count_red_dir)).load_all()[:2]
    completions = [[70, 71, 72], [80], [81, 82], [90, 91, 92, 93]]
    batch = _scored_batch(processor, fam, samples, completions, 2)
    image_id = PromptEncoder(processor, fam).image_token_id
    passes = ForwardPasses(fam, image_id, config.train.temperature, 2, False, False, 1)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    num_items = batch.completion_mask.sum()
    gen = GenerationBatch(batch, adv, None, None, num_items, {}, [])
    opt = _optimization(config, accelerator, policy, passes)

    def by_hand(index: int) -> tuple[float, dict[str, torch.Tensor]]:
        policy.zero_grad(set_to_none=True)
        mb = batch.slice(2 * index, 2 * index + 2, fam.layout).trimmed()
        logps = completion_logprobs(policy, mb, fam, image_id, config.train.temperature)
        mask = mb.completion_mask
        out = alg.grpo_loss(
            logps, None, adv[2 * index : 2 * index + 2], mask, opt.settings, num_items_in_batch=num_items
        )
        out.loss.backward()
        return out.loss.item(), _grads(policy)

    (loss0, grads0), (loss1, grads1) = by_hand(0), by_hand(1)
    policy.zero_grad(set_to_none=True)
    metrics0 = opt.micro_step(gen, 0, sync=False)
    metrics1 = opt.micro_step(gen, 1, sync=True)
    assert metrics0["loss"] == pytest.approx(loss0, abs=TOL) and metrics1["loss"] == pytest.approx(loss1, abs=TOL)
    accumulated = _grads(policy)
    assert accumulated.keys() == grads0.keys() and any(g.abs().max() > 0 for g in accumulated.values())
    for name, grad in accumulated.items():
        torch.testing.assert_close(grad, grads0[name] + grads1[name], atol=1e-6, rtol=1e-4, msg=name)

    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in accumulated.values()]))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    assert opt.learning_rate() == config.train.learning_rate
    grad_norm = opt.apply_gradients()
    assert float(grad_norm) == pytest.approx(norm.item(), rel=1e-5), "the norm before clipping"
    assert all(p.grad is None for p in policy.parameters()), "gradients cleared for the next step"
    assert any(not torch.equal(p, before[n]) for n, p in policy.named_parameters())
    assert opt.learning_rate() == pytest.approx(config.train.learning_rate / 2)  # linear over max_steps = 2


def test_the_synchronised_reference_moves_towards_the_policy_and_comes_back_from_its_state(
    tiny, tiny_model_dir, accelerator
):
    _, processor, fam = tiny(FAMILY)
    config = make_config(train={"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 2,
                                "ref_model_mixup_alpha": 0.25})  # fmt: skip
    policy = _fresh_policy(tiny_model_dir)
    ref = reference_model(policy, False)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    passes = ForwardPasses(fam, PromptEncoder(processor, fam).image_token_id, 1.0, 2, False, False, 1)
    opt = _optimization(config, accelerator, policy, passes, ref)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt.sync_reference(1)
    assert all(torch.equal(p, start[n]) for n, p in ref.named_parameters()), "not a sync step"
    opt.sync_reference(2)
    live = dict(policy.named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(p, 0.25 * live[n] + 0.75 * start[n], msg=n)
    saved = opt.reference_state()
    assert saved is not None and all(v.device.type == "cpu" for v in saved.values())

    fresh = _optimization(config, accelerator, policy, passes, reference_model(_fresh_policy(tiny_model_dir), False))
    fresh.restore_reference(None, step=1)  # before its first sync the reference is the initial policy: nothing
    fresh.restore_reference(saved, step=2)
    assert all(torch.equal(p, saved[n]) for n, p in fresh.ref_model.named_parameters())
    with pytest.raises(TrainingError, match="does not hold the synchronised reference model"):
        fresh.restore_reference(None, step=2)
    assert _optimization(config, accelerator, policy, passes).reference_state() is None  # no reference: nothing


# ------------------------------------------------------------------------------------------------ checkpointing
class Checkpoints(Callback):
    def __init__(self):
        self.written: list[CheckpointInfo] = []
        self.removed: list[int] = []

    def on_checkpoint(self, step, path, info):
        self.written.append(info)

    def on_checkpoint_removed(self, step, path):
        self.removed.append(step)


def test_the_checkpointer_saves_keeps_the_best_and_resumes_weights_random_state_and_trainer_state(
    tmp_path, tiny, tiny_model_dir, accelerator, count_red_dir
):
    _, processor, fam = tiny(FAMILY)
    train = make_config(train={"save_steps": 1, "save_total_limit": 1, "metric_for_best_model": "reward"}).train
    policy = _fresh_policy(tiny_model_dir)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    samples = load_dataset(str(count_red_dir)).load_all()[:1]
    batch = _scored_batch(processor, fam, samples, [[70, 71]], 1)
    buffer = GenerationBatch(batch, torch.tensor([0.5]), None, None, torch.tensor(2.0), {"reward": 0.5}, [])
    asked: list[int] = []

    def state(step: int):
        def make() -> TrainerState:
            asked.append(step)
            return TrainerState(step, 2 * step, 8 * step, 100.0 * step, optimizer.state_dict(), {"last_epoch": step},
                                buffer, 1, None, step - 1)  # fmt: skip

        return make

    seen = Checkpoints()
    checkpoints = Checkpointer(tmp_path, train, accelerator, policy, processor, False, CallbackList([seen]))
    for step, reward in [(1, 0.5), (2, 0.1)]:
        checkpoints.note_metrics(step, {"reward": reward})
        checkpoints.save(step, state(step))
        checkpoints.moved_on()
    assert [(i.step, i.kind, i.metric) for i in seen.written] == [(1, "full", 0.5), (2, "full", 0.1)]
    assert seen.removed == [], "the newest (2) and the best (1) stay"
    checkpoints.note_metrics(3, {"reward": 0.9})
    checkpoints.note_metrics(3, {"eval/reward": 1.0})  # an evaluation of the same step: one record
    assert checkpoints.record == (3, {"reward": 0.9, "eval/reward": 1.0})
    path = checkpoints.save(3, state(3))
    assert path == tmp_path / "checkpoints" / "step-3" and seen.removed == [1, 2], "step 3 is newest and best"
    assert checkpoints.save_if_changed(3, state(3)) is None and asked == [1, 2, 3], "nothing new: no state asked"
    found = torch.serialization.get_unsafe_globals_in_checkpoint(path / "trainer_state.pt")
    assert "collage.training.trainer.GenerationBatch" in found, "the buffer's class under the name it always had"

    expected_rng = torch.rand(4)  # what the run would have drawn next
    saved_weights = {n: p.detach().clone() for n, p in policy.named_parameters()}
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    torch.manual_seed(1234)
    resumed = Checkpointer(tmp_path, train, accelerator, policy, processor, False, CallbackList([]))
    restored = resumed.resume(world=1, rank=0)
    assert torch.equal(torch.rand(4), expected_rng), "the random stream goes on where the checkpoint left it"
    assert all(torch.equal(p, saved_weights[n]) for n, p in policy.named_parameters())
    assert (restored.step, restored.micro, restored.position, restored.num_tokens) == (3, 6, 24, 300.0)
    assert (restored.scheduler, restored.world, restored.ref_model, restored.last_eval_step) == (
        {"last_epoch": 3},
        1,
        None,
        2,
    )
    assert isinstance(restored.buffer, GenerationBatch) and torch.equal(
        restored.buffer.batch.input_ids, batch.input_ids
    )
    assert resumed.record == (3, {"reward": 0.9}), "a save at the resumed step keeps the checkpoint's value"
    assert resumed.save_if_changed(3, state(3)) is None, "the newest checkpoint holds this very state"
    with pytest.raises(TrainingError, match="written by 1 processes, not 2"):
        resumed.resume(world=2, rank=0)
    empty = Checkpointer(tmp_path / "none", train, accelerator, policy, processor, False, CallbackList([]))
    with pytest.raises(TrainingError, match="resume: no checkpoint in"):
        empty.resume(world=1, rank=0)
