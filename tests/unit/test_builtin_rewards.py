"""The built-in shaping rewards score what their docstrings promise (the demo's learning depends on them)."""

from __future__ import annotations

import pytest

from collage.training.rewards.builtins import BUILTINS, accuracy, closeness, numeric


def _as_completions(texts: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "assistant", "content": text}] for text in texts]


def test_numeric_pays_a_bare_integer_fully_and_repeated_numbers_only_half():
    texts = ["12", " 3 ", "<answer>7</answer>", "31 31 31", "3 apples", "abc", ""]
    assert numeric(_as_completions(texts)) == [1.0, 1.0, 1.0, 0.5, pytest.approx(0.5 * 1 / 7), 0.0, 0.0]


def test_closeness_is_dense_around_the_answer_and_none_where_no_integer_answer():
    texts = ["2", "3", "5 and more", "<answer>0</answer>", "two", "2", "2"]
    answers = ["2", 2, "2", "2", "2", "yes", None]
    assert closeness(_as_completions(texts), answer=answers) == [1.0, 0.5, 0.25, 1 / 3, 0.0, None, None]
    assert closeness(_as_completions(["1"])) == [None]


def test_accuracy_and_closeness_agree_on_exact_answers():
    texts, answers = ["0", "1 more words", "3."], ["0", "2", "3"]
    exact = [c == 1.0 for c in closeness(_as_completions(texts), answer=answers)]
    assert exact == [a == 1.0 for a in accuracy(_as_completions(texts), answer=answers)] == [True, False, True]


def test_the_new_rewards_are_built_in_names():
    assert BUILTINS["closeness"] is closeness and BUILTINS["numeric"] is numeric
