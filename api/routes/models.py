"""`GET /v1/models`: the served models in OpenAI's list shape, each with its `capabilities`.

Clients read their limits here rather than hard-coding them (the caps are operational
settings): `n_layers`, `hidden_size`, `max_model_len`, `max_activation_prompt_tokens`,
`harvest`, `lane`, plus `inline` (whether the model serves inline activations), and what the
checkpoint is: `architecture` (transformers' class), `model_type` and `layer_module`, the
module whose output layer k is (`transformer.h.{k}` for GPT-2, `model.layers.{k}` for most).
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from api.deps import Models
from api.openapi import KEYED, errors
from api.ratelimit import ReadKey

__all__ = ["router", "models_body"]

# OpenAI's model objects carry a creation time; ours are configuration, so a fixed epoch.
_CREATED = 0


def models_body(registry) -> dict:
    return {
        "object": "list",
        "data": [
            {"id": info.name, "object": "model", "created": _CREATED, "owned_by": "acs", "capabilities": info.capabilities()}
            for info in registry.all()
        ],
    }


router = APIRouter()


@router.get("/v1/models", responses=errors(401, 429), openapi_extra=KEYED)
async def list_models(registry: Models, key: ReadKey) -> dict:
    """Every served model and what it can do."""
    # The first read resolves each entry (and builds the embedded model): blocking work.
    return await run_in_threadpool(models_body, registry)
