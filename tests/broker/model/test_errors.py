"""The broker exception tree: every BrokerError subclass is drawn in broker/model/errors.py's
docstring, and the tree holds no class that nothing raises."""

from __future__ import annotations

import importlib
import pkgutil

import broker
import broker.model.errors
from broker.model.errors import BrokerError, InvalidRequest


def _broker_error_classes() -> set[type[BaseException]]:
    for info in pkgutil.walk_packages(broker.__path__, prefix="broker."):
        importlib.import_module(info.name)
    found: set[type[BaseException]] = set()
    todo: list[type[BaseException]] = [BrokerError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("broker.") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def test_every_broker_error_is_drawn_in_the_tree() -> None:
    tree = broker.model.errors.__doc__ or ""
    classes = _broker_error_classes()
    assert InvalidRequest in classes
    missing = sorted(c.__name__ for c in classes if c.__name__ not in tree)
    assert not missing, f"not drawn in broker/model/errors.py's docstring: {missing}"


def test_the_tree_draws_only_classes_that_exist() -> None:
    names = {c.__name__ for c in _broker_error_classes()} | {"BrokerError"}
    drawn = {
        line.split("── ", 1)[1].split()[0]
        for line in (broker.model.errors.__doc__ or "").splitlines()
        if "── " in line
    }
    assert drawn <= names, f"drawn but not defined: {sorted(drawn - names)}"
