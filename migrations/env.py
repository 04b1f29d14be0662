"""Alembic environment: the URL comes from the config Collage builds (``collage.app.store.engine.alembic_config``), or
from COLLAGE_DATABASE_URL when Alembic is run by hand with ``-c migrations/alembic.ini``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool
from sqlmodel import SQLModel

import collage.app.store.tables  # noqa: F401  - registers the tables on SQLModel.metadata

config = context.config
target_metadata = SQLModel.metadata


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is None:
        if not config.get_main_option("sqlalchemy.url"):
            from collage.app.core.settings import get_settings
            from collage.app.store.engine import normalise_url

            config.set_main_option("sqlalchemy.url", normalise_url(get_settings().database_url).replace("%", "%%"))
        engine = engine_from_config(
            config.get_section(config.config_ini_section, {}), prefix="sqlalchemy.", poolclass=pool.NullPool
        )
        with engine.connect() as connection:
            _run(connection)
    else:
        _run(connectable)


def _run(connection) -> None:
    context.configure(
        connection=connection, target_metadata=target_metadata, render_as_batch=connection.dialect.name == "sqlite"
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
