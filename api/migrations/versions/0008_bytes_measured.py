"""Ended jobs hold what their folders hold: `jobs.bytes_measured_at`.

`jobs.output_bytes` is the job's admitted bound (`harvest.cost.kept_bytes`: shards, request,
manifest, statistics, `_parts/`, progress) until the job has ended and nothing writes in its
folder any more; then the folder is measured (`harvest.storage.Storage.total_bytes`) and this
column says when (`api.store.settle_bytes`). Jobs that ended before this revision have it NULL,
so the API's watcher measures their folders (`api.watcher`), a few each tick, and their
figures become what is stored. The index finds those still unmeasured (a few among many).

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("bytes_measured_at", sa.DateTime, nullable=True))
        batch.create_index("ix_jobs_bytes_measured", ["bytes_measured_at"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_bytes_measured")
        batch.drop_column("bytes_measured_at")
