"""The perception agent: its process, collectors, drift, the workload reconcile loop and the
replicas. Imported by cpn only.
"""
