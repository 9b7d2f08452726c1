"""Tests of broker.plan: one file per module (the unit tier, and e2e where marked)."""
