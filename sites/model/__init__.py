"""What every package shares about a site, with no I/O: the site file's spec and its config
loader, the device catalog (and its MIG geometry) and compute units (capacity), the published
status and snapshot, the registry's key layout, assignments, latency, durations, and the errors.
"""
