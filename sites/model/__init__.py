"""What every package shares about a site, with no I/O: the site file's spec and its config
loader, the device catalog and compute units, the published status and snapshot, the registry's
key layout, assignments, latency, durations, and the errors.
"""
