"""Prefect flows: the harvest job, its submission and cancellation, scale-out, the scheduled
corpus refresh, the retention sweep, liveness automations (hosts that die), the fleet's roles
(`harvest server|api|worker`) and `harvest up` (the whole local stack from those roles).

Dependency direction: `api → flows.submit (Prefect client, by deployment name) → flows → tasks
→ harvest`. Nothing in `harvest/` imports from here.
"""
