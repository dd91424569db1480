"""Prefect tasks: thin wrappers around one core call each, retries in the decorator.

Nothing here computes anything itself; the functions they wrap are unit-tested in the core.
"""
