"""Batch placement: the plan problem, CP-SAT and HiGHS, aggregation, the batch pass.

A layer of broker/ (docs/architecture.md): above placement, below state; no I/O but the solvers.
"""
