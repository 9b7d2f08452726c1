"""Capacity-planning simulation: the broker's placement and the router's selection code, driven
on virtual time (docs/simulation.md)."""
