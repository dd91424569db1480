"""Residual-stream harvesting: the domain core.

Nothing here imports FastAPI or Prefect, nor names a layer above it (not even in a string for
`importlib` or `python -m`): the orchestration (`tasks/`, `flows/`), HTTP (`api/`) and process
(`fleet/`) layers sit on top of this package.
"""
