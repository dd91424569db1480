"""Operator commands: `harvest keys create|list|revoke` and `harvest spend-cap on|off|status`.

`harvest keys create --name NAME [--limit LANE=N …] [--monthly-jobs N] [--token-budget N]
[--activation-quota N] [--storage-quota BYTES] [--submit-per-s R --submit-burst N --read-per-s R --read-burst N]` prints the new key alone on the last line of stdout (scripts read it
with `tail -n1`); only its hash is stored, so it is shown this once. A lane without `--limit`
has its default `key_limit` (infra/lanes.toml). `--storage-quota` takes bytes, or a number with
K, M, G or T (powers of 1024): what the key's kept job files may hold (default
HARVEST_STORAGE_QUOTA_BYTES, unlimited unless set).
`harvest keys list [--json]`: every key with its caps (request rates and storage quota included)
and its usage (this month: tokens charged, from the charge ledger; jobs submitted; active jobs per
lane; now: bytes its kept files hold); `--json` prints one JSON array for scripts.
`harvest spend-cap on --retry-after SECONDS` pauses new harvests service-wide (429 spend_cap
with that Retry-After); `harvest spend-cap off` resumes them.
"""

from __future__ import annotations

import argparse
import json
import sys

from sqlalchemy.engine import Engine

from api.auth import create_key, list_keys, revoke_key
from api.db import JobStore, transaction
from api.ratelimit import limits
from api.settings import ApiSettings
from api.store import get_spend_cap, key_usage, set_spend_cap
from harvest.lanes import load_lanes
from harvest.settings import get_settings

__all__ = ["main"]


def _store(settings: ApiSettings) -> JobStore:
    """The job store the settings name (HARVEST_DATABASE_URL), brought to the newest schema:
    the command may be the first to open a fresh one."""
    return JobStore.from_settings(settings).migrate()


def _key_rows(engine: Engine, settings: ApiSettings) -> list[dict]:
    """Each key with its effective caps and this month's usage (`keys list`)."""
    lanes = load_lanes(settings)
    rows = []
    keys = list_keys(engine)
    with transaction(engine) as conn:
        for k in keys:
            used = key_usage(conn, k.id, retention_days=settings.retention_days)
            rows.append({
                "id": k.id,
                "name": k.name,
                "prefix": k.prefix,
                "created_at": k.created_at.isoformat(),
                "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None,
                "tokens_charged": used["tokens_charged"],
                "jobs_this_month": used["jobs_this_month"],
                "active": {lane: used["active"].get(lane, 0) for lane in lanes},
                "bytes_held": used["bytes_held"],
                "caps": {
                    "lanes": {name: k.lane_limit(lane) for name, lane in lanes.items()},
                    "monthly_jobs": k.monthly_jobs,
                    "token_budget": k.token_budget,
                    "activation_quota": k.activation_quota,
                    # The quota that applies (the key's own, else the service's); None: unlimited.
                    "storage_quota": settings.storage_quota_bytes if k.storage_quota is None else k.storage_quota,
                    "rates": {kind: dict(zip(("per_s", "burst"), limits(k, kind, settings))) for kind in ("submit", "read")},
                },
            })
    return rows


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _bytes(text: str) -> int:
    """`--storage-quota`: bytes, or a whole number with K, M, G or T (powers of 1024)."""
    number, unit = (text[:-1], text[-1].upper()) if text[-1:].isalpha() else (text, "")
    if not number.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"takes bytes, or a whole number with K, M, G or T (e.g. 500G), not {text!r}")
    return int(number) * _UNITS[unit]


