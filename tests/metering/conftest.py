"""The metering tests reuse the broker tests' real federation (agents and a broker process)."""

from tests.broker.conftest import make_federation

__all__ = ["make_federation"]
