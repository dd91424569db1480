"""Per-key storage quota: the bytes a key's kept job files may hold (`api.store.bytes_held`).

`api_keys.storage_quota` (NULL: the service's HARVEST_STORAGE_QUOTA_BYTES, unlimited unless
set) and `jobs.output_bytes` (the admitted cost, then the bytes written). BIGINT: one job of
smollm2-135m with every layer writes ~69 GB, past a 32-bit integer. Jobs admitted before this
revision have no figure and count 0 (nothing can be known of them without reading storage).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("storage_quota", sa.BigInteger, nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("output_bytes", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("output_bytes")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("storage_quota")
