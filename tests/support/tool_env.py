"""An environment and a tool for the tests of multi-turn rollouts: a combination lock whose code is the row's
answer (state kept per rollout), and a tool that echoes its argument."""

from __future__ import annotations

from typing import Any


class LockEnv:
    """One instance per rollout: ``reset`` sets the code, ``try_code`` tries one, ``reward`` says if it opened."""

    def reset(self, row: dict[str, Any]) -> None:
        self.code = int(row["answer"])
        self.tries = 0
        self.opened = False

    def try_code(self, code: int) -> str:
        """Try a code on the lock.

        Args:
            code: The code to try.
        """
        self.tries += 1
        self.opened = self.opened or code == self.code
        return "open" if code == self.code else "still locked"

    def reward(self) -> float:
        return 1.0 if self.opened else 0.0


def shout(text: str) -> str:
    """Say it louder.

    Args:
        text: What to say.
    """
    return text.upper()
