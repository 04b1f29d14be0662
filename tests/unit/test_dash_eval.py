"""The launch form's help for evaluation (issue 18, section 1): every evaluation and checkpoint key of ``train`` and
``dataset`` has an entry, and each of TRL's keys is given with TRL's name."""

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
