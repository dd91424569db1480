"""Apply the lanes and infra/prefect.yaml to a Prefect server: work pools, then deployments.

Each lane of `infra/lanes.toml` (`harvest.lanes`) becomes a process work pool of its name with
its concurrency limit, and a deployment `harvest-<lane>` of the harvest flow on it; the
maintenance deployments (corpus refresh, retention sweep) come from infra/prefect.yaml. The
pool's per-key work queues (`flows.key_queues`, made on a key's first run) get the lane's
`key_run_limit` again, so an edit of it reaches keys seen before.

The harvest deployments' run command is the caller's: `harvest server` hands it the launcher
of its worker hosts' run starters, which forks each run from a preloaded process; without one,
runs start as Prefect's own `python -m prefect.engine`.

Idempotent, so `harvest server` runs it on every start: a pool that exists is updated and its
concurrency limit re-applied (`--overwrite` resets limits, so we never rely on it);
deployments are upserted by (flow, name), schedules replaced. Deployments are created through
the client rather than `prefect deploy` so that no prompt, build step or git state is involved
and a start takes ~1 s.
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

from flows.key_queues import aapply_key_queue_limits
from harvest.lanes import Lane

__all__ = ["REPO", "PREFECT_YAML", "HARVEST_ENTRYPOINT", "load_spec", "lane_spec", "apply", "apply_sync"]

REPO = Path(__file__).resolve().parent.parent
PREFECT_YAML = REPO / "infra" / "prefect.yaml"
# A module path with no pull steps: worker hosts import the flow from the installed package
# (see infra/prefect.yaml).
HARVEST_ENTRYPOINT = "flows.harvest.harvest"


def load_spec(path: Path = PREFECT_YAML) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def lane_spec(lanes: dict[str, Lane], run_command: str | None) -> dict[str, list[dict]]:
    """Pools and harvest deployments of the lanes, in infra/prefect.yaml's shape; each flow run
    of a lane runs `run_command` (None: Prefect's own)."""
    pools = [
        {
            "name": lane.name, "type": "process", "concurrency_limit": lane.pool_limit, "description": lane.description,
            "key_run_limit": lane.key_run_limit,
        }
        for lane in lanes.values()
    ]
    deployments = [
        {
            "name": lane.deployment.split("/", 1)[1],
            "entrypoint": HARVEST_ENTRYPOINT,
            "description": f"bulk harvest jobs of the {lane.name} lane ({lane.description}); one flow run per job",
            "work_pool": {"name": lane.name},
            "tags": ["harvest", f"lane:{lane.name}"],
            "job_variables": {"command": run_command} if run_command else {},
        }
        for lane in lanes.values()
    ]
    return {"pools": pools, "deployments": deployments}


async def _apply_pool(client, pool: dict) -> None:
    limit = pool.get("concurrency_limit")
    try:
        await client.create_work_pool(
            WorkPoolCreate(name=pool["name"], type=pool.get("type", "process"), description=pool.get("description"), concurrency_limit=limit)
        )
    except ObjectAlreadyExists:
        await client.update_work_pool(pool["name"], WorkPoolUpdate(description=pool.get("description"), concurrency_limit=limit))
    if "key_run_limit" in pool:
        await aapply_key_queue_limits(client, pool["name"], pool["key_run_limit"])


async def _apply_deployment(client, spec: dict) -> str:
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
        pull_steps=[],  # a worker host imports the flows from the installed package, never a checkout
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


async def apply(lanes: dict[str, Lane], path: Path = PREFECT_YAML, *, run_command: str | None) -> list[str]:
    """Create or update every lane's pool and deployment, then the file's deployments; returns
    the deployment names. `lanes`: the fleet's (`harvest.lanes.load_lanes`); `run_command`:
    what each harvest flow run runs (`lane_spec`), required so that no caller turns a fleet's
    launcher off by leaving it out."""
    spec = lane_spec(lanes, run_command)
    maintenance = load_spec(path).get("deployments", [])
    for deployment in maintenance:
        if deployment["work_pool"]["name"] not in lanes:
            raise ValueError(f"{path}: {deployment['name']} runs on work pool {deployment['work_pool']['name']!r}, "
                             f"which is not one of the lanes ({', '.join(lanes)})")
    names = []
    async with get_client() as client:
        for pool in spec["pools"]:
            await _apply_pool(client, pool)
        for deployment in spec["deployments"] + maintenance:
            names.append(await _apply_deployment(client, deployment))
    return names


def apply_sync(lanes: dict[str, Lane], path: Path = PREFECT_YAML, *, run_command: str | None) -> list[str]:
    return run_coro_as_sync(apply(lanes, path, run_command=run_command))
