"""The routing decision, pure: the topology of measured links, client regions, candidates,
scoring and selection, the policy, replica choice, and why a route was chosen (explain).
"""
