"""Held-out evaluation during training (docs/training.md, Evaluation), end to end on tiny models in-process that see
their images and synthetic multi-image data (CPU): the logged metrics against a recomputation from the stored eval
rollouts, held-out rows never in a training batch, bad held-out rows refused before training, greedy determinism
and an untouched training stream, cancel during an evaluation, and resume or a crash without repeating one."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from collage.training.callbacks import Callback
from collage.training.data.synth import write_synth
from collage.training.output import OutputFolder
from collage.training.trainer import Trainer, TrainingError
from tests.support.training import Recorder, make_config

WEIGHTS = {"numeric": 0.5, "only_images": 0.25, "accuracy": 2.0}


REWARDS = [
    {"name": "numeric", "weight": 0.5},
    {"name": "tests.support.rewards:only_images", "weight": 0.25},  # None on text-only prompts
    {"name": "accuracy", "weight": 2.0},
]


def _lines(file: Path) -> list[dict]:
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def _eval_keys(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("eval/")}


def _no_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "step_time" and not k.startswith("timing/")} for r in records]


def _content(sample) -> str:
    """What a prompt shows the model: its conversation, its images' pixels and its answer."""
    images = [hashlib.sha256(im.tobytes()).hexdigest() + str(im.size) for im in sample.images]
    return json.dumps([sample.prompt, images, sample.columns.get("answer")], sort_keys=True)


class WatchedTrainer(Trainer):
    """Records every prompt a training batch takes and every evaluation batch (the instrumented data order)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained: list = []  # samples of training batches
        self.eval_batches: list[tuple[int, list[int]]] = []  # (step, held-out positions)

    def _prompts_for_generation(self):
        samples = super()._prompts_for_generation()
        self.trained.extend(samples)
        return samples

    def _evaluate_batch(self, positions, raws):
        self.eval_batches.append((self.step, list(positions)))
        return super()._evaluate_batch(positions, raws)


def _recompute(rows: list[dict], pass_reward: str, threshold: float, generations: int) -> dict[str, float]:
    """The evaluation's metrics from its stored rollout rows alone, written out independently of the trainer."""
    rewards, lengths, by_images, per_fn, groups = [], [], {}, {}, {}
    for row in rows:
        applicable = {fn: v for fn, v in row["rewards"].items() if v is not None}
        reward = sum(WEIGHTS[fn] * v for fn, v in applicable.items()) if applicable else None
        assert reward == pytest.approx(row["reward"]) if reward is not None else row["reward"] is None
        lengths.append(row["completion_length"])
        n = len(row["images"])
        if reward is not None:
            rewards.append(reward)
            by_images.setdefault(str(n) if n < 8 else "8+", []).append(reward)
        else:
            by_images.setdefault(str(n) if n < 8 else "8+", [])
        for fn, v in applicable.items():
            per_fn.setdefault(fn, []).append(v)
        groups.setdefault(row["group"], []).append(row["rewards"][pass_reward])
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    out = {
        "eval/reward": mean(rewards),
        "eval/completion_length": mean(lengths),
        "eval/rows": float(len(groups)),
        **{f"eval/rewards/{fn}/mean": mean(per_fn.get(fn, [])) for fn in WEIGHTS},
        **{f"eval/by_images/{n}/reward": mean(values) for n, values in by_images.items()},
    }
    judged = [[v is not None and v >= threshold for v in values] for values in groups.values()]
    out["eval/pass@1"] = mean([sum(p) / len(p) for p in judged])
    if generations > 1:
        out[f"eval/pass@{generations}"] = mean([1.0 if any(p) else 0.0 for p in judged])
    return out


