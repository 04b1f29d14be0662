"""A plain line chart for the docs (PIL, no plotting dependency): values in 0..1 against the optimizer step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

COLOURS = [(40, 90, 200), (30, 150, 80), (150, 60, 170), (230, 130, 20), (120, 120, 120)]


@dataclass
class Series:
    label: str
    points: Sequence[tuple[float, float]]  # (step, value in 0..1)
    colour: tuple[int, int, int] | None = None


def line_chart(
    series: Sequence[Series], path: Path, xlabel: str, levels: Sequence[tuple[str, float]] = (), top_value: float = 1.0
) -> None:
    """One line per series (dots at its points), a labelled horizontal line per ``levels`` entry, y from 0 to
    ``top_value``."""
    from PIL import Image, ImageDraw

    width, height, left, bottom, top, right = 720, 360, 60, 40, 20, 20
    image = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(image)
    steps = max((step for s in series for step, _ in s.points), default=1) or 1

    def xy(step: float, value: float) -> tuple[float, float]:
        frac = value / top_value
        return left + step / steps * (width - left - right), height - bottom - frac * (height - top - bottom)

    for i in range(5):
        tick = top_value * i / 4
        y = xy(0, tick)[1]
        pen.line([(left, y), (width - right, y)], fill=(230, 230, 230))
        pen.text((8, y - 6), f"{tick:.2f}", fill="black")
    for tick in range(0, int(steps) + 1, max(1, int(steps) // 5)):
        x = xy(tick, 0)[0]
        pen.text((x - 10, height - bottom + 8), str(tick), fill="black")
    pen.text((width // 2 - 4 * len(xlabel) // 2 - 40, height - 16), xlabel, fill="black")
    for label, value in levels:
        pen.line([xy(0, value), xy(steps, value)], fill=(200, 60, 60), width=2)
        pen.text((left + 6, xy(0, value)[1] - 14), f"{label} {value:.2f}", fill=(200, 60, 60))
    for index, s in enumerate(series):
        colour = s.colour or COLOURS[index % len(COLOURS)]
        points = [xy(step, value) for step, value in s.points]
        if len(points) > 1:
            pen.line(points, fill=colour, width=3)
        for x, y in points:
            pen.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        pen.text((width - right - 230, top + 4 + 14 * index), s.label, fill=colour)
    image.save(path)
