"""Pre-launch validation of a dataset: every bad row named, plus the image and token budget per row."""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import mean
from typing import Any

from .loader import load_dataset
from .rows import RowError


@dataclass
class CheckReport:
    source: str
    rows: int
    errors: list[RowError] = field(default_factory=list)
    images_per_row: list[int] = field(default_factory=list)  # usable rows only
    image_tokens_per_row: list[int] = field(default_factory=list)  # with a model: vision tokens per usable row
    prompt_tokens_per_row: list[int] = field(default_factory=list)
    truncated_rows: int = 0  # rows whose text will be cut to fit max_prompt_length
    model: str | None = None
    max_prompt_length: int | None = None

    @property
    def ok(self) -> bool:
        return not self.errors and self.rows > 0

    def summary(self) -> str:
        parts = [f"{self.rows} rows", f"{len(self.errors)} bad"]
        if self.images_per_row:
            parts.append("images/row " + _stats(self.images_per_row, precision=2))
            parts.append(f"{sum(self.images_per_row)} images")
        if self.model and self.image_tokens_per_row:
            parts.append(f"image tokens/row {_stats(self.image_tokens_per_row)} for {self.model}")
            parts.append(f"prompt tokens/row {_stats(self.prompt_tokens_per_row)}")
        if self.max_prompt_length is not None and self.model:
            parts.append(f"{self.truncated_rows} rows truncated to max_prompt_length={self.max_prompt_length}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "ok": self.ok,
            "rows": self.rows,
            "errors": [{"row": e.row, "message": e.message} for e in self.errors],
            "images_per_row": _stats_dict(self.images_per_row),
            "image_tokens_per_row": _stats_dict(self.image_tokens_per_row),
            "prompt_tokens_per_row": _stats_dict(self.prompt_tokens_per_row),
            "truncated_rows": self.truncated_rows,
            "model": self.model,
            "max_prompt_length": self.max_prompt_length,
            "summary": self.summary(),
        }


def _stats(values: list[int], precision: int = 1) -> str:
    return f"min {min(values)} / mean {mean(values):.{precision}f} / max {max(values)}"


def _stats_dict(values: list[int]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "mean": mean(values), "max": max(values)}


def check_dataset(
    source: str,
    split: str = "train",
    model: str | None = None,
    max_prompt_length: int | None = None,
    **synth_options: Any,
) -> CheckReport:
    """Validate every row. Raises :class:`~training.data.loader.DatasetError` only when the source itself
    cannot be read; row problems are collected in the report."""
    dataset = load_dataset(source, split, **synth_options)
    report = CheckReport(source=source, rows=len(dataset), model=model, max_prompt_length=max_prompt_length)
    encoder = None
    if model is not None:
        from ..batching.inputs import PromptEncoder
        from ..models.loading import load_processor

        processor, family = load_processor(model)
        encoder = PromptEncoder(processor, family, max_prompt_length)
    for item in dataset.samples():
        if isinstance(item, RowError):
            report.errors.append(item)
            continue
        if encoder is not None:
            try:
                encoded = encoder.encode(item)
            except RowError as err:
                report.errors.append(err)
                continue
            report.image_tokens_per_row.append(encoded.num_image_tokens)
            report.prompt_tokens_per_row.append(len(encoded.input_ids) + encoded.truncated_tokens)
            report.truncated_rows += encoded.truncated_tokens > 0
        report.images_per_row.append(item.num_images)
    return report
