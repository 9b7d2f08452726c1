"""Where a placed job runs: the confined local executor, Slurm, and the confinement they share
(accounts, sandbox, cgroups, launcher, network namespaces). Run by the agent only.
"""
