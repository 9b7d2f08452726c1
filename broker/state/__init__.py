"""What the broker knows and keeps: the view of the registry, the job store, leadership,
auth and audit, traffic, the router's state, tenants' store, metrics.

A layer of broker/ (docs/architecture.md): how the broker reads the registry (the view, job
pages, the stores' decoders and guards). The layers above write through the registry client
(sites.registry) with the guards and records defined here.
"""
