"""The ``images`` table, as the routes use it: the sizes an API image reference carries, which hashes the store
knows (a generation may name only those), and the rows of the images a dataset preview wrote. The files themselves
are :mod:`collage.app.store.images`'."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.store.engine import session_scope
from collage.app.store.tables import Image, table_of, utcnow

from .sql import dialect_insert


def image_sizes(session: Session, shas: Iterable[str]) -> dict[str, tuple[int, int]]:
    """SHA-256 -> (width, height) of the known images among ``shas``."""
    wanted = set(shas)
    if not wanted:
        return {}
    rows = session.execute(
        select(col(Image.sha256), col(Image.width), col(Image.height)).where(col(Image.sha256).in_(list(wanted)))
    )
    return {sha: (w, h) for sha, w, h in rows}


def known_images(session: Session, shas: Iterable[str]) -> set[str]:
    """The hashes among ``shas`` that the store has an image for."""
    wanted = set(shas)
    if not wanted:
        return set()
    return set(session.scalars(select(col(Image.sha256)).where(col(Image.sha256).in_(wanted))))


def register_images(engine: Engine, images: list[dict[str, Any]]) -> None:
    """Rows for the images a dataset preview wrote (``sha256``, ``width``, ``height``, ``size_bytes``, ``path``), so
    that ``GET /images/{sha256}`` serves them; an image the store has already keeps its row. Its own transaction:
    the preview route holds no session while the dataset helper works."""
    rows = [
        {"sha256": im["sha256"], "width": im["width"], "height": im["height"], "format": "png",
         "size_bytes": im["size_bytes"], "path": im["path"], "created_at": utcnow()}
        for im in images
    ]  # fmt: skip
    with session_scope(engine) as session:
        session.execute(
            dialect_insert(session, table_of(Image)).on_conflict_do_nothing(index_elements=["sha256"]), rows
        )
