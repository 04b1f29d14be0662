"""The pure parts of held-out evaluation (docs/training.md, Evaluation): the eval metrics and pass@k from scored
completions, synthetic held-out rows from another seed and never a training row's content, and ``eval_fraction``
rows that depend on the dataset seed only."""

from __future__ import annotations

import pytest

from collage.training.config import parse_config
from collage.training.data.heldout import content_key, fraction_rows, load_heldout, synth_eval_seed
from collage.training.data.loader import load_dataset
from collage.training.evaluation import ScoredCompletion, eval_metric_keys, eval_metrics, pass_at_k


def test_eval_metrics_pure():
    names, weights = ["a", "b"], [1.0, 2.0]
    done = [
        ScoredCompletion(0, 0, (1.0, None), 3, 0),
        ScoredCompletion(0, 1, (0.0, 0.5), 5, 0),
        ScoredCompletion(1, 0, (None, None), 4, 9),  # nothing applies: no reward, still a completion
        ScoredCompletion(1, 1, (1.0, 1.0), 2, 9),
        ScoredCompletion(2, 0, (None, 0.0), 1, 3),
        ScoredCompletion(2, 1, (None, 0.0), 1, 3),
    ]
    m = eval_metrics(list(reversed(done)), names, weights, 2, pass_reward="a", pass_threshold=1.0)
    assert m["eval/reward"] == pytest.approx((1.0 + 1.0 + 3.0 + 0.0 + 0.0) / 5)
    assert m["eval/rewards/a/mean"] == pytest.approx(2 / 3) and m["eval/rewards/b/mean"] == pytest.approx(1.5 / 4)
    assert m["eval/completion_length"] == pytest.approx(16 / 6) and m["eval/rows"] == 3
    assert m["eval/by_images/0/reward"] == pytest.approx(1.0) and m["eval/by_images/8+/reward"] == 3.0
    assert m["eval/by_images/3/reward"] == 0.0
    # prompt 2 has no accuracy-type value at all: left out of pass@k; prompts 0 and 1 pass one of two
    assert m["eval/pass@1"] == pytest.approx(0.5) and m["eval/pass@2"] == 1.0
    assert set(m) == eval_metric_keys(names, "a", 2, [0, 9, 3])
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4) and pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)


def test_synthetic_held_out_rows_are_another_seed_and_never_a_training_rows_content(tmp_path):
    """Text-only sums come out of any seed: the held-out split leaves out those equal to a training row."""
    settings = parse_config({"dataset": {"source": "synth:count-red", "rows": 120, "eval_split": "test"}}).dataset
    train = load_dataset("synth:count-red", "train", rows=120, min_images=0, max_images=3, seed=0)
    heldout = load_heldout(settings, train)
    assert heldout is not None and heldout.key == "dataset.eval_split"
    assert synth_eval_seed(0, "test") not in (0, synth_eval_seed(0, "validation"), synth_eval_seed(1, "test"))
    training = {content_key(raw) for raw in train.rows}
    assert heldout.dropped, "some generated sums equal a training row"
    assert not [raw.row for raw in heldout.rows if content_key(raw) in training]
    assert len(heldout) + len(heldout.dropped) == 120
    # the same rows again (a resume, another worker)
    again = load_heldout(settings, train)
    assert [content_key(r) for r in again.rows] == [content_key(r) for r in heldout.rows]


def test_eval_fraction_rows_depend_on_the_dataset_seed_only():
    rows = fraction_rows(100, 0.1, seed=3)
    assert rows == sorted(set(rows)) and len(rows) == 10 and rows == fraction_rows(100, 0.1, seed=3)
    assert rows != fraction_rows(100, 0.1, seed=4)
    assert len(fraction_rows(7, 0.01, seed=0)) == 1  # at least one row
