"""Hardening: an append-only charge ledger, per-key request-rate buckets, runs left to stop.

- `charge_ledger`: one row per ended job (UNIQUE job_id), written in the same transaction as
  the compare-and-set that ends the job (`api.store._end`). Usage and budgets are computed from
  it. Triggers refuse UPDATE and DELETE on both engines, so a charge, once made, stays.
  Jobs that ended before this revision get their row from `jobs.tokens`.
- `rate_buckets`: a token bucket per key and request kind (`api.ratelimit`), shared by every
  API replica.
- `jobs.stop_run`: a job whose start failed after its run may have been created; the watcher
  cancels that job's runs (by their `job:<id>` tag) until one cancel succeeds.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

APPEND_ONLY = "charge_ledger is append-only: a charge is never changed or removed"


def upgrade() -> None:
    ledger = op.create_table(
        "charge_ledger",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("key_id", sa.String(40), nullable=False),
        sa.Column("lane", sa.String(32), nullable=False),
        sa.Column("tokens_charged", sa.Integer, nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.UniqueConstraint("job_id", name="uq_charge_ledger_job_id"),
        sa.CheckConstraint("tokens_charged >= 0", name="ck_charge_ledger_tokens"),
        sa.CheckConstraint("outcome IN ('done', 'failed', 'cancelled')", name="ck_charge_ledger_outcome"),
    )
    op.create_index("ix_charge_ledger_key_created", "charge_ledger", ["key_id", "created_at"])
    conn = op.get_bind()
    jobs = sa.table(
        "jobs", sa.column("id", sa.String), sa.column("key_id", sa.String), sa.column("lane", sa.String),
        sa.column("tokens", sa.Integer), sa.column("status", sa.String),
        sa.column("completed_at", sa.DateTime), sa.column("created_at", sa.DateTime),
    )
    ended = conn.execute(
        sa.select(jobs.c.id, jobs.c.key_id, jobs.c.lane, jobs.c.tokens, jobs.c.status, jobs.c.completed_at, jobs.c.created_at)
        .where(jobs.c.status.in_(("done", "failed", "cancelled")))
    ).all()
    op.bulk_insert(ledger, [
        {"job_id": r.id, "key_id": r.key_id, "lane": r.lane, "tokens_charged": r.tokens or 0, "outcome": r.status,
         "created_at": r.completed_at or r.created_at}
        for r in ended
    ])
    if conn.dialect.name == "postgresql":
        op.execute(
            "CREATE FUNCTION charge_ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN RAISE EXCEPTION '{APPEND_ONLY}'; END $$"
        )
        op.execute(
            "CREATE TRIGGER charge_ledger_append_only BEFORE UPDATE OR DELETE ON charge_ledger "
            "FOR EACH ROW EXECUTE FUNCTION charge_ledger_append_only()"
        )
    else:
        for action in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER charge_ledger_no_{action.lower()} BEFORE {action} ON charge_ledger "
                f"BEGIN SELECT RAISE(ABORT, '{APPEND_ONLY}'); END"
            )

    op.create_table(
        "rate_buckets",
        sa.Column("key_id", sa.String(40), primary_key=True),
        sa.Column("kind", sa.String(16), primary_key=True),
        sa.Column("tokens", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("stop_run", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("stop_run")
    op.drop_table("rate_buckets")
    op.drop_table("charge_ledger")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS charge_ledger_append_only()")
