"""Alembic environment of the job store.

`api.db.upgrade` hands in a live connection (so tests and the API migrate whatever engine they
use); run by hand, it migrates the database of HARVEST_DATABASE_URL.
"""

from alembic import context

from api.db import database_url, make_engine, metadata
from api.settings import ApiSettings
from harvest.settings import get_settings

config = context.config


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    with make_engine(database_url(get_settings(ApiSettings))).begin() as conn:
        _run(conn)
