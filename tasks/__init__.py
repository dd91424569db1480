"""Prefect tasks: thin wrappers around one core call each (see DESIGN, style rule 5).

Nothing here computes anything itself; the functions they wrap are unit-tested in the core.
"""
