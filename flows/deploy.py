"""Apply infra/prefect.yaml to a Prefect server: work pools with their limits, then deployments.

Idempotent, so `harvest up` runs it on every start: a pool that exists is updated and its
concurrency limit re-applied (DESIGN: `--overwrite` resets limits, so we never rely on it);
deployments are upserted by (flow, name), schedules replaced. Deployments are created through
the client rather than `prefect deploy` so that no prompt, build step or git state is involved
and a start takes ~1 s; `prefect deploy --all` with the same file still works for operators.

Limits: `HARVEST_POOL_LIMIT_<LANE>` (an integer, or "none"), read through `Settings`
(`pool_limit_small`, `pool_limit_large`), overrides the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentScheduleCreate, WorkPoolCreate, WorkPoolUpdate
from prefect.client.schemas.schedules import CronSchedule
from prefect.exceptions import ObjectAlreadyExists
from prefect.flows import load_flow_from_entrypoint
from prefect.utilities.asyncutils import run_coro_as_sync

from harvest.settings import Settings, get_settings

__all__ = ["REPO", "PREFECT_YAML", "load_spec", "pool_limit", "apply", "apply_sync", "pull_steps"]

REPO = Path(__file__).resolve().parent.parent
PREFECT_YAML = REPO / "infra" / "prefect.yaml"


def load_spec(path: Path = PREFECT_YAML) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def pool_limit(pool: dict, settings: Settings | None = None) -> int | None:
    """The pool's concurrency limit: HARVEST_POOL_LIMIT_<NAME> if set (Settings), else the file's."""
    given, limit = (settings or get_settings()).pool_limit_override(pool["name"])
    return limit if given else pool.get("concurrency_limit")


def pull_steps(repo: Path = REPO) -> list[dict]:
    """None: a worker host imports the flows from the installed package (module entrypoints,
    see infra/prefect.yaml), never from a checkout or a shared disk."""
    return []


async def _apply_pool(client, pool: dict) -> None:
    limit = pool_limit(pool)
    try:
        await client.create_work_pool(
            WorkPoolCreate(name=pool["name"], type=pool.get("type", "process"), description=pool.get("description"), concurrency_limit=limit)
        )
    except ObjectAlreadyExists:
        await client.update_work_pool(pool["name"], WorkPoolUpdate(description=pool.get("description"), concurrency_limit=limit))


async def _apply_deployment(client, spec: dict, repo: Path) -> str:
    flow = load_flow_from_entrypoint(spec["entrypoint"])  # a module path: see infra/prefect.yaml
    flow_id = await client.create_flow_from_name(flow.name)
    schedules = [
        DeploymentScheduleCreate(schedule=CronSchedule(cron=s["cron"], timezone=s.get("timezone", "UTC")), active=s.get("active", True))
        for s in spec.get("schedules") or []
    ]
    deployment_id = await client.create_deployment(
        flow_id=flow_id,
        name=spec["name"],
        description=spec.get("description"),
        work_pool_name=spec["work_pool"]["name"],
        entrypoint=spec["entrypoint"],
        path=None,
        pull_steps=pull_steps(repo),
        parameter_openapi_schema=flow.parameters.model_dump(),
        parameters=spec.get("parameters") or {},
        tags=spec.get("tags") or [],
        job_variables=spec.get("job_variables") or {},
        enforce_parameter_schema=True,
    )
    # create_deployment upserts the deployment but not its schedules: replace them.
    for old in await client.read_deployment_schedules(deployment_id):
        await client.delete_deployment_schedule(deployment_id, old.id)
    if schedules:
        await client.create_deployment_schedules(deployment_id, [(s.schedule, s.active) for s in schedules])
    return f"{flow.name}/{spec['name']}"


async def apply(path: Path = PREFECT_YAML, repo: Path = REPO) -> list[str]:
    """Create or update every pool and deployment of the file; returns the deployment names."""
    spec = load_spec(path)
    names = []
    async with get_client() as client:
        for pool in spec.get("pools", []):
            await _apply_pool(client, pool)
        for deployment in spec.get("deployments", []):
            names.append(await _apply_deployment(client, deployment, repo))
    return names


def apply_sync(path: Path = PREFECT_YAML, repo: Path = REPO) -> list[str]:
    return run_coro_as_sync(apply(path, repo))
