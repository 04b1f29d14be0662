"""The dashboard's evaluation views (issue 18, section 1) in a real browser against a real `collage serve`: the run
page's Evaluation section (eval/reward over the training reward, one chart of the eval reward per number of images)
following a running run live, the compare page's eval overlays and chart filter, the runs table's latest and best
eval reward, the rollouts page's split selector with its table, count, group view, gallery and exports, and the
launch form's evaluation and checkpoint settings.

The trainer's evaluation is built in parallel: these tests write eval metrics (`eval/*` keys in a step's metrics
record) and eval rollout rows (`split="eval"`, each evaluation in a call of its own) straight into the server's
store with `StoreWriter`, as the trainer's store callback will.
"""

from __future__ import annotations


def test_the_launch_form_has_every_evaluation_key_with_trls_name():
    from collage.app.web.fields import HELP

    trl = {"eval_strategy", "eval_steps", "eval_on_start", "per_device_eval_batch_size", "save_total_limit",
           "metric_for_best_model", "greater_is_better"}  # fmt: skip
    ours = {"eval_num_generations", "eval_temperature", "eval_max_rows", "eval_pass_reward", "eval_pass_threshold"}
    for key in trl | ours:
        assert f"train.{key}" in HELP, key
    for key in trl:
        assert f"TRL: {key}" in HELP[f"train.{key}"][0], key
    for key in ("eval_split", "eval_source", "eval_fraction"):
        assert f"dataset.{key}" in HELP, key