def test_eval_metrics_equal_a_recomputation_from_the_stored_eval_rollouts(tmp_path):
    """eval_on_start and every step, 2 sampled completions per prompt, prompts of 0..9 images (every by_images
    bucket up to 8+ appears), a reward that is None on text-only prompts: each logged eval key equals the
    recomputation from samples.jsonl, and eval rows are the contract's (split, group, index, step, advantage)."""
    train = {
        "max_steps": 2, "eval_strategy": "steps", "eval_steps": 1, "eval_on_start": True, "eval_num_generations": 2,
        "eval_temperature": 1.0, "per_device_eval_batch_size": 6, "eval_max_rows": 14,
        "eval_pass_reward": "numeric", "eval_pass_threshold": 0.25, "max_prompt_length": 512,
    }  # fmt: skip
    config = make_config(
        rewards=REWARDS,
        dataset={"eval_split": "test", "rows": 40, "min_images": 0, "max_images": 9, "seed": 1},
        logging={"samples_every": 0},  # no training rows: the eval rows are written whatever this says
        train=train,
    )
    trainer = Trainer(config, tmp_path, [OutputFolder(tmp_path)])
    trainer.train()
    metrics = {m["step"]: m for m in _lines(tmp_path / "metrics.jsonl")}
    samples = _lines(tmp_path / "samples.jsonl")
    assert {s["split"] for s in samples} == {"eval"} and sorted({s["step"] for s in samples}) == [0, 1, 2]
    assert set(metrics[0]) == {"step", "timing/eval"} | set(_eval_keys(metrics[0]))  # step 0: evaluation only
    assert "loss" in metrics[1] and "eval/reward" in metrics[1]  # one record: the step's training and evaluation
    held = trainer.heldout.rows
    for step in (0, 1, 2):
        rows = sorted((s for s in samples if s["step"] == step), key=lambda s: (s["group"], s["index"]))
        assert [(s["group"], s["index"]) for s in rows] == [(g, i) for g in range(14) for i in range(2)]
        assert {s["advantage"] for s in rows} == {0.0}
        assert [s["dataset_row"] for s in rows[::2]] == [raw.row for raw in held]
        expected = _recompute(rows, "numeric", 0.25, 2)
        logged = _eval_keys(metrics[step])
        assert set(logged) == set(expected), set(logged) ^ set(expected)
        for key, value in expected.items():
            assert logged[key] == pytest.approx(value, rel=1e-12, nan_ok=True), key
        assert metrics[step]["timing/eval"] > 0
    buckets = {k.split("/")[2] for k in metrics[0] if k.startswith("eval/by_images/")}
    assert buckets >= {"0", "8+"} and len(buckets) >= 5, buckets
    assert 0.0 < metrics[1]["eval/pass@1"] <= metrics[1]["eval/pass@2"] <= 1.0  # the completions differ


def _eval_source(tmp_path: Path) -> str:
    folder = tmp_path / "other"
    write_synth("count-red", folder, rows=10, min_images=1, max_images=2, seed=77)
    return str(folder)


@pytest.mark.parametrize("how", ["eval_split", "eval_source", "eval_fraction"])
def test_no_held_out_row_is_ever_in_a_training_batch(tmp_path, how):
    """The trainer's data order, instrumented: over more than one epoch of the training rows, no training batch
    holds a held-out row (by row id for eval_fraction, a slice of the training split; by content for the others),
    every other training row is trained on, and each evaluation scores exactly the held-out rows."""
    dataset = {"rows": 12, "min_images": 0, "max_images": 2}
    if how == "eval_split":
        dataset["eval_split"] = "test"
    elif how == "eval_source":
        dataset["eval_source"] = _eval_source(tmp_path)
    else:
        dataset["eval_fraction"] = 0.25
    train = {"max_steps": 7, "eval_strategy": "steps", "eval_steps": 3, "per_device_eval_batch_size": 4}
    rec = Recorder()
    trainer = WatchedTrainer(make_config(dataset=dataset, train=train), tmp_path / "out", [rec])
    trainer.train()
    held = trainer.heldout.rows
    trained_ids = {s.row for s in trainer.trained}
    if how == "eval_fraction":
        ids = {raw.row for raw in held}
        assert ids == set(trainer.heldout.held_rows) and len(ids) == 3
        assert not ids & trained_ids
        assert trained_ids == set(range(12)) - ids, "the other rows are all trained on"
        record = json.loads((tmp_path / "out" / "eval_rows.json").read_text())
        assert record["held_out_rows"] == sorted(ids) and record["evaluated_rows"] == sorted(ids)
        assert any("held out for evaluation and never trained on" in m and str(sorted(ids)[0]) in m
                   for _, m in rec.events)  # fmt: skip
    else:
        assert trained_ids == set(range(12)), "an epoch and more of the training split"
        evaluated = {_content(raw.to_sample()) for raw in held}
        assert not evaluated & {_content(s) for s in trainer.trained}
    assert len(trainer.trained) > 12  # more than one epoch
    positions = {step: [] for step, _ in trainer.eval_batches}
    for step, batch in trainer.eval_batches:
        positions[step].extend(batch)
    assert positions == {step: list(range(len(held))) for step in (3, 6, 7)}  # every eval_steps, and the last step
    eval_rows = [r for r in rec.samples if r.split == "eval"]
    assert {r.row for r in eval_rows} == {raw.row for raw in held}


