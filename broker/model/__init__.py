"""Records and specs with no I/O: jobs and their lifecycle, workflows, services, tenants,
alert rules, the autoscaler's decisions, regions, and the broker's errors.

The bottom layer of broker/ (docs/architecture.md): imports nothing else from broker.
"""
