"""The site's data plane: its content-addressed store (store), the grants-checked routes peers
and the broker call (serve), pulling from replicas (transfer), replica records and replication
orders (records, orders), and the DataPlane the agent's workload calls (plane). docs/agent.md.
"""
