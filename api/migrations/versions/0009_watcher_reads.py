"""The watcher's reads cost what they answer, not the jobs held: three indexes on `jobs`.

The API's watcher (`api.watcher`) reads the jobs of the runs Prefect's events named
(`flow_run_id IN (…)`: `ix_jobs_flow_run`) and, once a tick, the next page of active jobs in id
order (`status = … AND id > … ORDER BY id LIMIT n`, once per active status:
`ix_jobs_status_id`), instead of every active job each tick; and, once per interval, the jobs
whose runs a failed start left to stop (`stop_run`, a few among many: `ix_jobs_stop_run`).

Revision ID: 0009
Revises: 0008
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.create_index("ix_jobs_flow_run", ["flow_run_id"])
        batch.create_index("ix_jobs_status_id", ["status", "id"])
        batch.create_index("ix_jobs_stop_run", ["stop_run"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_stop_run")
        batch.drop_index("ix_jobs_status_id")
        batch.drop_index("ix_jobs_flow_run")
