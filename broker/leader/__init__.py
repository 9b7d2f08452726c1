"""The leader's decide-then-act loops: the scheduling pass (decisions) and its actions, the
history archive, replicas, the autoscaler, alerts and their webhooks.

A layer of broker/ (docs/architecture.md): run by the process, only while it leads.
"""
