"""What a job's steps took: the `timings` of its manifest, of its run's result and of the API's
harvest object, one model for all three."""

from __future__ import annotations

from pydantic import BaseModel

__all__ = ["Timings"]


class Timings(BaseModel):
    """Seconds spent in each step, and the tokens the forward passes ran, summed over shards
    and workers; a shard skipped on a resume counts nothing. With overlapped writes the steps'
    seconds add up to more than the wall time."""

    load_s: float = 0.0
    """Seconds loading the model."""
    forward_s: float = 0.0
    """Seconds of forward passes."""
    save_s: float = 0.0
    """Seconds sealing shard files (and, at the end, checking them)."""
    upload_s: float = 0.0
    """Seconds writing files to storage."""
    real_tokens: int = 0
    """Tokens of the prompts the forward passes ran (a shard skipped on a resume counts none)."""
    padded_tokens: int = 0
    """Filler tokens the forward passes ran beside them: compute that belonged to no prompt
    (`harvest.engines.packing`)."""

    def add(self, other: Timings) -> None:
        for name in type(self).model_fields:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def count_forward(self, forward_s: float, real_tokens: int, padded_tokens: int) -> None:
        """Add one shard's forward passes."""
        self.forward_s += forward_s
        self.real_tokens += real_tokens
        self.padded_tokens += padded_tokens

    @classmethod
    def from_dict(cls, figures: dict) -> Timings:
        """What `as_dict` wrote, by another run (a scale-out helper, which may run other code
        during an upgrade): unknown figures left out, missing ones 0."""
        return cls(**{name: figures[name] for name in cls.model_fields if name in figures})

    def as_dict(self) -> dict[str, int | float]:
        return {name: round(getattr(self, name), 4) for name in type(self).model_fields}