def test_bad_held_out_rows_are_refused_before_training_naming_the_key(tmp_path):
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": "where", "images": ["missing.png"]}) + "\n")
    write_synth("count-red", tmp_path, rows=12, min_images=0, max_images=2, seed=1)  # train.jsonl beside it
    config = make_config(dataset={"source": str(tmp_path), "eval_split": "test"}, train={"eval_on_start": True})
    with pytest.raises(
        TrainingError,
        match=r"(?s)dataset.eval_split: .*split 'test': 1 of 1 held-out rows fail.*row 0: image 0 file not found",
    ):
        Trainer(config, None, []).setup()
    missing = make_config(dataset={"eval_source": str(tmp_path / "nowhere.jsonl")}, train={"eval_on_start": True})
    with pytest.raises(TrainingError, match=r"dataset.eval_source: .*does not exist"):
        Trainer(missing, None, []).setup()
    best = make_config(
        dataset={"eval_split": "test"},
        train={"eval_strategy": "steps", "metric_for_best_model": "eval/pass@1", "max_steps": 2},
        rewards=[{"name": "numeric"}],  # no accuracy-type reward: no pass@k
    )
    with pytest.raises(TrainingError, match=r"train.metric_for_best_model: this run logs no 'eval/pass@1'"):
        Trainer(best, None, []).setup()


def test_greedy_eval_is_deterministic_and_leaves_the_training_run_unchanged(tmp_path):
    """Greedy: the same metrics twice. Training metrics with evaluation (at start and every step) are those of the
    same run without it: the evaluation neither draws from the training stream nor leaves the policy in eval mode."""
    evaluate = {"eval_strategy": "steps", "eval_steps": 1, "eval_on_start": True, "eval_max_rows": 8,
                "per_device_eval_batch_size": 4}  # fmt: skip
    runs = []
    for train in (evaluate, evaluate, {}):
        rec = Recorder()
        trainer = Trainer(make_config(dataset={"eval_split": "test"}, train={"max_steps": 3, "seed": 4, **train}),
                          None, [rec])  # fmt: skip
        trainer.train()
        assert trainer.model.training
        runs.append(([m for s, m in rec.metrics if s > 0], {s: _eval_keys(m) for s, m in rec.metrics}, rec.samples))
    (with_a, eval_a, rows_a), (with_b, eval_b, _), (without, eval_none, rows_none) = runs
    assert eval_a == eval_b and sorted(eval_a) == [0, 1, 2, 3]
    assert all(eval_a[s]["eval/rows"] == 8 for s in eval_a)
    assert not any(eval_none.values())
    strip = lambda ms: [{k: v for k, v in m.items() if not k.startswith("eval/")} for m in _no_timing(ms)]  # noqa: E731
    assert strip(with_a) == strip(without)
    train_rows = lambda rows: [(r.step, r.completion) for r in rows if r.split == "train"]  # noqa: E731
    assert train_rows(rows_a) == train_rows(rows_none)


class StopInEval(Callback):
    """Asks to stop once the evaluation of ``step`` has scored its first batch."""

    def __init__(self, trainer_ref: list, step: int):
        self.trainer_ref, self.step = trainer_ref, step

    def should_stop(self) -> bool:
        trainer = self.trainer_ref[0]
        return any(step == self.step for step, _ in trainer.eval_batches)


EVAL_RESUME = {
    "max_steps": 4, "seed": 5, "eval_strategy": "steps", "eval_steps": 2, "eval_on_start": True, "eval_max_rows": 6,
    "per_device_eval_batch_size": 2, "save_steps": 2, "metric_for_best_model": "eval/reward",
}  # fmt: skip


