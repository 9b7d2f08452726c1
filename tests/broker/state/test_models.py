"""broker.state.models: what a model name resolves to for a tenant, and the model list."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from broker.placement.settings import Alias, InferenceSettings
from broker.state.models import ModelCatalog
from sites.model.snapshot import Snapshot
from sites.model.status import ServiceEndpoint


def _ep(service: str, site: str, model: str, job: str | None = None) -> ServiceEndpoint:
    return ServiceEndpoint(
        service=service, site=site, model=model, url=f"http://127.0.0.1:1/{site}",
        max_concurrency=8, updated_at=0.0, job=job,
    )  # fmt: skip


def _catalog(aliases: dict[str, object] | None = None) -> ModelCatalog:
    snapshot = Snapshot(revision=1)
    for ep in (
        _ep("qwen-72b", "a", "qwen2.5-72b-instruct"),
        _ep("qwen-72b", "b", "qwen2.5-72b-instruct"),
        _ep("qwen-fast", "c", "qwen2.5-72b-instruct"),
        _ep("llama", "a", "llama-3.3-70b-instruct"),
        _ep("private-llm", "b", "secret-model", job="job-1"),
    ):
        snapshot.services[(ep.service, ep.site)] = ep
    settings = InferenceSettings.model_validate({"aliases": aliases or {}})
    return ModelCatalog(
        snapshot=lambda: snapshot,
        job_tenant={"job-1": "lab"}.get,
        aliases=settings.aliases,
    )


def test_a_service_a_model_and_an_alias_resolve() -> None:
    catalog = _catalog({"chat": [{"qwen-72b": 3, "llama": 1}, "secret-model"]})
    assert catalog.resolve("qwen-72b", "t") == ((("qwen-72b", 1.0),),)
    by_model = catalog.resolve("qwen2.5-72b-instruct", "t")
    assert by_model is not None and {s for s, _ in by_model[0]} == {"qwen-72b", "qwen-fast"}
    assert catalog.resolve("chat", "t") == ((("qwen-72b", 3.0), ("llama", 1.0)),)
    assert catalog.resolve("chat", "lab") == (
        (("qwen-72b", 3.0), ("llama", 1.0)),
        (("private-llm", 1.0),),
    )
    assert catalog.resolve("nothing", "t") is None


def test_another_tenants_private_service_is_absent() -> None:
    catalog = _catalog()
    assert catalog.resolve("private-llm", "other") is None
    assert catalog.resolve("secret-model", "other") is None
    assert catalog.resolve("private-llm", "lab") == ((("private-llm", 1.0),),)
    assert catalog.resolve("private-llm", None) is not None  # an operator, or auth off
    others = {card.id for card in catalog.cards("other")}
    assert "private-llm" not in others and "secret-model" not in others
    assert {"qwen-72b", "qwen2.5-72b-instruct", "llama"} <= others
    mine = {card.id: card for card in catalog.cards("lab")}
    assert mine["private-llm"].owner == "lab" and mine["secret-model"].root == "secret-model"


def test_cards_carry_vllms_fields() -> None:
    card = _catalog().card("qwen2.5-72b-instruct", "t")
    assert card is not None
    shown = card.json(123)
    assert shown["object"] == "model" and shown["root"] == "qwen2.5-72b-instruct"
    assert {"parent", "max_model_len", "owned_by", "created"} <= set(shown)


@pytest.mark.parametrize(
    ("aliases", "where"),
    [
        ({"chat": []}, "aliases.chat"),
        ({"chat": [{"qwen": 0}]}, "weight"),
        ({"chat": [{"qwen": -1}]}, "weight"),
        ({"chat": ["qwen", "qwen"]}, "named twice"),
        ({"chat": ["a"], "other": ["chat"]}, "aliases.other"),
        ({"bad name!": ["a"]}, "aliases"),
        ({"chat": [{"target": "qwen", "wieght": 2}]}, "wieght"),
    ],
)
def test_bad_alias_settings_name_their_field(aliases: dict[str, object], where: str) -> None:
    with pytest.raises(ValidationError) as caught:
        InferenceSettings.model_validate({"aliases": aliases})
    assert where in str(caught.value)


def test_the_alias_short_forms() -> None:
    alias = Alias.model_validate([{"a": 2, "b": 1}, "c", ["d", {"target": "e", "weight": 3}]])
    assert [[(t.target, t.weight) for t in rank] for rank in alias.ranks] == [
        [("a", 2.0), ("b", 1.0)], [("c", 1.0)], [("d", 1.0), ("e", 3.0)],
    ]  # fmt: skip


def test_the_name_a_server_serves_by() -> None:
    catalog = _catalog({"chat": ["qwen-72b"]})
    assert catalog.served_name("qwen-72b", "chat") == "qwen2.5-72b-instruct"
    assert catalog.served_name("qwen-72b", "qwen-72b") == "qwen2.5-72b-instruct"
    assert catalog.served_name("qwen-72b", "qwen2.5-72b-instruct") is None
    assert catalog.served_name("gone", "chat") is None
