"""Per-request work any broker replica does: submit, cancel and move jobs, services and
workflows, gangs, usage segments, budgets, tenants' standing.

A layer of broker/ (docs/architecture.md): above state, below the leader's loops.
"""
