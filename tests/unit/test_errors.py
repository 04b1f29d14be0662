"""One documented exception tree per tier, under CollageError (docs/errors.md), and causes kept, not flattened."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

from collage.training.infra.errors import CollageError, InputError, MissingExtraError, RunError

ROOT = Path(__file__).resolve().parents[2]


def _exception_classes(tier: str) -> list[type[BaseException]]:
    package = importlib.import_module(f"collage.{tier}")
    found: list[type[BaseException]] = []
    for module in pkgutil.walk_packages(package.__path__, f"collage.{tier}."):
        if module.name.endswith("__main__"):
            continue
        loaded = importlib.import_module(module.name)
        for _, cls in inspect.getmembers(loaded, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == module.name and cls not in found:
                found.append(cls)
    return found


def _tier_bases(tier: str) -> tuple[type[BaseException], ...]:
    if tier == "training":
        return (InputError, RunError, MissingExtraError)
    if tier == "worker":
        from collage.worker.errors import WorkerError

        return (WorkerError,)
    from collage.app.core.errors import PlatformError, WebError
    from collage.app.store.errors import StoreError

    return (WebError, StoreError, PlatformError)


@pytest.mark.parametrize("tier", ["training", "worker", "app"])
def test_every_exception_class_sits_under_its_tiers_base(tier):
    classes = _exception_classes(tier)
    assert classes, "no exception class found: the walk is broken"
    bases = _tier_bases(tier)
    outside = [
        f"{cls.__module__}.{cls.__name__}"
        for cls in classes
        if cls not in (CollageError, *bases) and not issubclass(cls, bases)
    ]
    assert outside == [], f"not under {[b.__name__ for b in bases]}: {outside}"


@pytest.mark.parametrize("tier", ["training", "worker", "app"])
def test_docs_errors_names_every_class(tier):
    page = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    missing = [cls.__name__ for cls in _exception_classes(tier) if f"`{cls.__name__}`" not in page]
    assert missing == []


def test_a_re_raised_error_keeps_its_cause(tmp_path):
    """The reader gets one line; whoever debugs it gets the original exception as the cause."""
    from collage.training.data.errors import DatasetError
    from collage.training.data.loader import load_dataset

    (tmp_path / "train.csv").write_bytes(b"prompt,answer\n\xff\xfe,1\n")
    with pytest.raises(DatasetError) as info:
        load_dataset(str(tmp_path / "train.csv"))
    assert "not UTF-8 text" in str(info.value)
    assert isinstance(info.value.__cause__, UnicodeDecodeError)
    assert isinstance(info.value, InputError) and isinstance(info.value, ValueError)
