"""The prompt encoder for a model path: the one place that joins a model's processor (:mod:`training.models`) to
the prompt encoder (:mod:`training.batching`).

:mod:`training.data` sits below both (the batching modules read its samples), so a data check that counts a
model's tokens is handed an encoder factory instead of importing them; this is the factory it is handed when its
caller names only a model path. Importing this module costs nothing: the training stack (torch, transformers) is
imported only when an encoder is built, since the web tier imports the data check without that stack installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .batching.encoding import PromptEncoder


def prompt_encoder_for(model: str, max_prompt_length: int | None) -> PromptEncoder:
    """A :class:`~training.batching.encoding.PromptEncoder` for ``model`` (a path or id that
    :func:`~training.models.loading.load_processor` takes), cutting prompts to ``max_prompt_length``."""
    from .batching.encoding import PromptEncoder
    from .models.loading import load_processor

    processor, family = load_processor(model)
    return PromptEncoder(processor, family, max_prompt_length)
