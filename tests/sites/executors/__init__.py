"""Tests of sites.executors: one file per module (the unit tier, and e2e where marked)."""
