"""The token book (metering.token_book) fed as a mirror feeds it: several replicas' records of
a day summed, a rewritten record replacing its rows, a deleted one gone, the month to date kept
as records arrive, malformed records skipped; the usage report with jobs' and tokens' rows side
by side; the Prometheus counters of settled tokens (no process: pure and in-memory)."""

from __future__ import annotations

from datetime import date

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from broker.state.metrics import BrokerMetrics
from metering.ledger import puts
from metering.pieces import day_number
from metering.token_book import TokenBook
from metering.tokens import TokenDay, TokenRow, TokenUse, row_key
from metering.usage import UsageBook, report
from sites.model import keys
from tests.metering.test_usage_api import at, segment

DEC3 = day_number(date(2026, 12, 3))


def record(day: str, tenant: str, writer: str, **rows: tuple[int, int, int, int, float]) -> bytes:
    """A TokenDay; rows: 'model|site|region' (as model__site__region) -> (requests, prompt,
    completion, cached, usd)."""
    return (
        TokenDay(
            day=day,
            tenant=tenant,
            writer=writer,
            seq=1,
            rows={
                row_key(*name.split("__")): TokenRow(
                    requests=r, prompt_tokens=p, completion_tokens=c, cached_tokens=k, usd=u
                )
                for name, (r, p, c, k, u) in [(n, (*v[:4], v[4])) for n, v in rows.items()]
            },
        )
        .model_dump_json()
        .encode()
    )


def key(day: str, tenant: str, writer: str) -> str:
    return keys.usage_tokens(day, tenant, writer)


def by_group(
    book: TokenBook, *by: str, first: int = DEC3, last: int = DEC3
) -> dict[tuple[str, ...], dict[str, float]]:
    return {
        tuple(r.group.values()): r.figures
        for r in book.query(first_day=first, last_day=last, by=by)
    }


def test_replicas_are_summed_and_a_rewritten_record_replaces_its_rows() -> None:
    book = TokenBook(capacity=2)  # grows
    book.on_reset(
        [
            (key("2026-12-03", "ai", "b1"), record("2026-12-03", "ai", "b1",
             qwen__s1__east=(3, 300, 120, 100, 0.3)), 5),
            (key("2026-12-03", "ai", "b2"), record("2026-12-03", "ai", "b2",
             qwen__s1__east=(2, 200, 80, 0, 0.2), llama__s2__west=(1, 10, 5, 0, 0.01)), 6),
            (keys.usage_segment("2026-12-03", "j", 1), b"{}", 7),  # not a token day: skipped
        ]
    )  # fmt: skip
    assert len(book) == 2
    got = by_group(book, "tenant", "model")
    assert got[("ai", "qwen")]["inference_requests"] == 5
    assert got[("ai", "qwen")]["prompt_tokens"] == 500
    assert got[("ai", "qwen")]["cached_tokens"] == 100
    assert got[("ai", "qwen")]["inference_usd"] == pytest.approx(0.5)
    assert set(by_group(book, "client_region")) == {("east",), ("west",)}
    now = at("2026-12-20T00:00:00")
    assert book.month_to_date("ai", now) == pytest.approx((500 + 200 + 15, 0.51))

    # b1 flushes again (its sums grew): replaced, not added
    book.on_event(key("2026-12-03", "ai", "b1"), record("2026-12-03", "ai", "b1",
                  qwen__s1__east=(4, 400, 160, 100, 0.4)), 9)  # fmt: skip
    assert by_group(book, "model")[("qwen",)]["inference_requests"] == 6
    assert book.month_to_date("ai", now)[0] == 560 + 280 + 15
    # b2's record deleted (the history's retention): its rows are gone
    book.on_event(key("2026-12-03", "ai", "b2"), None, 10)
    assert set(by_group(book, "model")) == {("qwen",)}
    assert book.month_to_date("ai", now) == pytest.approx((560, 0.4))
    assert book.month_to_date("ai", at("2027-01-02T00:00:00")) == (0, 0.0)
    assert book.month_to_date("nobody", now) == (0, 0.0)
    # a malformed record is skipped, and takes the key's old rows with it
    book.on_event(key("2026-12-03", "ai", "b1"), b'{"day": "nope"}', 11)
    assert by_group(book, "model") == {}
    assert book.month_to_date("ai", now) == (0, 0.0)


