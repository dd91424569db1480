"""Prefect flows: the harvest job, its submission and cancellation, scale-out, the scheduled
corpus refresh, the retention sweep, the reaper, and `harvest up` (the whole local stack).

Dependency direction: `api → flows.submit (Prefect client, by deployment name) → flows → tasks
→ harvest`. Nothing in `harvest/` imports from here.
"""
