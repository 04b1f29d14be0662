"""`collage submit --follow` (issue 27): what its progress line says about a run's rewards."""

from __future__ import annotations


def test_submit_follow_shows_the_eval_metric_once_one_is_logged():
    """`collage submit --follow`'s line: the training reward, then the held-out number the run is judged by."""
    from collage.app.cli.submit import shown_rewards

    assert shown_rewards({"latest_reward": None}) == "-"
    assert (
        shown_rewards({"latest_reward": 0.5123, "eval_metric": "eval/accuracy", "eval_metric_value": None}) == "0.512"
    )
    assert shown_rewards({"latest_reward": 0.5, "eval_reward": 0.903}) == "0.500 (eval reward 0.903)"
    ranked = {"latest_reward": 0.5, "eval_reward": 0.903, "eval_metric": "eval/accuracy", "eval_metric_value": 0.547}
    assert shown_rewards(ranked) == "0.500 (eval accuracy 0.547)"
