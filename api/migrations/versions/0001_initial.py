"""The first job store: keys, jobs, monthly usage, service flags, lane locks.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("revoked_at", sa.DateTime, nullable=True),
        sa.Column("limit_small", sa.Integer, nullable=False),
        sa.Column("limit_large", sa.Integer, nullable=False),
        sa.Column("monthly_jobs", sa.Integer, nullable=True),
        sa.Column("token_budget", sa.Integer, nullable=True),
        sa.Column("activation_quota", sa.Integer, nullable=True),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("key_id", sa.String(40), sa.ForeignKey("api_keys.id"), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("lane", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("n_prompts", sa.Integer, nullable=False),
        sa.Column("layers", sa.JSON, nullable=False),
        sa.Column("shard_size", sa.Integer, nullable=False),
        sa.Column("n_shards", sa.Integer, nullable=False),
        sa.Column("shards_done", sa.Integer, nullable=False, server_default="0"),
        sa.Column("add_special_tokens", sa.Boolean, nullable=False),
        sa.Column("contents", sa.String(16), nullable=False),
        sa.Column("reserved_tokens", sa.Integer, nullable=False),
        sa.Column("tokens", sa.Integer, nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("started_at", sa.DateTime, nullable=True),
        sa.Column("completed_at", sa.DateTime, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("request_url", sa.Text, nullable=False),
        sa.Column("flow_run_id", sa.String(64), nullable=True),
        sa.Column("attached_by", sa.String(64), nullable=True),
        sa.Column("result", sa.JSON, nullable=True),
    )
    op.create_index("ix_jobs_key_created", "jobs", ["key_id", "created_at"])
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_table(
        "usage",
        sa.Column("key_id", sa.String(40), sa.ForeignKey("api_keys.id"), primary_key=True),
        sa.Column("month", sa.String(7), primary_key=True),
        sa.Column("activations", sa.Integer, nullable=False, server_default="0"),
    )
    op.create_table(
        "service_flags",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text, nullable=True),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    lane_locks = op.create_table("lane_locks", sa.Column("lane", sa.String(16), primary_key=True))
    op.bulk_insert(lane_locks, [{"lane": "small"}, {"lane": "large"}])


def downgrade() -> None:
    for table in ("lane_locks", "service_flags", "usage", "jobs", "api_keys"):
        op.drop_table(table)
