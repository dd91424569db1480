"""Residual-stream harvesting: the domain core.

Nothing here imports FastAPI or Prefect; the orchestration (`tasks/`, `flows/`) and HTTP
(`api/`) layers sit on top of this package.
"""
