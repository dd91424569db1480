"""What one engine call may hold, handed to an engine when it is made (`EngineLimits.of`
builds them from the settings of the process that makes it; the defaults are the settings')."""

from __future__ import annotations

from dataclasses import dataclass

from harvest.capture_spec import CaptureSpec
from harvest.settings import Settings

__all__ = ["EngineLimits"]


def _default(name: str):
    return Settings.model_fields[name].default


@dataclass(frozen=True)
class EngineLimits:
    batch_tokens: int = _default("engine_batch_tokens")
    """Tokens in one forward pass of the HF engine, filler included (`HARVEST_ENGINE_BATCH_TOKENS`)."""
    row_tokens: int | None = _default("engine_row_tokens")
    """Tokens in one packed row; None plans them per capture (`HARVEST_ENGINE_ROW_TOKENS`)."""
    piece_bytes: int = _default("engine_piece_bytes")
    """Most bytes of captured values one engine batch holds (`HARVEST_ENGINE_PIECE_BYTES`)."""

    @classmethod
    def of(cls, settings: Settings) -> "EngineLimits":
        return cls(settings.engine_batch_tokens, settings.engine_row_tokens, settings.engine_piece_bytes)

    def tokens_per_piece(self, spec: CaptureSpec, hidden_size: int) -> int:
        """How many tokens' captured values fit in `piece_bytes` (at least 1)."""
        per_token = len(spec.layers) * spec.n_features(hidden_size) * spec.stored_dtype.itemsize
        return max(1, self.piece_bytes // per_token)
