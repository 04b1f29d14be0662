"""Pre-launch validation of a dataset: every bad row named, plus the image and token budget per row.

Reports are cached under ``COLLAGE_HOME/cache/checks/<fingerprint>.json``. The fingerprint covers the dataset's
files (path, size, mtime, and the content hash of data files up to 1 MiB), the image files its rows name (path,
size, mtime; a path outside the dataset's data roots is never looked at, it enters as written), the data roots,
the split, the model path and ``max_prompt_length``: a changed dataset misses the cache, an
unchanged one is not decoded and encoded again (``collage data check`` and every trainer start or resume share
it). A dataset not read from local files (a hub id) is never cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any, Protocol

from collage.training.infra.home import collage_home
from collage.training.infra.images import ImageRefused, image_file
from collage.training.infra.objectstore import ARTIFACTS_ENV, ENDPOINT_ENV, ObjectMirror, mirror_for

from ..encoders import prompt_encoder_for
from .errors import RowError
from .loader import LoadedDataset, load_dataset
from .rows import RawRow, Sample, image_source

log = logging.getLogger("collage.training")

# 2: raster formats only, image paths confined to the data roots; 3: column mappings, RGB conversion, bad lines;
# 4: the dataset's one mapping in the key (rows are read on demand)
CHECK_CACHE_VERSION = 4
LARGE_IMAGE_PIXELS = 4096 * 4096  # an image above this is named in the report with what the model makes of it
SMALL_FILE = 1 << 20  # data files up to this size are fingerprinted by content, larger ones by size and mtime


class EncodedCounts(Protocol):
    """What a check reads of an encoded prompt (a :class:`~training.batching.encoding.EncodedPrompt`)."""

    input_ids: list[int]
    num_image_tokens: int
    truncated_tokens: int


class RowEncoder(Protocol):
    """Encodes a sample's prompt for one model (a :class:`~training.batching.encoding.PromptEncoder`). A check is
    handed one (or a factory of them): this package sits below the batching and model code and imports neither."""

    def encode(self, sample: Sample) -> EncodedCounts: ...


# (model, max_prompt_length) -> the encoder of a check with that model; see training.encoders.prompt_encoder_for
EncoderFactory = Callable[[str, int | None], RowEncoder]


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
    # images the processor takes after a change (RGBA composited, P, L, CMYK, EXIF rotation): how many of each
    conversions: dict[str, int] = field(default_factory=dict)
    # very large images: {row, image, width, height, image_tokens (the row's, with a model)}
    large_images: list[dict[str, Any]] = field(default_factory=list)
    sample_of: int | None = None  # a sample check: the rows of the split it was drawn from (``rows``: the sample's)

    @property
    def usable(self) -> int:
        return self.rows - len(self.errors)

    @property
    def ok(self) -> bool:
        return not self.errors and self.rows > 0

    def summary(self) -> str:
        parts = [f"{self.rows} rows", f"{len(self.errors)} bad"]
        if self.sample_of is not None:
            parts[0] = f"{self.rows} rows (a seeded sample of the {self.sample_of} rows)"
        if self.images_per_row:
            parts.append("images/row " + _stats(self.images_per_row, precision=2))
            parts.append(f"{sum(self.images_per_row)} images")
        if self.model and self.image_tokens_per_row:
            parts.append(f"image tokens/row {_stats(self.image_tokens_per_row)} for {self.model}")
            parts.append(f"prompt tokens/row {_stats(self.prompt_tokens_per_row)}")
        if self.max_prompt_length is not None and self.model:
            parts.append(f"{self.truncated_rows} rows truncated to max_prompt_length={self.max_prompt_length}")
        if self.conversions:
            parts.append(f"{sum(self.conversions.values())} images converted as the processor does")
        if self.large_images:
            parts.append(f"{len(self.large_images)} images over {LARGE_IMAGE_PIXELS // 1_000_000} MP")
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
            "conversions": self.conversions,
            "large_images": self.large_images,
            "sample_of": self.sample_of,
            "summary": self.summary(),
        }


def _stats(values: list[int], precision: int = 1) -> str:
    return f"min {min(values)} / mean {mean(values):.{precision}f} / max {max(values)}"


def _stats_dict(values: list[int]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "mean": mean(values), "max": max(values)}


def check_sample(n: int, k: int, seed: int) -> list[int]:
    """The rows of an ``n``-row split a sample check covers: ``k`` of them (all when ``n <= k``), drawn by a
    generator seeded with ``dataset.seed``, in ascending order (read in file order)."""
    if n <= k:
        return list(range(n))
    return sorted(random.Random(f"check:{seed}").sample(range(n), k))


def sample_view(dataset: LoadedDataset, k: int, seed: int) -> LoadedDataset:
    """The rows of ``dataset`` a sample check covers (:func:`check_sample`), read on demand."""
    from .rowsource import RowView

    rows = RowView(dataset.rows, check_sample(len(dataset), k, seed))
    return LoadedDataset(dataset.source, dataset.split, rows, dataset.files, dataset.roots, None, dataset.mapping)


def sampled_check(dataset: LoadedDataset, model: str | None, max_prompt_length: int | None,
                  encoder: RowEncoder | None, k: int, seed: int) -> CheckReport:  # fmt: skip
    """The check of a seeded sample of ``k`` rows (``dataset.check: sample``); never cached (it is quick)."""
    report = run_check(sample_view(dataset, k, seed), model, max_prompt_length, encoder)
    report.sample_of = len(dataset)
    return report


def check_dataset(
    source: str,
    split: str = "train",
    model: str | None = None,
    max_prompt_length: int | None = None,
    use_cache: bool = True,
    data_roots: Sequence[Path] | None = None,
    mapping: Any = None,
    config_name: str | None = None,
    limit: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    encoder_factory: EncoderFactory = prompt_encoder_for,
    **synth_options: Any,
) -> CheckReport:
    """Validate every row (the first ``limit`` with a limit: a sample); image paths must lie under ``data_roots``
    (None: unconfined); ``mapping``: the config's column mapping (:class:`~training.data.mapping.RowMapping`).
    Raises :class:`~training.data.loader.DatasetError` only when the source itself cannot be read; row problems
    are collected in the report. ``progress(done, total)`` is called as rows are checked. With a ``model``,
    ``encoder_factory(model, max_prompt_length)`` gives the prompt encoder, only when the cache misses."""
    dataset = load_dataset(source, split, data_roots=data_roots, mapping=mapping, config_name=config_name,
                           limit=limit, **synth_options)  # fmt: skip

    def encoder() -> RowEncoder | None:
        return None if model is None else encoder_factory(model, max_prompt_length)

    return cached_check(dataset, model, max_prompt_length, encoder, use_cache=use_cache and limit is None,
                        progress=progress)  # fmt: skip


def _stat(path: Path, content: bool) -> list[Any]:
    try:
        st = path.stat()
    except OSError:
        return [str(path), None]
    entry: list[Any] = [str(path), st.st_size, st.st_mtime_ns]
    if content and st.st_size <= SMALL_FILE:
        entry.append(hashlib.sha256(path.read_bytes()).hexdigest())
    return entry


def dataset_fingerprint(dataset: LoadedDataset, model: str | None, max_prompt_length: int | None) -> str | None:
    """A hash of everything a check's result depends on, or None when the dataset is not local files."""
    if dataset.files is None:
        return None
    files = [_stat(f.resolve(), content=True) for f in dataset.files]
    images: list[list[Any]] = []
    seen: set[Path] = set()
    for raw in dataset.rows:
        try:
            refs = raw.image_refs()
        except RowError:
            continue  # the data file's content covers it; the check reports the row
        for ref in refs:
            path = ref.get("path") if isinstance(ref, dict) and ref.get("bytes") is None else ref
            if not isinstance(path, str) or not path:
                continue  # inline bytes: part of the data file
            try:
                file = image_file(path, raw.base_dir, raw.roots)
            except ImageRefused:  # outside the roots: refused whatever it is, so never looked at
                images.append(["outside", path])
                continue
            if file not in seen:
                seen.add(file)
                images.append(_stat(file, content=False))
    models: list[list[Any]] = []
    if model is not None and Path(model).is_dir():  # a local model: its tokenizer/processor files may change
        models = [_stat(f, content=False) for f in sorted(Path(model).iterdir()) if f.is_file()]
    key = {
        "version": CHECK_CACHE_VERSION,
        "split": dataset.split,
        "roots": None if dataset.roots is None else [str(r) for r in dataset.roots],
        "rows": len(dataset),
        "files": files,
        "images": images,
        "model": model,
        "model_files": models,
        "max_prompt_length": max_prompt_length,
        "mapping": repr(dataset.mapping),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def check_cache_dir() -> Path:
    return collage_home() / "cache" / "checks"


def remove_temp_files_of(pid: int, root: Path) -> int:
    """Remove the half-written reports process ``pid`` left under ``root`` (a checks cache folder), for whoever
    killed it; returns how many."""
    removed = 0
    for file in root.glob(f"*.{pid}.tmp") if root.is_dir() else []:
        file.unlink(missing_ok=True)
        removed += 1
    return removed


def _report_record(report: CheckReport, fingerprint: str) -> dict[str, Any]:
    return {
        "fingerprint": fingerprint,
        "source": report.source,
        "rows": report.rows,
        "errors": [[e.row, e.message] for e in report.errors],
        "images_per_row": report.images_per_row,
        "image_tokens_per_row": report.image_tokens_per_row,
        "prompt_tokens_per_row": report.prompt_tokens_per_row,
        "truncated_rows": report.truncated_rows,
        "model": report.model,
        "max_prompt_length": report.max_prompt_length,
        "conversions": report.conversions,
        "large_images": report.large_images,
    }


def _load_cached(path: Path, fingerprint: str, source: str) -> CheckReport | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("fingerprint") != fingerprint:
            return None
        return CheckReport(
            source=source,
            rows=int(record["rows"]),
            errors=[RowError(int(row), str(message)) for row, message in record["errors"]],
            images_per_row=[int(n) for n in record["images_per_row"]],
            image_tokens_per_row=[int(n) for n in record["image_tokens_per_row"]],
            prompt_tokens_per_row=[int(n) for n in record["prompt_tokens_per_row"]],
            truncated_rows=int(record["truncated_rows"]),
            model=record["model"],
            max_prompt_length=record["max_prompt_length"],
            conversions={str(k): int(v) for k, v in record["conversions"].items()},
            large_images=list(record["large_images"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or damaged: check again


def cached_check(
    dataset: LoadedDataset,
    model: str | None,
    max_prompt_length: int | None,
    encoder: Callable[[], RowEncoder | None],
    use_cache: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> CheckReport:
    """The check report of ``dataset``, from the cache when its fingerprint matches, else computed (``encoder()``
    gives the prompt encoder, only on a miss) and stored."""
    fingerprint = dataset_fingerprint(dataset, model, max_prompt_length) if use_cache else None
    path = check_cache_dir() / f"{fingerprint}.json" if fingerprint else None
    if path is not None and fingerprint is not None:
        _fetch_shared(path)
        hit = _load_cached(path, fingerprint, dataset.source)
        if hit is not None:
            return hit
    report = run_check(dataset, model, max_prompt_length, encoder(), progress)
    if path is not None and fingerprint is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(_report_record(report, fingerprint)), encoding="utf-8")
            tmp.replace(path)
            _share(path)
        except OSError as exc:  # a read-only home only costs the next start a re-check
            log.warning("could not cache the data check in %s: %s", path.parent, exc)
    return report


CACHE_MIRROR_RETRY = 5.0  # seconds: a cache is not worth waiting out an outage for (a miss costs a re-check)


def _shared_cache() -> ObjectMirror | None:
    """With object storage (``COLLAGE_ARTIFACTS=s3://...``), the checks cache is shared through the bucket
    (``checks/<fingerprint>.json``): a run resumed on another host, or the web node's check, finds a report made
    elsewhere."""
    env = dict(os.environ)
    return mirror_for(env.get(ARTIFACTS_ENV), env.get(ENDPOINT_ENV), CACHE_MIRROR_RETRY)


def _fetch_shared(path: Path) -> None:
    mirror = None if path.is_file() else _shared_cache()
    if mirror is None:
        return
    try:
        mirror.fetch_file(f"checks/{path.name}", path)
    except Exception as exc:  # noqa: BLE001 - a cache: an unreachable bucket only costs a re-check
        log.warning("could not read the shared data-check cache: %s", exc)


def _share(path: Path) -> None:
    mirror = _shared_cache()
    if mirror is None:
        return
    try:
        mirror.put_bytes(f"checks/{path.name}", path.read_bytes(), content_type="application/json")
    except Exception as exc:  # noqa: BLE001 - a cache: the report is still kept on this host
        log.warning("could not share the data-check cache in the bucket: %s", exc)


def run_check(
    dataset: LoadedDataset,
    model: str | None,
    max_prompt_length: int | None,
    encoder: RowEncoder | None,
    progress: Callable[[int, int], None] | None = None,
) -> CheckReport:
    """Decode every row and, with an ``encoder`` (a PromptEncoder), encode its prompt."""
    report = CheckReport(source=dataset.source, rows=len(dataset), model=model, max_prompt_length=max_prompt_length)
    for done, raw in enumerate(dataset.rows, start=1):
        if progress is not None:
            progress(done, len(dataset))
        try:
            item, encoded = checked_sample(raw, encoder)
        except RowError as err:
            report.errors.append(err)
            continue
        tokens = None
        if encoded is not None:
            tokens = encoded.num_image_tokens
            report.image_tokens_per_row.append(encoded.num_image_tokens)
            report.prompt_tokens_per_row.append(len(encoded.input_ids) + encoded.truncated_tokens)
            report.truncated_rows += encoded.truncated_tokens > 0
        report.images_per_row.append(item.num_images)
        _note_images(report, item.row, item.images, tokens)
    return report


def checked_sample(raw: RawRow, encoder: RowEncoder | None) -> tuple[Sample, EncodedCounts | None]:
    """The check of one row: its sample and, with an ``encoder`` (a PromptEncoder), its encoded prompt (else
    None); :class:`RowError` when the row is unusable. The trainer runs it on a drawn row no check covered."""
    sample = raw.to_sample()
    return sample, (encoder.encode(sample) if encoder is not None else None)


def _note_images(report: CheckReport, row: int, images: list[Any], row_tokens: int | None) -> None:
    for index, image in enumerate(images):
        source = image_source(image)
        for change in source.changes if source is not None else ():
            kind = change.split(" ", 1)[0] if "converted" in change or "transparency" in change else "EXIF"
            key = "EXIF orientation" if kind == "EXIF" else f"{kind} to RGB"
            report.conversions[key] = report.conversions.get(key, 0) + 1
        if image.width * image.height > LARGE_IMAGE_PIXELS:
            report.large_images.append(
                {"row": row, "image": index, "width": image.width, "height": image.height, "image_tokens": row_tokens}
            )
