"""The playground's prompts (``prompt_conversation``): images placed at their ``[image N]`` markers or before the
text, and markers that do not match the images refused with the reason."""

from __future__ import annotations

import re

import pytest


def test_prompts_place_images_with_markers_or_before_the_text():
    from collage.app.playground.request import Refused, prompt_conversation

    assert prompt_conversation("Count.", 2) == (
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Count."}]}],
        [0, 1],
    )
    conversation, order = prompt_conversation("Is [image 2] brighter than [image 1]?", 2)
    assert conversation[0]["content"] == [{"type": "text", "text": "Is "}, {"type": "image"},
                                          {"type": "text", "text": " brighter than "}, {"type": "image"},
                                          {"type": "text", "text": "?"}]  # fmt: skip
    assert order == [1, 0]  # the second image fills the first placeholder
    for prompt, why in [("[image 1] and [image 3]", "has 2 image"), ("[image 1] [image 1]", "more than once"),
                        ("only [image 1]", "not [image 2]")]:  # fmt: skip
        with pytest.raises(Refused, match=re.escape(why)):
            prompt_conversation(prompt, 2)
    stored = [{"role": "user", "content": [{"type": "text", "text": "Image 1: "}, {"type": "image"}]}]
    assert prompt_conversation(stored, 1) == (stored, [0])
    with pytest.raises(Refused, match="placeholder"):
        prompt_conversation(stored, 2)
