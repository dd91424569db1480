"""Fleet: job status lives in the database alone; a watcher lease; a restart budget per job.

- `jobs.attached_by` goes: a job's status no longer depends on which API process reads it.
- `jobs.restarts`: how often the job's run was rescheduled after its host died (bounded).
- `leases`: one row per lease (the watcher's), so exactly one API replica follows Prefect.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("attached_by")
        batch.add_column(sa.Column("restarts", sa.Integer, nullable=False, server_default="0"))
    op.create_table(
        "leases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(200), nullable=False),
        sa.Column("expires_at", sa.DateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("leases")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("restarts")
        batch.add_column(sa.Column("attached_by", sa.String(64), nullable=True))
