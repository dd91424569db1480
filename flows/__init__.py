"""Prefect flows: the harvest job, its submission and cancellation, scale-out, the scheduled
corpus refresh, the retention sweep, liveness automations (hosts that die), and applying the
control plane's pools and deployments.

Dependency direction: `fleet → api, flows`; `api → flows.submit (Prefect client, by deployment
name) → flows → tasks → harvest`. Nothing in `harvest/` imports from here, and nothing here
imports `fleet/` (the processes that run these flows: roles, `harvest up`, the run starter).
"""
