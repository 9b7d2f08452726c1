"""Pure online placement: feasibility, the column index, offers, nodes, pricing, green,
tenancy standing, preemption, why a job waits, and the scheduling settings.

A layer of broker/ (docs/architecture.md): imports broker.model only; no I/O, no clock.
"""
