"""Retry rules shared by the broker and the simulator (pure).

A job that failed, or whose site was lost, is retried while it has retries left
(`JobSpec.max_retries`); the backoff before the next attempt doubles from `base_s` up to
`max_s`. A site loss re-queues at once (the broker overrides the backoff: a lost site is no
reason to wait) but still uses up a retry, so a job cannot bounce between dying sites forever.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RetryPolicy", "retry_backoff_s"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    base_s: float = 2.0
    max_s: float = 300.0


def retry_backoff_s(retries: int, max_retries: int, policy: RetryPolicy) -> float | None:
    """Seconds to wait before retry number `retries + 1`; None when no retries are left."""
    if retries >= max_retries:
        return None
    return float(min(policy.max_s, policy.base_s * 2**retries))
