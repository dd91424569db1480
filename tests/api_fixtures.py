"""API server fixtures (session-scoped); filled in by the API layer."""
