"""The tool rewards (tool_format, tool_bonus, zoom_hit) on hand-built trajectories, edge cases included."""

from __future__ import annotations

from typing import Any

from PIL import Image

from collage.training.data.synth import generate
from collage.training.rewards.builtins import BUILTINS, tool_bonus, tool_format, zoom_boxes, zoom_hit
from collage.training.rewards.registry import reward_docs
from collage.training.tools.types import ToolCall, ToolImage, Turn

ZOOM = "image_zoom_in"


def _completions(texts: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "assistant", "content": text}] for text in texts]


def _zoom(bbox: list[float], image: int = 0, crop_size: tuple[int, int] | None = None, error: str | None = None):
    """A model turn that calls image_zoom_in and the tool turn answering it (its crop, or ``error``)."""
    call = ToolCall(ZOOM, {"bbox_2d": bbox, "image": image})
    text = f'<tool_call>{{"name": "{ZOOM}", "arguments": {{"bbox_2d": {bbox}, "image": {image}}}}}</tool_call>'
    if error is not None:
        return [Turn("assistant", text, call), Turn("tool", error, call, error=error)]
    size = crop_size or (max(1, int(bbox[2] - bbox[0])), max(1, int(bbox[3] - bbox[1])))
    crop = ToolImage(Image.new("RGB", size), {"image": image, "bbox_2d": bbox})
    return [Turn("assistant", text, call), Turn("tool", "", call, images=[crop])]


def _malformed() -> list[Turn]:
    call = ToolCall("", {}, error="the tool call is not valid JSON")
    return [
        Turn("assistant", "<tool_call>{not json</tool_call>", call),
        Turn("tool", call.error or "", call, error=call.error),
    ]


def _answer(text: str) -> Turn:
    return Turn("assistant", text)


def test_the_tool_rewards_are_documented_built_ins():
    docs = reward_docs()
    for name, fn in (("tool_format", tool_format), ("tool_bonus", tool_bonus), ("zoom_hit", zoom_hit)):
        assert BUILTINS[name] is fn
        assert "None" in docs[name] and len(docs[name]) > 200


def test_tool_format_is_one_for_parsed_calls_zero_for_any_malformed_and_none_without_calls():
    failed_run = _zoom([0, 0, 10, 10], error="bbox_2d lies outside image 0 (640x640)")
    trajectories: list[list[Any]] = [
        [*_zoom([0, 0, 100, 100]), _answer("<answer>3</answer>")],  # one good call
        [*_zoom([0, 0, 100, 100]), *_zoom([50, 50, 90, 90]), _answer("<answer>3</answer>")],  # two good calls
        [*_malformed(), _answer("<answer>3</answer>")],  # malformed
        [*_zoom([0, 0, 100, 100]), *_malformed(), _answer("<answer>3</answer>")],  # one of two malformed
        [*failed_run, _answer("<answer>3</answer>")],  # parsed, the tool failed: still well-formed
        [_answer("<answer>3</answer>")],  # no call
        [],  # a rollout without tools
    ]
    completions = _completions(["<answer>3</answer>"] * len(trajectories))
    assert tool_format(completions, trajectories=trajectories) == [1.0, 1.0, 0.0, 0.0, 1.0, None, None]


def test_tool_format_sees_every_call_of_a_turn_and_calls_that_never_ran():
    good, bad = ToolCall(ZOOM, {"bbox_2d": [0, 0, 64, 64]}), ToolCall("", {}, error='the tool call has no "name"')
    crop = ToolImage(Image.new("RGB", (64, 64)), {"image": 0, "bbox_2d": [0, 0, 64, 64]})
    # one model turn with two calls records only the first; each call has its tool turn
    two_in_one = [Turn("assistant", "...", good), Turn("tool", "", good, [crop]), Turn("tool", "x", bad, error="x")]
    # a call the call limit kept from running: no tool turn answers it
    capped = [*_zoom([0, 0, 64, 64]), Turn("assistant", "<tool_call>{}</tool_call>", bad)]
    unanswered_good = [Turn("assistant", "...", good)]
    trajectories = [two_in_one, capped, unanswered_good]
    assert tool_format(_completions(["a"] * 3), trajectories=trajectories) == [0.0, 0.0, 1.0]


def test_tool_rewards_take_missing_trajectories_as_no_calls():
    completions = _completions(["<answer>7</answer>", "<answer>2</answer>"])
    assert tool_format(completions) == [None, None]
    assert tool_bonus(completions, answer=["7", "7"]) == [0.0, 0.0]
    assert zoom_hit(completions, region=[[0, 0, 10, 14], [0, 0, 10, 14]]) == [0.0, 0.0]


def test_tool_bonus_pays_only_a_right_answer_reached_with_a_working_call():
    cases = [
        ("<answer>7</answer>", "7", [*_zoom([0, 0, 64, 64]), _answer("<answer>7</answer>")], 1.0),
        ("<answer>7</answer>", "7", [_answer("<answer>7</answer>")], 0.0),  # right, no call
        ("<answer>4</answer>", "7", [*_zoom([0, 0, 64, 64]), _answer("<answer>4</answer>")], 0.0),  # wrong, a call
        ("<answer>7</answer>", "7", [*_malformed(), _answer("<answer>7</answer>")], 0.0),  # right, malformed call
        ("<answer>7</answer>", "7", [*_zoom([0, 0, 9, 9], error="timed out"), _answer("x")], 0.0),  # the tool failed
        ("<answer>7</answer>", None, [*_zoom([0, 0, 64, 64])], None),  # the row has no answer
        ("7.", 7, [*_malformed(), *_zoom([1, 1, 30, 30]), _answer("7.")], 1.0),  # accuracy's own matching
    ]
    texts, answers, trajectories, want = (list(column) for column in zip(*cases, strict=True))
    assert tool_bonus(_completions(texts), answer=answers, trajectories=trajectories) == want
    assert tool_bonus(_completions(texts), trajectories=trajectories) == [None] * len(cases)  # no answer column