def test_cancel_during_an_evaluation_then_resume_runs_it_once(tmp_path):
    config = make_config(dataset={"eval_split": "test"}, train=EVAL_RESUME)
    out = tmp_path / "run"
    ref: list = []
    trainer = WatchedTrainer(config, out, [OutputFolder(out), StopInEval(ref, 2)])
    ref.append(trainer)
    result = trainer.train()
    assert result.status == "cancelled" and result.step == 2
    assert [b for b in trainer.eval_batches if b[0] == 2] == [(2, [0, 1])], "abandoned after its first batch"
    records = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "eval/reward" not in records[2] and "loss" in records[2]  # the step's training record, no evaluation
    assert json.loads((out / "checkpoints" / "step-2" / "checkpoint.json").read_text())["metric_value"] is None
    events = [json.loads(line)["message"] for line in (out / "events.jsonl").read_text().splitlines()]
    assert any("during its evaluation; checkpoint saved" in e for e in events)
    assert {s["step"] for s in _lines(out / "samples.jsonl") if s["split"] == "eval"} == {0}

    resumed = WatchedTrainer(config, out, [OutputFolder(out)], resume=True)
    assert resumed.train().status == "succeeded"
    assert sorted({step for step, _ in resumed.eval_batches}) == [2, 4]  # the interrupted one, then the next
    records = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 2, 3, 4]
    assert [r["step"] for r in records if "eval/reward" in r] == [0, 2, 4]
    eval_steps = [s["step"] for s in _lines(out / "samples.jsonl") if s["split"] == "eval"]
    assert eval_steps == [0] * 6 + [2] * 6 + [4] * 6
    # the checkpoint of step 2 now records its evaluation (its metric, and that it ran)
    info = json.loads((out / "checkpoints" / "step-2" / "checkpoint.json").read_text())
    assert info["metric_value"] == pytest.approx(records[3]["eval/reward"])


def test_resume_after_an_evaluation_never_repeats_it_and_keeps_the_history(tmp_path):
    config = make_config(dataset={"eval_split": "test"}, train=EVAL_RESUME)
    out = tmp_path / "run"
    first = WatchedTrainer(config, out, [OutputFolder(out), Recorder(stop_after=3)])  # step 0's, 1's, 2's records
    assert first.train().step == 2
    assert sorted({s for s, _ in first.eval_batches}) == [0, 2]
    resumed = WatchedTrainer(config, out, [OutputFolder(out)], resume=True)
    resumed.train()
    assert sorted({s for s, _ in resumed.eval_batches}) == [4], "step 2's evaluation is not run again"
    records = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in records if "eval/reward" in r] == [0, 2, 4]
    assert (
        sorted(s["step"] for s in _lines(out / "samples.jsonl") if s["split"] == "eval") == [0] * 6 + [2] * 6 + [4] * 6
    )

    # stopped right after eval_on_start: the checkpoint of step 0 records it, a resume does not run it again
    start = tmp_path / "start"
    only_start = WatchedTrainer(config, start, [OutputFolder(start), Recorder(stop_after=1)])
    assert only_start.train().step == 0
    again = WatchedTrainer(config, start, [OutputFolder(start)], resume=True)
    again.train()
    assert sorted({s for s, _ in again.eval_batches}) == [2, 4]
    assert [r["step"] for r in _lines(start / "metrics.jsonl") if "eval/reward" in r] == [0, 2, 4]


class CrashOnEvalRows(Callback):
    """A process killed after step ``step``'s evaluation reached the record, before any checkpoint of that step."""

    def __init__(self, step: int):
        self.step = step

    def on_samples(self, step, rows):
        if step == self.step and rows and rows[0].split == "eval":
            raise RuntimeError("killed")


def test_a_crash_after_an_evaluation_before_its_checkpoint_redoes_it_once(tmp_path):
    train = {**EVAL_RESUME, "eval_steps": 1, "eval_on_start": False, "metric_for_best_model": None}
    config = make_config(dataset={"eval_split": "test"}, train=train)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="killed"):
        WatchedTrainer(config, out, [OutputFolder(out), CrashOnEvalRows(3)]).train()
    resumed = WatchedTrainer(config, out, [OutputFolder(out)], resume=True)  # from step 2's checkpoint
    resumed.train()
    assert sorted({s for s, _ in resumed.eval_batches}) == [3, 4]
    records = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all("eval/reward" in r for r in records)
    eval_steps = sorted(s["step"] for s in _lines(out / "samples.jsonl") if s["split"] == "eval")
    assert eval_steps == [1] * 6 + [2] * 6 + [3] * 6 + [4] * 6
