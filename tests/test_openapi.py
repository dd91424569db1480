"""The published OpenAPI document says exactly what each route takes and answers: request
bodies (also where the route reads the raw body to cap it), every refusal with the error
body, every `$ref` resolving, keys declared. Read from the running API (`/openapi.json`)."""

from __future__ import annotations

import httpx
import pytest

KEYED = {"POST /v1/harvest", "GET /v1/harvest", "GET /v1/harvest/{job_id}", "DELETE /v1/harvest/{job_id}",
         "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"}
REFUSALS = {
    "POST /v1/harvest": {400, 401, 408, 409, 413, 429, 500, 503},  # 409: an Idempotency-Key reused for another request
    "GET /v1/harvest": {400, 401, 404, 413, 429, 500},
    "GET /v1/harvest/{job_id}": {400, 401, 404, 413, 429, 500},
    "DELETE /v1/harvest/{job_id}": {401, 404, 409, 413, 429, 500},
    "GET /v1/files/{job_id}/{name}": {403, 404, 413, 500},
    "POST /v1/completions": {400, 401, 413, 429, 500, 503},
    "POST /v1/chat/completions": {400, 401, 413, 429, 500, 503},
    "GET /v1/models": {401, 413, 429, 500},
}


@pytest.fixture(scope="module")
def document(harvest_api) -> dict:
    return httpx.get(f"{harvest_api.root}/openapi.json", timeout=60).json()


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
