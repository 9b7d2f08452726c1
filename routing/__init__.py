"""Inference routing: the topology graph, latency-aware site selection, the inference proxy.

Layer: imports `sites` only (never `broker` or `cpn`). `clients` reads configs/clients.yaml,
`topology` keeps shortest-path RTTs from client regions to sites, `selection` scores and picks a
site as a pure function. docs/routing.md is the long form.
"""

from routing import native

native.install()
