"""The published OpenAPI document says exactly what each route takes and answers: request
bodies (also where the route reads the raw body to cap it), every refusal with the error
body, every `$ref` resolving, keys declared. Read from the running API (`/openapi.json`)."""

from __future__ import annotations

import pytest

from harvest.registry import load_registry
from harvest.settings import Settings
from testbed import http_calls

KEYED = {"POST /v1/harvest", "GET /v1/harvest", "GET /v1/harvest/{job_id}", "DELETE /v1/harvest/{job_id}",
         "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"}
REFUSALS = {
    "POST /v1/harvest": {400, 401, 408, 409, 413, 429, 500, 503},  # 409: an Idempotency-Key reused for another request
    "GET /v1/harvest": {400, 401, 404, 413, 429, 500},
    "GET /v1/harvest/{job_id}": {400, 401, 404, 413, 429, 500},
    "DELETE /v1/harvest/{job_id}": {401, 404, 409, 413, 429, 500},
    "GET /v1/files/{job_id}/{name}": {403, 404, 413, 500},
    "POST /v1/completions": {400, 401, 408, 413, 429, 500, 503},  # 408: admitted as a submit's body
    "POST /v1/chat/completions": {400, 401, 408, 413, 429, 500, 503},
    "GET /v1/models": {401, 413, 429, 500},
}
HEAD_REFUSALS = {408, 414, 431}  # the server's, before any route (api.http_server): on every route
REFUSALS = {route: statuses | HEAD_REFUSALS for route, statuses in REFUSALS.items()}


@pytest.fixture(scope="module")
def document(harvest_api) -> dict:
    return http_calls.get(f"{harvest_api.root}/openapi.json", timeout=60).json()


def _operations(document):
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            yield f"{method.upper()} {path}", operation


def _resolve(document, ref: str) -> dict:
    assert ref.startswith("#/"), ref
    node = document
    for part in ref[2:].split("/"):
        assert part in node, f"{ref} does not resolve"
        node = node[part]
    return node


def _refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_every_reference_resolves(document):
    """Before: POST /v1/harvest's body pointed at `#/$defs/ProjectOnto`, which does not exist."""
    refs = set(_refs(document))
    assert "#/components/schemas/ProjectOnto" in refs
    for ref in refs:
        _resolve(document, ref)


def test_request_bodies_are_declared_also_where_the_route_reads_the_raw_body(document):
    """Before: POST /v1/completions declared no body at all."""
    for name, fields in (("POST /v1/harvest", {"model", "prompts", "layers", "shard_size", "project_onto"}),
                         ("POST /v1/completions", {"model", "prompt", "max_tokens", "output_residual_stream", "stream"}),
                         ("POST /v1/chat/completions", {"model", "messages", "max_tokens", "output_residual_stream", "stream"})):
        operation = dict(_operations(document))[name]
        body = operation["requestBody"]
        assert body["required"] is True
        schema = _resolve(document, body["content"]["application/json"]["schema"]["$ref"])
        assert fields <= set(schema["properties"]) and schema["additionalProperties"] is False
        assert "llama-tiny" in schema["properties"]["model"]["enum"]


def test_every_refusal_is_documented_with_the_error_body(document):
    """Before: 400, 403, 413, 429… were missing from several routes, and 422 (never answered)
    was listed."""
    operations = dict(_operations(document))
    assert set(operations) == set(REFUSALS)
    for name, operation in operations.items():
        responses = operation["responses"]
        refusals = {int(code) for code in responses if not code.startswith("2")}
        assert refusals == REFUSALS[name], (name, sorted(refusals))
        for code in refusals:
            schema = responses[str(code)]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (name, code)
        assert (operation.get("security") == [{"bearer": []}]) == (name in KEYED), name
    error = _resolve(document, "#/components/schemas/ErrorDetail")
    assert set(error["required"]) == {"message", "type", "param", "code"}
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "An API key: `acs_…`."}


