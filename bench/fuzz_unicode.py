"""Fuzz every route with strings drawn from all of Unicode, lone surrogates and NUL included,
and with the bodies no JSON Schema describes (invalid UTF-8, overlong numbers, deep nesting).

    .venv/bin/python bench/fuzz_unicode.py [--store sqlite|postgres] [--cases 1000] [--seed 1]

schemathesis (`bench/fuzz_api.py`) draws its strings from what UTF-8 can encode: it never
sends a lone surrogate (`\\ud800`, which a JSON escape can spell and a Python string can hold,
but no text is), nor bytes that are not UTF-8 at all. This pass does. For each route of the
API's own `/openapi.json`, `--cases` requests (default 1,000), each a valid request with one
slot replaced: a path parameter, a query value, a string of the JSON body, or a key of it.
The replacement is a short string of code points drawn from the whole range 0 … 0x10FFFF
with NUL, the C0 controls and the surrogates D800 … DFFF weighted up, and it travels

- in a body: as a JSON escape (`\\ud800`), or as its raw bytes (`surrogatepass`: the bytes
  ED A0 80, which are not UTF-8);
- in a path or a query: percent-encoded from the same bytes (`%ED%A0%80`, `%00`).

Then, per route that takes a body, the hostile bodies of `HOSTILE_BODIES`.

A case fails when its answer is a 5xx, a status the route does not document, or no answer.
Prints per route the cases and the answers by status, and exits non-zero on any failure.
The server is the test fixtures' `ApiServer` (the real app under uvicorn, the real tiny model
for inline completions) with `fuzz_api.fuzz_env`'s settings, on SQLite or, with
`--store postgres`, on the PostgreSQL server at 127.0.0.1:5432 (a schema of its own,
dropped after). CI runs a smaller pass on both stores (`tests/test_unicode_fuzz.py`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from urllib.parse import quote

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BODIES = {
    "POST /v1/harvest": {"model": "llama-tiny", "prompts": ["The cat sat.", "On the mat."], "layers": [0],
                         "shard_size": 1, "add_special_tokens": True},
    "POST /v1/completions": {"model": "llama-tiny", "prompt": "The cat", "max_tokens": 1, "temperature": 0,
                             "output_residual_stream": [0]},
    "POST /v1/chat/completions": {"model": "llama-tiny", "messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 1, "temperature": 0},
}
"""A valid body per route that takes one: each case replaces one of its strings or keys."""

HOSTILE_BODIES = {
    "invalid UTF-8": b'{"model": "llama-tiny", "prompt\xff": "\xc3\x28 \xed\xa0\x80"}',
    "overlong integer": b'{"model": "llama-tiny", "max_tokens": ' + b"9" * 5000 + b', "shard_size": ' + b"9" * 5000 + b"}",
    "overlong float": b'{"model": "llama-tiny", "max_tokens": 1e400, "shard_size": 1e400, "temperature": 1e400}',
    "deep nesting": b'{"model": "llama-tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "deep objects": b'{"model": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    "NUL everywhere": json.dumps({"model": "llama\x00", "prompt": "\x00", "prompts": ["\x00"],
                                  "messages": [{"role": "user\x00", "content": "\x00"}]}).encode(),
    "NaN": b'{"model": "llama-tiny", "prompt": "Hi", "temperature": NaN, "top_p": Infinity}',
}
"""Bodies beyond what a schema-driven fuzzer sends, each sent to every route that takes a body."""

PATH_DEFAULTS = {"job_id": "00000000-0000-0000-0000-000000000000", "name": "manifest.json"}


def random_text(rng: random.Random) -> str:
    """A short string from all of Unicode, NUL, controls and surrogates weighted up."""
    pools = [
        lambda: rng.randint(0, 0x10FFFF),
        lambda: rng.randint(0xD800, 0xDFFF),  # lone surrogates (two in a row may pair up: fine)
        lambda: rng.choice([0, 0, 1, 0x1F, 0x7F, 0x85, 0x2028, 0xFEFF, 0xFFFE, 0xFFFF, 0x10FFFF]),
        lambda: rng.randint(0x20, 0x7E),
    ]
    return "".join(chr(rng.choice(pools)()) for _ in range(rng.randint(0, 12)))


def _wire(text: str) -> bytes:
    """The bytes of `text` as sent raw: surrogates as their three bytes, which are not UTF-8."""
    return text.encode("utf-8", "surrogatepass")


def _slots(node, path=()):
    """Every string and every key of a JSON body, as paths into it."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield ("key", path + (key,))
            yield from _slots(value, path + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _slots(value, path + (i,))
    elif isinstance(node, str):
        yield ("value", path)


def _replaced(body, slot, text: str):
    kind, path = slot
    body = json.loads(json.dumps(body))  # a copy
    parent = body
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if kind == "key":
        parent[text] = parent.pop(last)
    else:
        parent[last] = text
    return body


def cases_for(route: str, operation: dict, rng: random.Random, n: int):
    """`n` requests for one route: (path, query string, body bytes or None), one slot each fuzzed."""
    method, template = route.split(" ", 1)
    parameters = [p for p in operation.get("parameters", []) if p["in"] in ("path", "query")]
    body = BODIES.get(route)
    slots = [("param", p) for p in parameters] + ([("body", s) for s in _slots(body)] if body else [])
    for _ in range(n):
        where, slot = rng.choice(slots) if slots else ("none", None)
        text = random_text(rng)
        if where == "param" and slot["in"] == "path" and not text:
            text = "\x00"  # an empty segment is another route (`/v1/harvest/` redirects to the list)
        path, query = template, []
        for p in parameters:
            fuzzed = where == "param" and slot is p
            raw = _wire(text) if fuzzed else PATH_DEFAULTS.get(p["name"], "1").encode()
            if p["in"] == "path":
                # `.` too: a client drops a `.` or `..` segment (RFC 3986), sending another route.
                path = path.replace("{" + p["name"] + "}", quote(raw, safe="").replace(".", "%2E"))
            elif fuzzed or p["name"] == "limit":
                query.append(f"{p['name']}={quote(raw, safe='')}")
        content = None
        if body is not None:
            sent = _replaced(body, slot, text) if where == "body" else body
            # Half as JSON escapes (valid JSON, not text), half as raw bytes (not UTF-8).
            content = json.dumps(sent).encode() if rng.random() < 0.5 else _wire(json.dumps(sent, ensure_ascii=False))
        yield method, path, "&".join(query), content


def run_pass(root: str, key: str, *, cases: int, seed: int) -> dict:
    """The fuzz pass against a running API: per route, the answers by status and the failures."""
    import httpx

    document = httpx.get(f"{root}/openapi.json", timeout=60).json()
    rng = random.Random(seed)
    report: dict[str, dict] = {}
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    started = time.monotonic()
    with httpx.Client(base_url=root, headers=headers, timeout=120) as client:
        for template, operations in document["paths"].items():
            for method, operation in operations.items():
                route = f"{method.upper()} {template}"
                documented = {int(s) for s in operation["responses"] if s.isdigit()}
                entry = report.setdefault(route, {"cases": 0, "statuses": {}, "failures": []})
                requests = list(cases_for(route, operation, rng, cases))
                if route in BODIES:
                    requests += [(method.upper(), template, "", hostile) for hostile in HOSTILE_BODIES.values()]
                for verb, path, query, content in requests:
                    entry["cases"] += 1
                    url = path + (f"?{query}" if query else "")
                    try:
                        status = client.request(verb, url, content=content).status_code
                    except httpx.HTTPError as exc:
                        entry["failures"].append({"url": url[:200], "body": (content or b"")[:200].decode("latin-1"),
                                                  "error": repr(exc)})
                        continue
                    entry["statuses"][str(status)] = entry["statuses"].get(str(status), 0) + 1
                    if status >= 500 or status not in documented:
                        entry["failures"].append({"url": url[:200], "body": (content or b"")[:200].decode("latin-1"),
                                                  "status": status})
    return {"routes": report, "cases": sum(r["cases"] for r in report.values()),
            "failures": sum(len(r["failures"]) for r in report.values()), "seconds": round(time.monotonic() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--cases", type=int, default=1000, help="fuzzed requests per route")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    from bench.fuzz_api import fresh_home, fuzz_server

    with fresh_home() as home, fuzz_server(home, args.store, "unicode") as (server, key):
        result = run_pass(server.root, key, cases=args.cases, seed=args.seed)
    for route, entry in result["routes"].items():
        print(f"{route:34} {entry['cases']:6} cases  {json.dumps(entry['statuses'])}  failures {len(entry['failures'])}")
        for failure in entry["failures"][:5]:
            print("   ", json.dumps(failure)[:400])
    print(json.dumps({"store": args.store, "seed": args.seed, "cases": result["cases"], "failures": result["failures"],
                      "seconds": result["seconds"]}))
    return 0 if result["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
