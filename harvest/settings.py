"""One validated settings object for the whole service, read from `HARVEST_*` variables.

Prefect keeps its own `PREFECT_*` variables; nothing here shadows them.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "get_settings"]

REPO_ROOT = Path(__file__).resolve().parent.parent


class Settings(BaseSettings):
    """Service configuration; every field can be set as `HARVEST_<FIELD>`."""

    model_config = SettingsConfigDict(env_prefix="HARVEST_", extra="ignore")

    home: Path = Field(default=Path(".harvest"))
    """Working directory for built models, the embedded database and local files."""

    models_file: Path = Field(default=REPO_ROOT / "infra" / "models.toml")
    """The model registry (served name → weights, lane, operational caps)."""

    use_vllm: bool | None = None
    """Engine choice: None picks vLLM where it is installed, False forces the HF reference."""

    storage_url: str | None = None
    """Where job files go (any fsspec URL); default `file://<home>/storage`."""

    s3_endpoint_url: str | None = None
    """Endpoint of an S3-compatible server (MinIO, moto) for `s3://` storage; None is AWS."""

    @field_validator("home")
    @classmethod
    def _absolute_home(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @property
    def resolved_storage_url(self) -> str:
        return self.storage_url or f"file://{self.home / 'storage'}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
