"""Per-key request rates: a key may have its own submit and read rates (`api.ratelimit`).

Four nullable columns on `api_keys`; NULL means the service's `HARVEST_RATE_*` setting, so
every existing key keeps the service-wide rates until given its own
(`harvest keys create --read-per-s 5 --read-burst 20 …`).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

COLUMNS = (("rate_submit_per_s", sa.Float), ("rate_submit_burst", sa.Integer), ("rate_read_per_s", sa.Float),
           ("rate_read_burst", sa.Integer))


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        for name, kind in COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        for name, _ in COLUMNS:
            batch.drop_column(name)
