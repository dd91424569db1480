"""`harvest schedule`: scheduled corpus refreshes as Prefect deployments.

    harvest schedule create --corpus URL --model M [--column text] [--layers 8,16|all]
                            [--shard-size 32] --cron "0 3 * * *" [--timezone UTC] [--name NAME]
    harvest schedule list
    harvest schedule delete NAME

`create` upserts the deployment `corpus-refresh/<name>` (default name: the corpus file's stem)
on the work pool of the model's lane with the cron schedule and the parameters above, so
running it again changes the schedule instead of adding one. The Prefect API is
PREFECT_API_URL, or the one the local stack (`harvest up`) recorded in
`$HARVEST_HOME/stack.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from prefect.client.orchestration import get_client
from prefect.client.schemas.schedules import CronSchedule
from prefect.utilities.asyncutils import run_coro_as_sync

from harvest.settings import Settings, get_settings

if TYPE_CHECKING:
    from harvest.registry import Registry

__all__ = ["create_schedule", "list_schedules", "delete_schedule", "main", "use_stack_api"]

FLOW = "corpus-refresh"
ENTRYPOINT = "flows.corpus_refresh.corpus_refresh"


def use_stack_api(home: Path) -> str | None:
    """The Prefect API to use: PREFECT_API_URL, else that of the local stack running in
    `home`, else None."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    path = home / "stack.json"
    if path.exists():
        return json.loads(path.read_text())["prefect_api_url"]
    return None


def _name_from(url: str) -> str:
    stem = url.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0]
    return re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-")[:64].strip("-") or "corpus"


async def create_schedule(corpus: str, model: str, cron: str, registry: Registry, *, column="text", layers=None, shard_size=32,
                          name=None, timezone="UTC") -> str:
    from prefect.flows import load_flow_from_entrypoint

    from harvest.corpus import read_prompts

    from flows.corpus_refresh import check_refresh_name

    name = check_refresh_name(name or _name_from(corpus))  # a folder of the storage root: never `..` or `/`
    info = registry.for_harvest(model)
    read_prompts(corpus, column=column)  # refuse a corpus that cannot be read now, not at 3 a.m.
    flow = load_flow_from_entrypoint(ENTRYPOINT)
    async with get_client() as client:
        flow_id = await client.create_flow_from_name(flow.name)
        deployment_id = await client.create_deployment(
            flow_id=flow_id,
            name=name,
            work_pool_name=info.lane,
            entrypoint=ENTRYPOINT,
            path=None,
            pull_steps=[],  # the worker host imports the flow from the installed package
            parameter_openapi_schema=flow.parameters.model_dump(),
            parameters={"corpus_url": corpus, "model": model, "column": column, "layers": layers, "shard_size": shard_size, "name": name},
            tags=["corpus-refresh", f"model:{model}", f"lane:{info.lane}"],
            description=f"re-harvest {corpus} with {model} on '{cron}' ({timezone})",
        )
        for old in await client.read_deployment_schedules(deployment_id):
            await client.delete_deployment_schedule(deployment_id, old.id)
        await client.create_deployment_schedules(deployment_id, [(CronSchedule(cron=cron, timezone=timezone), True)])
    return f"{FLOW}/{name}"


async def list_schedules() -> list[dict]:
    async with get_client() as client:
        out = []
        for d in await client.read_deployments():
            if d.entrypoint == ENTRYPOINT and d.schedules:
                out.append({"name": f"{FLOW}/{d.name}", "cron": [getattr(s.schedule, "cron", None) for s in d.schedules], "parameters": d.parameters})
        return out


async def delete_schedule(name: str) -> None:
    async with get_client() as client:
        deployment = await client.read_deployment_by_name(name if "/" in name else f"{FLOW}/{name}")
        await client.delete_deployment(deployment.id)


def _layers(text: str | None):
    if text is None or text == "all":
        return text
    return [int(p) for p in text.split(",") if p.strip()]


def _refresh_name(value: str) -> str:
    """argparse's check of `--name`, before any Prefect call (`flows.corpus_refresh.check_refresh_name`)."""
    from flows.corpus_refresh import check_refresh_name
    from harvest.errors import InvalidRequest

    try:
        return check_refresh_name(value)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="harvest schedule", description="Scheduled corpus refreshes.")
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="create or update a scheduled refresh")
    create.add_argument("--corpus", required=True, help="parquet/JSONL/txt URL (file://, s3://, or a path)")
    create.add_argument("--column", default="text")
    create.add_argument("--model", required=True)
    create.add_argument("--layers", help="comma-separated blocks or 'all' (default: quartiles)")
    create.add_argument("--shard-size", type=int, default=32)
    create.add_argument("--cron", required=True, help='cron expression, e.g. "0 3 * * *"; an optional sixth field is the second '
                             '("0 3 * * * 30": 03:00:30)')
    create.add_argument("--timezone", default="UTC")
    create.add_argument("--name", type=_refresh_name, help="schedule name: letters, digits, '-', '_' (default: the corpus file's stem)")
    sub.add_parser("list", help="list scheduled refreshes")
    delete = sub.add_parser("delete", help="delete a scheduled refresh")
    delete.add_argument("name")
    args = parser.parse_args(argv[1:])
    settings = get_settings()
    api_url = use_stack_api(settings.home)
    if api_url is None:
        print("harvest schedule: no Prefect server: start the stack (`harvest up`) or set PREFECT_API_URL.", file=sys.stderr)
        return 2

    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.prefect_auth import client_auth
    from harvest.errors import HarvestError

    auth = client_auth(settings.home)  # the control plane's password (`flows.prefect_auth`)
    try:
        with temporary_settings({PREFECT_API_URL: api_url, **({PREFECT_API_AUTH_STRING: auth} if auth else {})}):
            return _run(args, settings)
    except HarvestError as exc:
        print(f"harvest schedule: {exc.message}", file=sys.stderr)
        return 2


def _run(args, settings: Settings) -> int:
    from harvest.registry import load_registry

    if args.action == "create":
        corpus = args.corpus if "://" in args.corpus else os.path.abspath(args.corpus)
        name = run_coro_as_sync(
            create_schedule(
                corpus, args.model, args.cron, load_registry(settings), column=args.column, layers=_layers(args.layers),
                shard_size=args.shard_size, name=args.name, timezone=args.timezone,
            )
        )
        print(f"scheduled {name}: {args.cron} ({args.timezone})")
    elif args.action == "list":
        for item in run_coro_as_sync(list_schedules()):
            print(f"{item['name']}\t{','.join(c for c in item['cron'] if c)}\t{item['parameters'].get('corpus_url')}")
    else:
        run_coro_as_sync(delete_schedule(args.name))
        print(f"deleted {args.name}")
    return 0
