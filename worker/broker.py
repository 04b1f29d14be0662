"""The embedded broker: kombu's SQLAlchemy transport on a SQLite file in ``COLLAGE_HOME``.

kombu passes a transport's options to ``create_engine``, so its polling interval cannot be set through them:
it is a class attribute. This subclass polls every 50 ms, so a queued run starts well under a second after
it was submitted instead of up to a second later.
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport.sqlalchemy import Transport as SQLAlchemyTransport

ALIAS = "collage-sqla"


class EmbeddedTransport(SQLAlchemyTransport):
    polling_interval = 0.05


TRANSPORT_ALIASES.setdefault(ALIAS, "collage.worker.broker:EmbeddedTransport")


def celery_broker_url(url: str) -> str:
    """``sqla+sqlite:///...`` (the documented form) runs on the fast-polling transport."""
    if url.startswith("sqla+"):
        return f"{ALIAS}+" + url.removeprefix("sqla+")
    return url
