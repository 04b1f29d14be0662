"""The training core end to end on tiny models in-process and synthetic multi-image data (CPU): the output folder and
its metrics, groups, advantages and rewards (None, async, columns, text reward models), determinism, cancel and
resume, the reward rising on a learnable task, what trains and what stays frozen, and refusals before training."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from collage.training.modeling import is_vision_param
from collage.training.models.families import TINY_FAMILIES
from collage.training.output import OutputFolder
from collage.training.trainer import Trainer, TrainingError
from tests.support.training import Recorder, make_config


def params_of(trainer):
    return {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}


def test_output_folder_and_metrics(tmp_path):
    rec = Recorder()
    config = make_config(train={"max_steps": 3}, logging={"samples_every": 2})
    result = Trainer(config, tmp_path, [OutputFolder(tmp_path), rec]).train()
    assert result.status == "succeeded" and result.step == 3
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    required = {
        "loss", "reward", "reward_std", "rewards/numeric/mean", "rewards/numeric/std", "rewards/accuracy/mean",
        "rewards/accuracy/std", "frac_reward_zero_std", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
        "clip_ratio/region_mean", "completions/mean_length", "completions/max_length", "completions/clipped_ratio",
        "learning_rate", "grad_norm", "num_tokens", "num_images", "step_time",
    }  # fmt: skip
    assert required <= set(lines[0]), required - set(lines[0])
    assert lines[2]["num_tokens"] > lines[0]["num_tokens"]  # cumulative, as in TRL
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {2}  # samples_every: 2
    assert len(samples) == 8
    for s in samples:
        assert set(s["rewards"]) == {"numeric", "accuracy"}
        for image in s["images"]:
            assert (tmp_path / "images" / f"{image['sha256']}.png").is_file()
    # each distinct image stored once although prompts repeat num_generations times
    hashes = [im["sha256"] for s in samples for im in s["images"]]
    assert len(list((tmp_path / "images").iterdir())) == len(set(hashes)) <= len(hashes)
    assert (tmp_path / "checkpoints" / "step-3" / "model" / "config.json").is_file()
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["max_steps"] == 3
    assert rec.ended == ("succeeded", None)


def test_groups_and_advantages_in_rollout_rows(tmp_path):
    rec = Recorder()
    Trainer(make_config(train={"max_steps": 1}), None, [rec]).train()
    rows = rec.samples
    assert len(rows) == 8
    by_group = {}
    for row in rows:
        by_group.setdefault(row.group, []).append(row)
    for members in by_group.values():
        assert len(members) == 4 and len({m.row for m in members}) == 1  # one prompt per group
        assert sorted(m.index for m in members) == [0, 1, 2, 3]
        assert abs(sum(m.advantage for m in members)) < 1e-4  # GRPO advantages are centred in a group


def test_none_rewards_and_unscorable_samples(tmp_path):
    rec = Recorder()
    config = make_config(rewards=[{"name": "tests.support.rewards:only_images"}], train={"max_steps": 1})
    Trainer(config, None, [rec]).train()
    for row in rec.samples:
        if not row.images:  # every reward returned None: unscorable, advantage 0
            assert row.reward is None and row.advantage == 0.0 and row.rewards == {"only_images": None}
        else:
            assert row.rewards["only_images"] == len(row.images)


def test_dataset_columns_reach_reward_functions(tmp_path):
    rec = Recorder()
    config = make_config(rewards=[{"name": "tests.support.rewards:sees_columns"}], train={"max_steps": 1})
    Trainer(config, None, [rec]).train()
    assert all(row.rewards["sees_columns"] == 1.0 for row in rec.samples)


def test_async_rewards_run_concurrently():
    from tests.support import rewards as r

    r.ACTIVE.update(now=0, peak=0)
    rec = Recorder()
    rewards = [{"name": "tests.support.rewards:slow_async_a"}, {"name": "tests.support.rewards:slow_async_b"}]
    Trainer(make_config(rewards=rewards, train={"max_steps": 1}), None, [rec]).train()
    assert r.ACTIVE["peak"] == 2
    assert all(row.rewards == {"slow_async_a": 0.5, "slow_async_b": 0.5} for row in rec.samples)


def test_seed_determinism_on_cpu():
    runs = []
    for _ in range(2):
        rec = Recorder()
        Trainer(make_config(train={"max_steps": 2, "seed": 3}), None, [rec]).train()
        runs.append(([m for _, m in rec.metrics], [(r.completion, r.advantage) for r in rec.samples]))
    strip = lambda ms: [{k: v for k, v in m.items() if k != "step_time" and not k.startswith("timing/")} for m in ms]  # noqa: E731
    assert strip(runs[0][0]) == strip(runs[1][0])
    assert runs[0][1] == runs[1][1]


def test_cancel_saves_a_checkpoint_and_stops(tmp_path):
    rec = Recorder(stop_after=2)
    result = Trainer(make_config(train={"max_steps": 6}), tmp_path, [OutputFolder(tmp_path), rec]).train()
    assert result.status == "cancelled" and result.step == 2
    assert (tmp_path / "checkpoints" / "step-2" / "trainer_state.pt").is_file()
    assert rec.ended == ("cancelled", None)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_reward_rises_on_a_learnable_task(algorithm):
    rec = Recorder()
    train = {
        "max_steps": 50,
        "learning_rate": 2e-2,
        "per_device_train_batch_size": 16,
        "num_generations": 4,
        "max_completion_length": 4,
        "seed": 1,
    }
    config = make_config(
        algorithm=algorithm, rewards=[{"name": "tests.support.rewards:starts_with_digit"}], train=train
    )
    Trainer(config, None, [rec]).train()
    rewards = [m["reward"] for _, m in rec.metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.4 and last > 2 * first, (algorithm, rewards)


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("mode", ["frozen", "unfrozen", "lora"])
def test_trainable_parameters_change_and_frozen_do_not(family, mode):
    model = {"path": f"tiny:{family}", "dtype": "float32", "freeze_vision": mode != "unfrozen"}
    if mode == "lora":
        model["lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    # a high learning rate and a dense reward: every trainable weight moves within a few steps
    config = make_config(
        model=model,
        rewards=[{"name": "numeric"}, {"name": "tests.support.rewards:starts_with_digit"}],
        train={"max_steps": 3, "learning_rate": 5e-2, "max_completion_length": 8, "per_device_train_batch_size": 16},
    )
    trainer = Trainer(config, None, [])
    trainer.setup()
    before = params_of(trainer)
    trainer.train()
    after = params_of(trainer)
    counts = [n for n in trainer.images_per_row]
    assert 0 in counts and max(counts) >= 2
    trainable = {n for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters() if p.requires_grad}
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert trainable, "something must train"
    assert changed == trainable, (sorted(trainable - changed)[:5], sorted(changed - trainable)[:5])
    vision = {n for n in trainable if is_vision_param(n)}
    if mode == "unfrozen":
        assert vision, "an unfrozen vision tower trains"
    else:
        assert not vision, "a frozen vision tower never trains"
    if mode == "lora":
        assert all("lora_" in n for n in trainable)


def test_resume_gives_the_same_parameters_as_an_uninterrupted_run(tmp_path):
    train = {"max_steps": 4, "save_steps": 2, "seed": 5, "steps_per_generation": 2, "per_device_train_batch_size": 4}
    config = make_config(train=train)
    full = Trainer(config, tmp_path / "full", [OutputFolder(tmp_path / "full")])
    full.train()

    part = tmp_path / "part"
    Trainer(config, part, [OutputFolder(part), Recorder(stop_after=2)]).train()  # stops after step 2
    resumed = Trainer(config, part, [OutputFolder(part)], resume=True)
    result = resumed.train()
    assert result.step == 4
    a, b = params_of(full), params_of(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
    steps = [json.loads(line)["step"] for line in (part / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # history continues, nothing duplicated
    full_metrics = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    part_metrics = [json.loads(line) for line in (part / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("reward") for m in full_metrics] == [m.get("reward") for m in part_metrics]
    assert [m["loss"] for m in full_metrics] == [m["loss"] for m in part_metrics]


def test_resume_with_sync_ref_model_restores_the_moved_reference(tmp_path):
    """TR-DPO's reference moves every ref_model_sync_steps: a resumed run continues with the moved reference
    (from the checkpoint), so it ends where an uninterrupted run ends, policy and reference alike."""
    train = {"max_steps": 4, "sync_ref_model": True, "ref_model_sync_steps": 1, "seed": 5, "save_steps": 2}
    config = make_config(algorithm="rloo", train=train)
    full = Trainer(config, tmp_path / "full")
    full.train()
    Trainer(config, tmp_path / "part", [Recorder(stop_after=2)]).train()
    resumed = Trainer(config, tmp_path / "part", resume=True)
    resumed.train()
    assert resumed.step == 4
    a, b = params_of(full), params_of(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
    full_ref = dict(full.ref_model.named_parameters())
    assert all(torch.equal(p, full_ref[n]) for n, p in resumed.ref_model.named_parameters())


def test_a_reward_that_raises_fails_the_run_naming_the_sample(tmp_path):
    rec = Recorder()
    config = make_config(
        rewards=[{"name": "tests.support.rewards:explode_on_two_images"}],
        dataset={"min_images": 2, "max_images": 2},
        train={"max_steps": 1},
    )
    with pytest.raises(TrainingError) as info:
        Trainer(config, tmp_path, [OutputFolder(tmp_path), rec]).train()
    message = str(info.value)
    assert "reward 'explode_on_two_images' raised on dataset row" in message
    assert "2 images" in message and "RuntimeError: this reward cannot handle two images" in message
    assert rec.ended[0] == "failed"
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert any(e["level"] == "error" and "Traceback" in e["message"] for e in events)


def test_unknown_reward_name_is_refused_before_training():
    with pytest.raises(TrainingError, match=r"rewards\[1\].name: unknown reward 'acuracy'"):
        Trainer(make_config(rewards=[{"name": "numeric"}, {"name": "acuracy"}]), None, []).train()


def test_a_dataset_that_fails_data_check_is_refused_before_training(tmp_path):
    (tmp_path / "train.jsonl").write_text(
        json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": "where", "images": ["missing.png"]}) + "\n"
    )
    with pytest.raises(
        TrainingError, match=r"1 of 2 rows fail .*\(dataset.bad_rows: fail\)\n.*row 1: image 0 file not found"
    ):
        Trainer(make_config(dataset={"source": str(tmp_path), "bad_rows": "fail"}), None, []).train()
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "where", "images": ["missing.png"]}) + "\n")
    with pytest.raises(TrainingError, match=r"1 of 1 rows fail .*\(no row is usable\)"):
        Trainer(make_config(dataset={"source": str(tmp_path)}), None, []).train()  # skip, but nothing is left


def test_images_alone_over_max_prompt_length_are_refused_before_training():
    with pytest.raises(TrainingError, match=r"images alone take .* max_prompt_length=8"):
        Trainer(make_config(train={"max_prompt_length": 8}, dataset={"bad_rows": "fail"}), None, []).train()


@pytest.fixture(scope="module")
def text_reward_model(tmp_path_factory):
    from collage.training.models.tiny import build_tiny_reward_model

    return str(build_tiny_reward_model(tmp_path_factory.mktemp("rm")))


def test_text_reward_model_refuses_images_by_default(text_reward_model):
    config = make_config(rewards=[{"name": text_reward_model}])
    with pytest.raises(TrainingError, match=r"rewards\[0\]: .* is a text reward model and cannot see images"):
        Trainer(config, None, []).train()


def test_text_reward_model_drop_mode_warns_as_an_event(text_reward_model, tmp_path):
    rec = Recorder()
    config = make_config(
        rewards=[{"name": text_reward_model, "on_images_for_text_reward": "drop"}], train={"max_steps": 1}
    )
    Trainer(config, tmp_path, [OutputFolder(tmp_path), rec]).train()
    warnings = [m for level, m in rec.events if level == "warning"]
    assert any("images dropped for text reward model" in m for m in warnings)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert any(e["level"] == "warning" and "images dropped" in e["message"] for e in events)
    assert all(isinstance(row.reward, float) for row in rec.samples)


def test_text_reward_model_scores_text_only_rows(text_reward_model):
    rec = Recorder()
    config = make_config(rewards=[{"name": text_reward_model}], dataset={"max_images": 0}, train={"max_steps": 1})
    # max_images 0: count-red then holds text-only rows only, which a text reward model may score
    Trainer(config, None, [rec]).train()
    assert len({row.reward for row in rec.samples}) > 1


@pytest.mark.parametrize(
    "model,train",
    [
        ({"dtype": "bfloat16"}, {}),
        ({"lora": {"r": 4, "alpha": 8}}, {"gradient_checkpointing": True}),
        ({"freeze_vision": False}, {"gradient_checkpointing": True}),
    ],
    ids=["bfloat16", "lora+gradient-checkpointing", "full+gradient-checkpointing"],
)
def test_training_options_train(model, train):
    config = make_config(
        model={"path": "tiny:qwen2-vl", "dtype": "float32", **model},
        train={"max_steps": 2, "learning_rate": 5e-2, **train},
    )
    trainer = Trainer(config, None, [])
    trainer.setup()
    before = params_of(trainer)
    trainer.train()
    after = params_of(trainer)
    trainable = {n for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters() if p.requires_grad}
    assert {n for n in before if not torch.equal(before[n], after[n])} == trainable
    if model.get("dtype") == "bfloat16":
        assert all(p.dtype == torch.bfloat16 for p in after.values())
