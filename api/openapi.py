"""The published OpenAPI document, exactly as the API behaves.

FastAPI documents what it parses itself; the routes here read raw bodies (to cap them before
parsing, `api.guard`), answer refusals through one handler, and check keys by hand, so this
module says the rest:

- `request_body(Model)`: the route's JSON body, with the model's schema placed under
  `components/schemas` (its nested models too), so every `$ref` resolves. Pydantic's own
  schema points at `#/$defs/...`, which does not exist in an OpenAPI document.
- `errors(*statuses)`: the service's error body for each refusal a route can answer. Every route
  also documents 413 (bodies are capped everywhere) and 500 (the request-id answer).
- `bearer`: the routes that need an API key say so (`security`), so generated clients send it.
- FastAPI's 422 is dropped: validation failures are answered 400 with the error body.
- `model` names the registry's served models (`enum`; harvests: those that harvest), and
  `layers` its depth, so a client (or a fuzzer) knows what it may send; what no schema can say
  (a layer beyond the chosen model's depth, directions against its hidden size) stays a 400.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

__all__ = ["request_body", "errors", "KEYED", "install"]

REF = "#/components/schemas/{model}"
_components: dict[str, dict] = {}

_DESCRIPTIONS = {
    400: "Invalid request (`param` names the field).",
    401: "Missing, unknown or revoked API key.",
    403: "Download link expired, altered or foreign.",
    404: "No such job for this key, or no such file.",
    408: "The request head (`HARVEST_HTTP_HEAD_TIMEOUT_S`) or body did not arrive in time.",
    409: "The job cannot be cancelled (done or failed), or an Idempotency-Key was used for another request.",
    413: "The request body is over the route's limit.",
    414: "The request line is over `HARVEST_HTTP_LINE_BYTES`; the connection closes.",
    431: "A header line or the whole head is over `HARVEST_HTTP_LINE_BYTES` / `HARVEST_HTTP_HEAD_BYTES`; the connection closes.",
    429: "A cap, the key's request rate, or too many requests without a valid key from this address; Retry-After where waiting helps.",
    500: "Unexpected error; the message names the request id (also in X-Request-ID).",
    503: "The model's weights are not here or its run could not be started in time (`harvest_unavailable`), or this replica's budget for submits or inline activation bytes is spent (`replica_busy`); Retry-After.",
}

KEYED = {"security": [{"bearer": []}]}
"""openapi_extra of a route that needs `Authorization: Bearer <key>`."""


_JSON_SCHEMA_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _bounds_as_keywords(node):
    """pydantic writes a bound it cannot place on a type of its own (an integer field that
    also takes `514.0`, inside an optional) under its own name (`ge`, `le`), which JSON Schema
    ignores: a client or a fuzzer would think `-232` valid. The bound under JSON Schema's
    name, so that the document states every range the server enforces."""
    if isinstance(node, dict):
        for ours, theirs in _JSON_SCHEMA_BOUNDS.items():
            if ours in node and isinstance(node[ours], (int, float)) and "type" in node:
                node[theirs] = node.pop(ours)
        for value in node.values():
            _bounds_as_keywords(value)
    elif isinstance(node, list):
        for value in node:
            _bounds_as_keywords(value)
    return node


def _register(schema: dict) -> dict:
    _bounds_as_keywords(schema)
    for name, definition in schema.pop("$defs", {}).items():
        _components[name] = definition
    return schema


def request_body(model: type[BaseModel], *, patch=None) -> dict[str, Any]:
    """openapi_extra declaring `model` as the route's required JSON body (and its key)."""
    schema = _register(model.model_json_schema(ref_template=REF))
    if patch is not None:
        schema = patch(schema)
    _components[model.__name__] = schema
    return {
        **KEYED,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        },
    }


def errors(*statuses: int) -> dict[int | str, dict]:
    """`responses=` entries: the error body for each status, plus everywhere 413 and 500, and
    the refusals of a request head that the server gives before any route (`api.http_server`:
    408, 414, 431)."""
    from api.schemas import ErrorBody

    return {
        status: {"model": ErrorBody, "description": _DESCRIPTIONS[status]}
        for status in sorted({*statuses, 408, 413, 414, 431, 500})
    }


def _constrain_models(schemas: dict, registry) -> None:
    """The registry's models in the request schemas (module docstring)."""
    models = registry.all()
    harvestable = [m for m in models if m.harvest]
    schemas["HarvestRequest"]["properties"]["model"]["enum"] = [m.name for m in harvestable]
    schemas["HarvestRequest"]["properties"]["prompts"]["items"]["minLength"] = 1  # its validator's rule
    for inline in ("CompletionRequest", "ChatRequest"):
        schemas[inline]["properties"]["model"]["enum"] = [m.name for m in models]
    _bound_layers(schemas["HarvestRequest"]["properties"]["layers"], harvestable)
    # A direction's size is the chosen model's hidden size: at most the widest model's (a size
    # that fits another model than the chosen one stays a 400 naming the model's own).
    hidden = schemas["ProjectOnto"]["properties"]["shape"]["prefixItems"][1]
    hidden["maximum"] = max((m.hidden_size for m in harvestable), default=1)
    inline_models = [m for m in models if m.inline]
    for inline in ("CompletionRequest", "ChatRequest"):
        _bound_layers(schemas[inline]["properties"]["output_residual_stream"], inline_models)
    for branch in _branches(schemas["CompletionRequest"]["properties"]["prompt"]):
        if branch.get("type") == "array" and branch.get("items", {}).get("type") == "integer":
            branch["items"] = {**branch["items"], "minimum": 0}  # below each model's vocabulary: a 400 past it


def _bound_layers(field: dict, models) -> None:
    """A list of layers: non-empty, each within the deepest of these models (a layer beyond the
    chosen model's own depth stays a 400 naming its range)."""
    deepest = max((m.n_layers for m in models), default=1) - 1
    for branch in _branches(field):
        if branch.get("type") == "array":
            branch["items"] = {**branch["items"], "minimum": 0, "maximum": deepest}
            branch["minItems"] = 1


def _branches(field: dict):
    """The alternatives of a field, nested `anyOf`s flattened (a null-is-default wraps one)."""
    for branch in field.get("anyOf", [field]):
        if "anyOf" in branch:
            yield from _branches(branch)
        else:
            yield branch


def install(app: FastAPI) -> None:
    """Make `app.openapi()` build (once) the document described above."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes,
            )
            components = document.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            schemas.update(json.loads(json.dumps(_components)))  # a copy: refined per app below
            _constrain_models(schemas, app.state.registry)
            components["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer", "description": "An API key: `acs_…`."}
            }
            for operations in document.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
