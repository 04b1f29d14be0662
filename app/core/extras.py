"""Which optional part of Collage (a pip extra) brings which package, so that a command run without it says,
in one line, what to install instead of ending in an ImportError traceback."""

from __future__ import annotations

import importlib.util

from collage.training.infra.errors import MissingExtraError

# top-level module -> the extra that installs it (pyproject.toml's [project.optional-dependencies])
EXTRA_OF_MODULE = {
    "fastapi": "web",
    "starlette": "web",
    "uvicorn": "web",
    "jinja2": "web",
    "itsdangerous": "web",
    "multipart": "web",
    "python_multipart": "web",
    "pyarrow": "web",  # also in worker: either brings it
    "torch": "worker",
    "torchvision": "worker",
    "transformers": "worker",
    "tokenizers": "worker",
    "accelerate": "worker",
    "datasets": "worker",
    "peft": "worker",
    "safetensors": "worker",
    "num2words": "worker",
    "psycopg": "postgres",
    "redis": "redis",
    "boto3": "s3",
    "botocore": "s3",
    "trackio": "trackers",
    "wandb": "trackers",
}

# what each extra must make importable, checked before a command starts work it cannot finish
EXTRA_MODULES = {
    "web": ("fastapi", "uvicorn", "jinja2", "itsdangerous", "multipart"),
    "worker": ("torch", "torchvision", "transformers", "accelerate", "peft", "datasets"),
    "postgres": ("psycopg",),
    "redis": ("redis",),
    "s3": ("boto3",),
    "trackers": ("trackio", "wandb"),  # a worker without it mirrors nothing and says so on the run (one warning)
}


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` if one of its packages is missing."""
    for module in EXTRA_MODULES[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or blocked install counts as missing
            found = False
        if not found:
            raise MissingExtraError(extra, what, module)


def missing_extra(exc: ModuleNotFoundError, what: str) -> MissingExtraError | None:
    """The extra to install for an import that failed, or ``None`` when it is not one of Collage's extras."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    return MissingExtraError(extra, what, top) if extra else None