def test_zoom_hit_asks_for_a_successful_zoom_around_the_regions_centre():
    region = [100, 200, 110, 214]  # centre (105, 207)
    trajectories: list[list[Any]] = [
        [*_zoom([80, 180, 140, 240]), _answer("<answer>1</answer>")],  # holds the centre
        [*_zoom([105, 207, 300, 300])],  # the centre on the border counts
        [*_zoom([0, 0, 50, 50]), *_zoom([90, 190, 130, 230])],  # the second call hits
        [*_zoom([0, 0, 104, 640])],  # overlaps the region but misses its centre
        [*_zoom([0, 0, 50, 50])],  # a miss
        [*_zoom([80, 180, 140, 240], error="the tool raised")],  # a failed call does not count
        [*_malformed()],
        [_answer("<answer>1</answer>")],  # no call
        [*_zoom([80, 180, 140, 240])],  # a row without a region
    ]
    regions: list[Any] = [region] * 8 + [None]
    completions = _completions(["<answer>1</answer>"] * len(trajectories))
    got = zoom_hit(completions, region=regions, trajectories=trajectories)
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, None]
    assert zoom_hit(completions, trajectories=trajectories) == [None] * len(trajectories)  # no region column


def test_zoom_hit_maps_a_zoom_into_an_earlier_crop_back_to_the_image():
    region = [300, 300, 310, 314]  # centre (305, 307)
    # a crop of [0, 0, 200, 200] of image 0, shown enlarged to 400x400 (2x): image 1 of the rollout
    first = _zoom([0, 0, 200, 200], image=0, crop_size=(400, 400))
    inside = _zoom([100, 100, 340, 340], image=1)  # image 1's (100..340) is image 0's (50..170)
    assert zoom_boxes([*first, *inside]) == [(0, 0.0, 0.0, 200.0, 200.0), (0, 50.0, 50.0, 170.0, 170.0)]
    # in image 1's own pixels the second box would hold (305, 307); mapped back to image 0 it does not
    assert zoom_hit(_completions(["a"]), region=[region], trajectories=[[*first, *inside]]) == [0.0]
    # a crop of a crop of a crop: offsets and scales compose
    third = _zoom([20, 20, 60, 60], image=2, crop_size=(40, 40))  # image 2 is 240x240 for 120x120 of image 0
    assert zoom_boxes([*first, *inside, *third])[-1] == (0, 60.0, 60.0, 80.0, 80.0)
    # a zoom into an image that does not exist (yet) is not mapped
    assert zoom_boxes(_zoom([100, 100, 340, 340], image=1)) == []


def test_zoom_hit_ignores_other_tools_images_and_zooms_into_them():
    region = [300, 300, 310, 314]
    rotate = ToolCall("image_rotate", {"image": 0, "degrees": 90})
    rotated = ToolImage(Image.new("RGB", (640, 640)), {"image": 0, "bbox_2d": [0, 0, 640, 640]})
    trajectory = [Turn("assistant", "", rotate), Turn("tool", "", rotate, images=[rotated])]
    assert zoom_hit(_completions(["a"]), region=[region], trajectories=[trajectory]) == [0.0]
    into_rotated = _zoom([0, 0, 640, 640], image=1)  # a zoom into the rotated image: its coordinates are not image 0's
    assert zoom_hit(_completions(["a"]), region=[region], trajectories=[[*trajectory, *into_rotated]]) == [0.0]


def test_zoom_hit_counts_the_rows_own_images_before_the_tool_images():
    region = [300, 300, 310, 314]
    # a row with two images: the row's second image is image 1 (the region is in image 0's pixels), a crop image 2
    other_image = _zoom([280, 280, 330, 330], image=1)
    images = [[Image.new("RGB", (640, 640))] * 2]
    assert zoom_hit(_completions(["a"]), region=[region], trajectories=[other_image], images=images) == [0.0]
    first = _zoom([0, 0, 200, 200], image=1, crop_size=(400, 400))
    into_crop = _zoom([100, 100, 340, 340], image=2)
    assert zoom_boxes([*first, *into_crop], row_images=2)[-1] == (1, 50.0, 50.0, 170.0, 170.0)
    assert zoom_boxes([*first, *into_crop], row_images=1) == []  # with one row image, image 1 was never shown


def test_zoom_hit_on_a_find_digit_row_with_its_real_crop():
    (row, (image,)), *_ = generate("find-digit", 1, 1, 1, seed=5)
    x1, y1, x2, y2 = row["region"]
    box = [max(0, x1 - 40), max(0, y1 - 40), min(640, x2 + 40), min(640, y2 + 40)]
    call = ToolCall(ZOOM, {"bbox_2d": box, "image": 0})
    crop = ToolImage(
        image.crop(tuple(box)).resize((4 * (box[2] - box[0]), 4 * (box[3] - box[1]))), {"image": 0, "bbox_2d": box}
    )
    trajectory = [
        Turn("assistant", "", call),
        Turn("tool", "", call, images=[crop]),
        _answer(f"<answer>{row['answer']}</answer>"),
    ]
    completions = _completions([f"<answer>{row['answer']}</answer>"])
    kwargs = dict(answer=[row["answer"]], region=[row["region"]], trajectories=[trajectory], images=[[image]])
    assert zoom_hit(completions, **kwargs) == [1.0]
    assert tool_bonus(completions, **kwargs) == [1.0]
    assert tool_format(completions, **kwargs) == [1.0]
