"""Prefect server fixtures (session-scoped); filled in by the orchestration layer."""
