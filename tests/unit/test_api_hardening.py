"""The public line of an error (``split_traceback``, ``public_error``): what was raised, also for chained,
multi-line and syntax errors, and a refusal without a traceback kept whole."""

from __future__ import annotations

import traceback


def test_the_public_line_of_a_traceback_is_what_was_raised():
    from pydantic import BaseModel

    from collage.app.store.text import public_error, split_traceback

    class Config(BaseModel):
        steps: int

    def formatted(fn) -> str:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            return "".join(traceback.format_exception(exc))
        raise AssertionError("it did not raise")

    def chained():
        try:
            {}["answer"]
        except KeyError as exc:
            raise ValueError("no answer column\n  (columns: prompt, images)") from exc

    cases = {
        # the exception's own later lines are indented (pydantic's): still its first line
        formatted(lambda: Config(steps="many")): "pydantic_core._pydantic_core.ValidationError: 1 validation error "
        "for Config",
        formatted(lambda: compile("f(", "reward.py", "exec")): "SyntaxError: '(' was never closed",
        "reward 'f' raised on dataset row 3\n" + formatted(chained): "reward 'f' raised on dataset row 3: "
        "ValueError: no answer column",
    }
    for text, public in cases.items():
        assert split_traceback(text) == (public, text)
        assert public_error(text) == public
    assert split_traceback("refused: model.path: not allowed\ndataset.source: not allowed") == (
        "refused: model.path: not allowed\ndataset.source: not allowed",
        None,
    )
