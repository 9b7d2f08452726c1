"""Metering: the usage ledger, cost, energy and carbon per tenant, reports and alerts.

Imports flow `sites` <- `metering` <- `broker` (docs/metering.md): metering reads sites' models
and the registry; the broker feeds it and serves what it computes.
"""
