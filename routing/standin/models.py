"""What the stand-in serves: its model and LoRA adapters, as vLLM's /v1/models lists them.

A request's `model` is resolved as vLLM resolves it: the served model name, or one of the
adapters (then the request runs "with the adapter" and counts in vllm:lora_requests_info), or
absent (the served model). Any other name is a 404 `NotFoundError` ("The model `x` does not
exist.") when the stand-in was given its served model name (`--served-model-name`, as vLLM);
without one, the stand-in predates model routing and answers any name as its own model.

/v1/models answers vLLM's ModelList: one ModelCard for the model (`root` its name, `parent`
null) and one per adapter (`root` its path, `parent` the model), each with `max_model_len`
and one ModelPermission.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from routing.standin.errors import ApiError

__all__ = ["Catalog", "LoraAdapter", "parse_lora"]

ADAPTER_NAME = r"^[^,\s]+$"  # vllm:lora_requests_info joins names with commas


class LoraAdapter(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=256, pattern=ADAPTER_NAME)
    path: str = Field(min_length=1, description="where vLLM would load it from: the card's root")


def parse_lora(spec: str) -> dict[str, str]:
    """vLLM's `--lora-modules` form `NAME=PATH`, or just `NAME` (its path is then the name)."""
    name, sep, path = spec.partition("=")
    return {"name": name, "path": path if sep else name}


class Catalog:
    """The served model and its adapters (module docstring)."""

    def __init__(
        self,
        *,
        model: str,
        adapters: tuple[LoraAdapter, ...],
        max_model_len: int,
        strict: bool,
    ) -> None:
        self.model = model
        self.adapters = {a.name: a for a in adapters}
        self.max_model_len = max_model_len
        self.strict = strict
        self.created = int(time.time())

    def resolve(self, requested: object) -> str | None:
        """The adapter a request's `model` names, None for the served model; ApiError (404)
        for a model not served here."""
        if requested is None or requested == self.model:
            return None
        if not isinstance(requested, str):
            raise ApiError("model must be a string", param="model")
        if requested in self.adapters:
            return requested
        if not self.strict:
            return None
        raise ApiError(f"The model `{requested}` does not exist.", param="model", status=404)

    def cards(self) -> list[dict[str, Any]]:
        base = self._card(self.model, root=self.model, parent=None)
        return [base] + [
            self._card(a.name, root=a.path, parent=self.model) for a in self.adapters.values()
        ]

    def card(self, model_id: str) -> dict[str, Any]:
        for card in self.cards():
            if card["id"] == model_id:
                return card
        raise ApiError(f"The model `{model_id}` does not exist.", param="model", status=404)

    def _card(self, model_id: str, *, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": self.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
