"""``ServerContext``: what every route of one app shares (the engine client, the base model's names, the
preparer, tenancy, metrics, the lifecycle), and the one place a request's ``model`` becomes a version.

``route(request, model)`` is called once per generation request, first, after its body is parsed and
before anything is derived from the adapter: the base model's names map to the base, any other name is
an adapter that the caller's key must be allowed to use (else 404, as an unknown model, so names do not
leak), loaded first when it is not loaded and ``--load-on-demand`` finds it in a root, and then routed
to a ``Version`` by the engine client's directory (a split's pick, else the current version). The
``Version`` travels from there: preparation, submission, the answer's header and fingerprint, the
logprob token texts.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from loraplex.adapters.info import AdapterInfo
from loraplex.client.adapter_mix import mixed, scaled
from loraplex.client.base import EngineClient
from loraplex.client.directory import Version
from loraplex.errors import RequestError, UnknownAdapter
from loraplex.server.generation import model_not_found
from loraplex.server.lifecycle import ServerLifecycle
from loraplex.server.metrics import ServerMetrics
from loraplex.server.on_demand import OnDemandLoader
from loraplex.server.openai.errors import ServerError
from loraplex.server.openai.responses import TokenTexts
from loraplex.server.prepare.preparer import RequestPreparer
from loraplex.server.tenancy.access import AdapterPathPolicy, caller
from loraplex.server.tenancy.keys import KeyTable
from loraplex.server.tenancy.quotas import TenantQuotas


def context(request: Request) -> ServerContext:
    """The ``ServerContext`` of the app serving ``request`` (``create_app`` sets it)."""
    return request.app.state.context


@dataclass
class ServerContext:
    client: EngineClient
    base_name: str  # the base model's name in the API
    base_aliases: frozenset[str]  # every name that means the base model
    policy: AdapterPathPolicy
    metrics: ServerMetrics
    lifecycle: ServerLifecycle
    preparer: RequestPreparer
    keys: KeyTable | None
    quotas: TenantQuotas
    on_demand: OnDemandLoader | None
    started: int  # Unix time the app was made (the base model's ``created``)
    stall_timeout: float = 60.0  # /health says "stalled" when requests are open and no step arrived for this long
    _token_texts: weakref.WeakKeyDictionary[Any, TokenTexts] = field(default_factory=weakref.WeakKeyDictionary)

    def adapter_for(self, model: str) -> str | None:
        """The adapter name ``model`` stands for; None for one of the base model's names."""
        return None if model in self.base_aliases else model

    async def route(self, request: Request, model: str) -> Version:
        """The version ``model``'s request runs on, decided once (see the module docstring); 404 on ``model``
        for a name that is neither the base model nor an adapter the caller may use."""
        adapter, key = self.adapter_for(model), caller(request)
        if not key.may_use(adapter):
            raise model_not_found(model)
        try:
            return self.client.route(adapter)
        except UnknownAdapter:
            if adapter is not None and self.on_demand is not None and await self.on_demand.ensure(adapter):
                try:
                    return self.client.route(adapter)
                except UnknownAdapter:  # unloaded again at once
                    pass
        self.metrics.observe_request(adapter, "rejected", None, None, None, tenant=key.tenant)
        raise model_not_found(model)

    async def route_body(self, request: Request, model: str, lora_scale: float | None,
                         mix: Sequence[tuple[str, float]] | None) -> Version:
        """``route``, with the body's per-request LoRA plan (``client/adapter_mix.py``): ``model``'s adapter at
        ``lora_scale``, or with ``model`` the base model's name, the ``mix`` of adapters (each name routed once,
        and a 404 naming ``adapter_mix`` for one the caller may not use or that is not loaded)."""
        if mix is None:
            return scaled(await self.route(request, model), lora_scale)
        if self.adapter_for(model) is not None:
            raise RequestError("adapter_mix blends adapters over the base model: set model to the base model's "
                               f"name, not {model!r}", "adapter_mix")
        if lora_scale is not None:
            raise RequestError("lora_scale scales the adapter named as the model; with adapter_mix give each entry "
                               "its scale", "lora_scale")
        versions = []
        for name, _ in mix:
            try:
                versions.append(await self.route(request, name))
            except ServerError as exc:
                raise ServerError(exc.status, f"adapter_mix: {exc}", "adapter_mix") from exc
        return mixed(versions, [scale for _, scale in mix])

    def current(self, request: Request, model: str) -> Version:
        """``model``'s current version, not routed (``/tokenize``, ``/detokenize``); 404 for a model the caller
        may not use, 400 if it has no tokenizer."""
        adapter = self.adapter_for(model)
        try:
            if not caller(request).may_use(adapter):
                raise UnknownAdapter(model)
            version = self.client.current(adapter)
        except UnknownAdapter as exc:
            raise ServerError(404, f"model {model!r} not found (see GET /v1/models)", "model") from exc
        if version.tokenizer is None:
            raise RequestError(f"model {model!r} has no tokenizer", "model")
        return version

    def token_texts(self, version: Version) -> TokenTexts:
        """The token strings of ``version``'s tokenizer (cached per tokenizer), for logprobs."""
        tokenizer = version.tokenizer
        if tokenizer is None:
            return TokenTexts(None)
        if tokenizer not in self._token_texts:
            self._token_texts[tokenizer] = TokenTexts(tokenizer)
        return self._token_texts[tokenizer]

    def model_card(self, model_id: str, root: str, parent: str | None, created: int) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "loraplex",
                "root": root, "parent": parent}

    def adapter_card(self, info: AdapterInfo) -> dict[str, Any]:
        """A loaded version's ``/v1/models`` entry."""
        return self.model_card(info.name, str(info.path), self.base_name, int(info.loaded_at) or self.started)
