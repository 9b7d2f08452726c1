"""The perception agent: its process (settings, HTTP server, what it perceives), collectors,
drift, the workload reconcile loop, its runs and their resource fit, and the replicas it
serves. Imported by cpn only.
"""
