"""The harvest request (`POST /v1/harvest` body, also what `harvest run` builds) and its resolution.

`HarvestRequest` checks what can be checked without the model; `resolve_job` checks the rest
against the registry (layers, directions) so a bad request is refused before a GPU starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from annotated_types import Ge, Le
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, field_validator

from harvest.capture_spec import MAX_DIRECTIONS, CaptureSpec
from harvest.errors import InvalidRequest
from harvest.layers import resolve_layers
from harvest.registry import ModelInfo, Registry

if TYPE_CHECKING:  # ml_dtypes: a request is read and checked without it (the API and its assessing children)
    from harvest.projection import Directions

__all__ = ["MAX_PROMPTS", "MAX_TOKENS", "WholeInt", "ProjectOnto", "HarvestRequest", "ResolvedJob", "resolve_job"]

MAX_PROMPTS = 4096
MAX_TOKENS = 2_000_000


def _whole(value: Any) -> Any:
    """A JSON number with no fraction (`514.0`, `5.14e2`) is that integer, as JSON Schema's
    `integer` says; anything else goes on to the strict check (`514.5`, `"514"` and `true`
    are refused there)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


WholeInt = Annotated[int, Strict(), BeforeValidator(_whole)]
"""An integer field of a request: a whole number, whether written `514` or `514.0`."""


class ProjectOnto(BaseModel):
    """Directions to project the residual stream onto, as a raw little-endian buffer."""

    model_config = ConfigDict(extra="forbid")

    data: str
    """base64 of the raw little-endian bytes, `n_directions × hidden × itemsize` long."""
    dtype: Literal["float32", "float16", "bfloat16"]
    """Element type of `data`."""
    shape: tuple[
        Annotated[WholeInt, Ge(1), Le(MAX_DIRECTIONS)],
        Annotated[WholeInt, Ge(1)],
    ]
    """`[n_directions, hidden_size]`: 1 to 64 directions, each of the model's hidden size (a bound
    that differs per model, so the schema states only that it is positive)."""
    compression: str | None = "none"
    """Only "none" is accepted."""


class HarvestRequest(BaseModel):
    """A bulk harvest: which model, which prompts, which layers, how to write them."""

    model_config = ConfigDict(extra="forbid")

    model: str
    """Served model name, as in `GET /v1/models`."""
    prompts: list[str] = Field(min_length=1, max_length=MAX_PROMPTS)
    """1 to 4096 non-empty prompt texts."""
    layers: list[WholeInt] | Literal["all"] | None = None
    """Block indices to keep, "all", or None for the quartile blocks."""
    shard_size: WholeInt = Field(default=32, ge=1, le=4096)
    """Prompts per shard file; the lane's `max_shard_bytes` bounds what one may hold."""
    batch_size: WholeInt | None = Field(default=None, ge=1, le=4096)
    """Most prompts in one forward pass of the HF reference engine, a hint: a pass never holds
    more tokens than the engine's token budget, and packs prompts instead of padding them
    (`harvest.engines.packing`); vLLM batches on its own."""
    add_special_tokens: bool = True
    """True prepends the model's BOS token to each prompt; false tokenizes the text verbatim."""
    project_onto: ProjectOnto | None = None
    """Directions to project onto instead of returning the raw stream."""

    @field_validator("prompts")
    @classmethod
    def _non_empty(cls, prompts: list[str]) -> list[str]:
        empty = [i for i, p in enumerate(prompts) if not p]
        if empty:
            raise ValueError(f"prompts must be non-empty strings; prompt(s) {empty[:10]} are empty")
        return prompts


@dataclass(frozen=True)
class ResolvedJob:
    """A request checked against its model: everything a run needs."""

    request: HarvestRequest
    model: ModelInfo
    layers: list[int]
    directions: Directions | None

    @property
    def spec(self) -> CaptureSpec:
        return CaptureSpec(self.layers, None if self.directions is None else self.directions.unit)

    @property
    def contents(self) -> str:
        """What the shards hold: the raw residual stream or its projections."""
        return "activations" if self.directions is None else "projections"


def resolve_job(request: HarvestRequest, registry: Registry) -> ResolvedJob:
    """Check the request against the registry: model, layers and directions."""
    model = registry.for_harvest(request.model)
    layers = resolve_layers(model, request.layers)
    directions = None
    if request.project_onto is not None:
        from harvest.projection import decode_directions

        p = request.project_onto
        directions = decode_directions(p.data, p.dtype, list(p.shape), model.hidden_size, p.compression)
    return ResolvedJob(request=request, model=model, layers=layers, directions=directions)


def check_token_total(total: int) -> None:
    if total > MAX_TOKENS:
        raise InvalidRequest(
            f"The prompts come to {total:,} tokens; a harvest takes at most {MAX_TOKENS:,}. Split them into several jobs.",
            param="prompts",
        )