def _keys(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="harvest keys", description="Manage API keys.")
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="create a key and print it (last line)")
    create.add_argument("--name", required=True)
    create.add_argument("--limit", action="append", default=[], metavar="LANE=N",
                        help="concurrent jobs in a lane (repeatable; default: the lane's key_limit)")
    create.add_argument("--monthly-jobs", type=int, help="harvests per month (default unlimited)")
    create.add_argument("--token-budget", type=int, help="harvest tokens per month (default unlimited)")
    create.add_argument("--activation-quota", type=int, help="inline residual-stream positions returned per month (default unlimited)")
    create.add_argument("--storage-quota", type=_bytes, metavar="BYTES",
                        help="bytes the key's kept job files may hold, e.g. 500G (default HARVEST_STORAGE_QUOTA_BYTES, unlimited)")
    for kind in ("submit", "read"):
        create.add_argument(f"--{kind}-per-s", type=float, help=f"{kind}s a second, sustained (default HARVEST_RATE_{kind.upper()}_PER_S)")
        create.add_argument(f"--{kind}-burst", type=int, help=f"{kind}s at once (default HARVEST_RATE_{kind.upper()}_BURST)")
    listing = sub.add_parser("list", help="list keys with caps and this month's usage (never the keys themselves)")
    listing.add_argument("--json", action="store_true", help="one JSON array, for scripts")
    revoke = sub.add_parser("revoke", help="revoke a key by id, name or prefix")
    revoke.add_argument("key")
    args = parser.parse_args(argv)

    settings = get_settings(ApiSettings)
    engine = _store(settings).db
    if args.action == "create":
        for name in ("monthly_jobs", "token_budget", "activation_quota"):
            value = getattr(args, name)
            if value is not None and value < 0:
                parser.error(f"--{name.replace('_', '-')} must be 0 or more")
        limits = {}
        for text in args.limit:
            lane, _, value = text.partition("=")
            if not value.isdigit():
                parser.error(f"--limit takes LANE=N with N a whole number 0 or more, not {text!r}")
            limits[lane] = int(value)
        lanes = load_lanes(settings)
        for lane in limits:
            if lane not in lanes:
                parser.error(f"there is no lane {lane!r}; the lanes are {', '.join(lanes)}")
        try:
            key, record = create_key(
                args.name,
                monthly_jobs=args.monthly_jobs,
                token_budget=args.token_budget,
                activation_quota=args.activation_quota,
                rate_submit_per_s=args.submit_per_s,
                rate_submit_burst=args.submit_burst,
                rate_read_per_s=args.read_per_s,
                rate_read_burst=args.read_burst,
                storage_quota=args.storage_quota,
                engine=engine,
                **limits,
            )
        except ValueError as exc:
            parser.error(str(exc))
        print(f"created {record.id} ({record.name}); the key is shown once:", file=sys.stderr)
        print(key)
        return 0
    if args.action == "list":
        rows = _key_rows(engine, settings)
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        lanes = list(load_lanes(settings))
        print(f"{'id':26} {'name':20} {'prefix':12} {'caps ' + '/'.join(lanes):>16} {'active':>8} {'jobs/mo':>8} "
              f"{'tokens/mo':>12} {'act/mo':>8} {'bytes held/quota':>24}  revoked")
        for r in rows:
            none = lambda v: "-" if v is None else str(v)  # noqa: E731
            caps = "/".join(str(r["caps"]["lanes"][lane]) for lane in lanes)
            active = "/".join(str(r["active"].get(lane, 0)) for lane in lanes)
            print(
                f"{r['id']:26} {r['name'][:20]:20} {r['prefix']:12} {caps:>16} {active:>8} {r['jobs_this_month']:>8} "
                f"{r['tokens_charged']:>12} {none(r['caps']['activation_quota']):>8} "
                f"{str(r['bytes_held']) + '/' + none(r['caps']['storage_quota']):>24}  {r['revoked_at'] or '-'}"
            )
        return 0
    count = revoke_key(args.key, engine)
    print(f"revoked {count} key(s)")
    return 0 if count else 1


def _spend_cap(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="harvest spend-cap", description="Pause or resume new harvests.")
    sub = parser.add_subparsers(dest="action", required=True)
    on = sub.add_parser("on", help="pause new harvests")
    on.add_argument("--retry-after", type=int, required=True, help="seconds clients are told to wait")
    sub.add_parser("off", help="resume new harvests")
    sub.add_parser("status")
    args = parser.parse_args(argv)
    engine = _store(get_settings(ApiSettings)).db
    if args.action == "on":
        if args.retry_after < 1:
            parser.error("--retry-after must be at least 1")
        set_spend_cap(args.retry_after, engine)
    elif args.action == "off":
        set_spend_cap(None, engine)
    with transaction(engine) as conn:
        retry_after = get_spend_cap(conn)
    print("spend cap off" if retry_after is None else f"spend cap on (Retry-After: {retry_after})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("keys", "spend-cap"):
        print("usage: harvest {keys,spend-cap} ...", file=sys.stderr)
        return 2
    return _keys(argv[1:]) if argv[0] == "keys" else _spend_cap(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
