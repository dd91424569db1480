"""Operator commands: `harvest keys create|list|revoke` and `harvest spend-cap on|off|status`.

`harvest keys create --name NAME [--small N] [--large N] [--monthly-jobs N] [--token-budget N]
[--activation-quota N]` prints the new key alone on the last line of stdout (scripts read it
with `tail -n1`); only its hash is stored, so it is shown this once.
`harvest spend-cap on --retry-after SECONDS` pauses new harvests service-wide (429 spend_cap
with that Retry-After); `harvest spend-cap off` resumes them.
"""

from __future__ import annotations

import argparse
import sys

from api.auth import create_key, list_keys, revoke_key
from api.db import get_engine, transaction
from api.store import get_spend_cap, set_spend_cap

__all__ = ["main"]


def _keys(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="harvest keys", description="Manage API keys.")
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="create a key and print it (last line)")
    create.add_argument("--name", required=True)
    create.add_argument("--small", type=int, default=3, help="concurrent small-lane jobs (default 3)")
    create.add_argument("--large", type=int, default=1, help="concurrent large-lane jobs (default 1)")
    create.add_argument("--monthly-jobs", type=int, help="harvests per month (default unlimited)")
    create.add_argument("--token-budget", type=int, help="harvest tokens per month (default unlimited)")
    create.add_argument("--activation-quota", type=int, help="inline activation requests per month (default unlimited)")
    sub.add_parser("list", help="list keys (never the keys themselves)")
    revoke = sub.add_parser("revoke", help="revoke a key by id, name or prefix")
    revoke.add_argument("key")
    args = parser.parse_args(argv)

    engine = get_engine()
    if args.action == "create":
        for name in ("small", "large", "monthly_jobs", "token_budget", "activation_quota"):
            value = getattr(args, name)
            if value is not None and value < 0:
                parser.error(f"--{name.replace('_', '-')} must be 0 or more")
        key, record = create_key(
            args.name,
            small=args.small,
            large=args.large,
            monthly_jobs=args.monthly_jobs,
            token_budget=args.token_budget,
            activation_quota=args.activation_quota,
            engine=engine,
        )
        print(f"created {record.id} ({record.name}); the key is shown once:", file=sys.stderr)
        print(key)
        return 0
    if args.action == "list":
        print(f"{'id':26} {'name':20} {'prefix':12} {'small':>5} {'large':>5} {'jobs/mo':>8} {'tokens/mo':>12} {'act/mo':>8}  revoked")
        for k in list_keys(engine):
            none = lambda v: "-" if v is None else str(v)  # noqa: E731
            print(
                f"{k.id:26} {k.name[:20]:20} {k.prefix:12} {k.limit_small:>5} {k.limit_large:>5} "
                f"{none(k.monthly_jobs):>8} {none(k.token_budget):>12} {none(k.activation_quota):>8}  "
                f"{k.revoked_at.isoformat() if k.revoked_at else '-'}"
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
    engine = get_engine()
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