def test_filters_and_days() -> None:
    book = TokenBook()
    book.apply(
        key("2026-12-03", "ai", "b1"),
        record(
            "2026-12-03",
            "ai",
            "b1",
            qwen__s1__east=(1, 10, 1, 0, 0.1),
            qwen__s2__east=(1, 20, 2, 0, 0.2),
        ),
    )
    book.apply(
        key("2026-12-04", "ai", "b1"),
        record("2026-12-04", "ai", "b1", qwen__s1__east=(1, 30, 3, 0, 0.3)),
    )
    book.apply(key("2026-12-04", "vi", "b1"), record("2026-12-04", "vi", "b1",
               qwen__s1__east=(1, 40, 4, 0, 0.4)))  # fmt: skip
    rows = book.query(first_day=DEC3, last_day=DEC3 + 1, site="s1", tenant="ai", by=("day",))
    assert [(r.group["day"], r.figures["prompt_tokens"]) for r in rows] == [
        ("2026-12-03", 10.0),
        ("2026-12-04", 30.0),
    ]
    assert book.query(first_day=DEC3, last_day=DEC3, tenant="nobody") == []
    assert book.query(first_day=DEC3 + 2, last_day=DEC3 + 9) == []


def test_the_report_puts_jobs_and_tokens_side_by_side() -> None:
    book = UsageBook()
    job = segment("a1", "ai", "s1", "2026-12-03T10:00:00", "2026-12-03T12:00:00")
    for k, v in puts(job).items():
        book.apply(k, v)
    book.apply(key("2026-12-03", "ai", "b1"), record("2026-12-03", "ai", "b1",
               qwen__s1__east=(2, 100, 50, 10, 0.25)))  # fmt: skip
    assert len(book) == 1 and len(book.tokens) == 1  # the token day went to the token book
    rows = {
        tuple(r.group.values()): r.figures
        for r in report(book, first_day=DEC3, last_day=DEC3, by=("tenant", "model"))
    }
    assert set(rows) == {("ai", "H100"), ("ai", "qwen")}
    assert rows[("ai", "H100")]["gpu_s"] == 2 * 7200 and rows[("ai", "H100")]["prompt_tokens"] == 0
    assert rows[("ai", "qwen")]["gpu_s"] == 0 and rows[("ai", "qwen")]["prompt_tokens"] == 100
    assert rows[("ai", "qwen")]["charge_usd"] == pytest.approx(0.25)
    assert rows[("ai", "H100")]["charge_usd"] == pytest.approx(job.total_usd)
    # by tenant: one row, both costs; by client region: the job's under ""
    (one,) = report(book, first_day=DEC3, last_day=DEC3, by=("tenant",))
    assert one.figures["charge_usd"] == pytest.approx(job.total_usd + 0.25)
    regions = report(book, first_day=DEC3, last_day=DEC3, by=("client_region",))
    assert [(r.group["client_region"], r.figures["inference_requests"]) for r in regions] == [
        ("", 0.0),
        ("east", 2.0),
    ]
    # a re-list rebuilds both books
    book.reset([])
    assert len(book.tokens) == 0


def test_settled_tokens_are_counted_per_tenant_model_site_and_kind() -> None:
    metrics = BrokerMetrics()
    use = TokenUse(
        request_id="r1", tenant="ai", token_id=None, model="qwen", requested="chat",
        service="chat", site="s1", client_region="east", prompt_tokens=100,
        completion_tokens=30, cached_tokens=40, at=0.0,
    )  # fmt: skip
    metrics.inference_tokens(use)
    metrics.inference_tokens(use)
    text = generate_latest(metrics.registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("cpn_inference_")
    }
    labels = (("model", "qwen"), ("site", "s1"), ("tenant", "ai"))
    for kind, value in (("prompt", 200), ("completion", 60), ("cached", 80)):
        tokens = tuple(sorted((*labels, ("kind", kind))))
        assert samples[("cpn_inference_tokens_total", tokens)] == value
    assert samples[("cpn_inference_requests_total", labels)] == 2
    assert "# TYPE cpn_inference_tokens_total counter" in text