def test_a_submit_links_to_reading_and_cancelling_its_job(document):
    links = dict(_operations(document))["POST /v1/harvest"]["responses"]["202"]["links"]
    ids = {operation["operationId"] for _, operation in _operations(document)}
    assert {link["operationId"] for link in links.values()} == {"readHarvest", "cancelHarvest"} <= ids


def _pydantic_bounds(node, at="#"):
    """Where the document still carries pydantic's own names for a bound (`ge`, `le`, …),
    which JSON Schema ignores."""
    if isinstance(node, dict):
        for key in ("ge", "le", "gt", "lt"):
            if isinstance(node.get(key), (int, float)):
                yield f"{at}/{key}"
        for name, value in node.items():
            yield from _pydantic_bounds(value, f"{at}/{name}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _pydantic_bounds(value, f"{at}/{index}")


def _branch(field: dict, type_: str) -> dict:
    """The field's alternative of this type, through nested `anyOf`s."""
    for branch in field.get("anyOf", [field]):
        found = _branch(branch, type_) if "anyOf" in branch else branch if branch.get("type") == type_ else None
        if found is not None:
            return found
    return None


def test_every_range_the_server_enforces_is_stated_as_json_schema(document, harvest_api):
    """Before: `batch_size`, `logprobs` and `seed` carried `ge`/`le` (or nothing), so
    `batch_size: -232` was schema-valid, and `seed: 2**64` reached the engine (a 500)."""
    assert list(_pydantic_bounds(document)) == []
    schemas = document["components"]["schemas"]
    completion, chat, harvest = (schemas[n]["properties"] for n in ("CompletionRequest", "ChatRequest", "HarvestRequest"))
    stated = lambda field, type_="integer": {k: v for k, v in _branch(field, type_).items()  # noqa: E731
                                             if k in ("minimum", "maximum", "exclusiveMinimum")}
    assert stated(harvest["batch_size"]) == stated(harvest["shard_size"]) == {"minimum": 1, "maximum": 4096}
    for inline in (completion, chat):
        assert stated(inline["seed"]) == {"minimum": -(2**63), "maximum": 2**63 - 1}
        assert stated(inline["n"]) == {"minimum": 1, "maximum": 1}
        assert stated(inline["temperature"], "number") == {"minimum": 0.0, "maximum": 2.0}
        assert stated(inline["top_p"], "number") == {"exclusiveMinimum": 0.0, "maximum": 1.0}
        assert _branch(inline["output_residual_stream"], "array")["items"]["minimum"] == 0
    assert stated(completion["logprobs"]) == stated(chat["top_logprobs"]) == {"minimum": 0, "maximum": 5}
    assert stated(completion["max_tokens"]) == stated(chat["max_tokens"]) == {"minimum": 1}
    assert stated(completion["best_of"]) == {"minimum": 1, "maximum": 1}
    # Before: `shape` took any list of any integers (schemathesis sent `[]`, `[-3685, -3187]` and
    # 15 items, and the server's 400 read as "schema-valid request rejected").
    shape = schemas["ProjectOnto"]["properties"]["shape"]
    assert (shape["minItems"], shape["maxItems"]) == (2, 2)
    directions, hidden = shape["prefixItems"]
    assert stated(directions) == {"minimum": 1, "maximum": 64}
    served = load_registry(Settings(models_file=harvest_api.env["HARVEST_MODELS_FILE"], lanes_file=harvest_api.env["HARVEST_LANES_FILE"]))
    widest = max(m.hidden_size for m in served.all() if m.harvest)
    assert stated(hidden) == {"minimum": 1, "maximum": widest}


def test_a_seed_past_64_bits_is_a_400_naming_it(harvest_api):
    """Before: 500 (the engine's generator overflowed), failing the whole shared batch."""
    key = harvest_api.make_key()
    for route, body in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        answer = http_calls.post(f"{harvest_api.root}/v1/{route}", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": "llama-tiny", "max_tokens": 1, "seed": 2**64, **body}, timeout=60)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "seed", answer.text
