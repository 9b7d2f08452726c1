"""What the broker knows and keeps: the view of the registry, the job store, leadership,
auth and audit, traffic, the router's state, tenants' store, metrics.

A layer of broker/ (docs/architecture.md): the only one that reads and writes the registry for
the layers above it.
"""
