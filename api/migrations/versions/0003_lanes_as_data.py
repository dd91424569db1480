"""Lanes as data: per-key caps in a table of their own, one row per key and lane.

Before, each lane was a column (`limit_small`, `limit_large`), so a new lane meant a
migration. Now a key's row in `key_lane_limits` overrides the lane's default `key_limit`
(infra/lanes.toml); a key with no row for a lane, as every existing key for a new lane, gets
that default. The two columns' values move into rows.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    limits = op.create_table(
        "key_lane_limits",
        sa.Column("key_id", sa.String(40), sa.ForeignKey("api_keys.id"), primary_key=True),
        sa.Column("lane", sa.String(32), primary_key=True),
        sa.Column("max_jobs", sa.Integer, nullable=False),
    )
    keys = sa.table("api_keys", sa.column("id"), sa.column("limit_small"), sa.column("limit_large"))
    conn = op.get_bind()
    rows = conn.execute(sa.select(keys.c.id, keys.c.limit_small, keys.c.limit_large)).all()
    op.bulk_insert(limits, [
        {"key_id": key_id, "lane": lane, "max_jobs": value}
        for key_id, small, large in rows
        for lane, value in (("small", small), ("large", large))
    ])
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("limit_small")
        batch.drop_column("limit_large")
    for table in ("jobs", "lane_locks"):
        with op.batch_alter_table(table) as batch:
            batch.alter_column("lane", type_=sa.String(32), existing_type=sa.String(16))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("limit_small", sa.Integer, nullable=False, server_default="3"))
        batch.add_column(sa.Column("limit_large", sa.Integer, nullable=False, server_default="1"))
    op.drop_table("key_lane_limits")
