"""Adapter management over HTTP: loading and unloading (vLLM's endpoints) and versions as an API.

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``; with ``"version": "new"`` a loaded name
  gets a new version and moves to it atomically (requests in flight finish on the old one; without it,
  loading a loaded name stays a 409).
- ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: every version of the name is retired.
- ``GET /v1/adapters``: every name the caller may use -> its versions (``v<id>``, content hash, path,
  loaded at, requests served), which one is current, and the split.
- ``POST /v1/adapters/{name}/rollback``: the name moves back to the version loaded before its current one
  (409 when none is held).
- ``POST /v1/adapters/{name}/split`` ``{"v7": 0.9, "v8": 0.1}``: new requests of the name are routed among
  those held versions in proportion to the (positive) weights, normalised to shares; one version is a
  promotion. 400 on a malformed body, 404 on a version the name does not hold.
- ``POST /v1/adapters/{name}/pin`` / ``/unpin``: the name's current version keeps (or no longer keeps) a device
  slot and its host copy; 409 past ``max_loras - 1`` pinned names. The answer is the name's entry.
- ``PUT /v1/adapters/{name}`` (``Content-Type: application/octet-stream``): the body is one safetensors file of
  PEFT tensors whose ``__metadata__["adapter_config"]`` is the ``adapter_config.json`` text. The first PUT of a
  name loads it, a later one makes and promotes a new version; the answer is the name's ``GET /v1/adapters``
  entry. The body is bounded by ``--max-request-bytes`` (413), parsed off the event loop with the checked
  safetensors parser (never unpickled), and validated as a folder is (the same typed errors).

Every name (``lora_name``, the ``{name}`` of a path) is checked first against the one pattern
(``adapters/names.py``: 400 ``InvalidAdapterName`` naming the field). A load reads only files inside the
``--adapter-root`` folders (every file, after symlinks: the engine checks each one it opens).

Every change needs runtime adapter management on (``--allow-runtime-adapters``, else 403) and, with API
keys, an admin key (else 403). A name outside the caller's scope is answered as an unknown one (404, the
engine's own message), so names do not leak.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Request

from loraplex.adapters.names import ADAPTER_NAME_PATTERN, check_adapter_name
from loraplex.adapters.reading.safetensors_file import HEADER_LENGTH_BYTES, header_length, parse_header
from loraplex.engine.wire import TensorBlob
from loraplex.errors import InvalidAdapter, RequestError, UnknownAdapter
from loraplex.server.context import ServerContext, context
from loraplex.server.openai.errors import ServerError
from loraplex.server.openai.openapi import documented, reset_openapi
from loraplex.server.openai.protocol import LoadAdapterRequest, UnloadAdapterRequest
from loraplex.server.openai.schemas import AdapterLoaded, AdapterUnloaded, AdapterVersionList, AdapterVersions
from loraplex.server.tenancy.access import caller
from loraplex.server.tenancy.keys import ApiKey

logger = logging.getLogger(__name__)

_VERSION_ID = re.compile(r"^v([0-9]+)$")
SPLIT_SCHEMA = {"type": "object", "minProperties": 1, "propertyNames": {"pattern": _VERSION_ID.pattern},
                "additionalProperties": {"type": "number", "exclusiveMinimum": 0},
                "examples": [{"v1": 0.9, "v2": 0.1}]}


def unknown_adapter(name: str) -> UnknownAdapter:
    """The engine's error for a name it does not hold (a name outside the caller's scope gets the same)."""
    return UnknownAdapter(f"no adapter named {name!r} is loaded")


def split_weights(body: Any) -> dict[int, float]:
    """``{"v7": 0.9, "v8": 0.1}`` -> ``{7: 0.9, 8: 0.1}``, normalised to sum 1; ``RequestError`` naming the
    offending key otherwise."""
    if not isinstance(body, dict) or not body:
        raise RequestError('the split must be a non-empty object of version ids and weights, e.g. '
                           '{"v7": 0.9, "v8": 0.1}', "split")
    weights: dict[int, float] = {}
    for key, weight in body.items():
        match = _VERSION_ID.match(key)
        if match is None:
            raise RequestError(f"{key!r} is not a version id (v<number>, as GET /v1/adapters lists them)", key)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
                math.isfinite(weight) and weight > 0):
            raise RequestError(f"the weight of {key} must be a positive number, got {weight!r}", key)
        weights[int(match.group(1))] = float(weight)
    top = max(weights.values())  # scaled first: a sum of huge weights must not overflow
    total = sum(w / top for w in weights.values())
    return {version: w / top / total for version, w in weights.items()}


router = APIRouter()
AdapterName = Annotated[str, Path(json_schema_extra={"pattern": ADAPTER_NAME_PATTERN})]  # checked in the handler


def manager(request: Request, name: str | None = None) -> ApiKey:
    """The caller, if it may manage adapters (``name``: this one); else 403, or 404 for a name out of scope."""
    context(request).policy.check_enabled()
    key = caller(request)
    if not key.admin:
        raise ServerError(403, "this API key may not manage adapters (it is not an admin key)")
    if name is not None and not key.may_use(name):
        raise unknown_adapter(name)
    return key


async def entry_of(ctx: ServerContext, name: str) -> dict:
    """``name``'s entry in ``GET /v1/adapters``; ``UnknownAdapter`` (404) once it is unloaded."""
    entry = next((e for e in await ctx.client.adapter_versions() if e["name"] == name), None)
    if entry is None:
        raise unknown_adapter(name)
    return entry


@router.post("/v1/load_lora_adapter", response_model=AdapterLoaded,
             responses=documented(AdapterLoaded, 400, 403, 404, 409, 413, 503, 507))
async def load_lora_adapter(body: LoadAdapterRequest, request: Request) -> dict:
    check_adapter_name(body.lora_name, "lora_name")
    ctx = context(request)
    path = ctx.policy.check(body.lora_path)
    key = manager(request)
    if not key.may_use(body.lora_name):
        raise ServerError(403, f"this API key may not manage an adapter named {body.lora_name!r}", "lora_name")
    if body.lora_name in ctx.base_aliases:
        raise ServerError(400, f"lora_name {body.lora_name!r} is the base model's name", "lora_name")
    try:
        info = await ctx.client.load_adapter(body.lora_name, str(path), new_version=body.version == "new",
                                             roots=ctx.policy.load_roots())
    except Exception:
        ctx.metrics.runtime_loads.labels("error").inc()
        raise
    ctx.metrics.runtime_loads.labels("ok").inc()
    reset_openapi(request.app)  # its name and vocabulary join the schema
    logger.info("loaded adapter %r version v%d from %s", body.lora_name, info.version_id, path)
    return {"status": "ok", "message": f"adapter {body.lora_name!r} loaded", **ctx.adapter_card(info)}


@router.post("/v1/unload_lora_adapter", response_model=AdapterUnloaded,
             responses=documented(AdapterUnloaded, 400, 403, 404, 413, 503))
async def unload_lora_adapter(body: UnloadAdapterRequest, request: Request) -> dict:
    check_adapter_name(body.lora_name, "lora_name")
    manager(request, body.lora_name)
    await context(request).client.unload_adapter(body.lora_name)
    reset_openapi(request.app)
    logger.info("unloaded adapter %r", body.lora_name)
    return {"status": "ok", "message": f"adapter {body.lora_name!r} unloaded", "id": body.lora_name}


@router.get("/v1/adapters", response_model=AdapterVersionList, responses=documented(AdapterVersionList, 503))
async def list_adapter_versions(request: Request) -> dict:
    key = caller(request)
    return {"object": "list", "data": [entry for entry in await context(request).client.adapter_versions()
                                       if key.may_use(entry["name"])]}


@router.post("/v1/adapters/{name}/rollback", response_model=AdapterVersions,
             responses=documented(AdapterVersions, 400, 403, 404, 409, 503))
async def rollback_adapter(name: AdapterName, request: Request) -> dict:
    check_adapter_name(name, "name")
    manager(request, name)
    ctx = context(request)
    info = await ctx.client.rollback_adapter(name)
    logger.info("adapter %r rolled back to v%d", name, info.version_id)
    return await entry_of(ctx, name)


@router.post("/v1/adapters/{name}/split", response_model=AdapterVersions,
             responses=documented(AdapterVersions, 400, 403, 404, 413, 503))
async def split_adapter(name: AdapterName, request: Request,
                        body: Any = Body(..., json_schema_extra=SPLIT_SCHEMA)) -> dict:  # noqa: B008
    check_adapter_name(name, "name")
    manager(request, name)
    ctx = context(request)
    weights = split_weights(body)
    await ctx.client.split_adapter(name, weights)
    logger.info("adapter %r split %s", name, {f"v{v}": round(w, 4) for v, w in weights.items()})
    return await entry_of(ctx, name)


UPLOAD_MEDIA_TYPE = "application/octet-stream"
UPLOAD_BODY = {"requestBody": {"required": True, "description": (
    "one safetensors file of PEFT adapter tensors; __metadata__.adapter_config holds adapter_config.json's text"),
    "content": {UPLOAD_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}}


def parse_upload(body: bytes, name: str) -> tuple[int, str]:
    """``(tensor count, adapter_config JSON text)`` of a PUT body (one safetensors file), checked here so that a
    malformed file (``safetensors_file.parse_header``'s checks) or a missing config is a 400 (``InvalidAdapter``)
    before the engine sees it; the engine parses the same bytes again with the same checks."""
    what = f"PUT /v1/adapters/{name}: the body"
    length = header_length(body[:HEADER_LENGTH_BYTES], len(body), what)
    header = parse_header(body[HEADER_LENGTH_BYTES : HEADER_LENGTH_BYTES + length], len(body), what)
    config = header.metadata.get("adapter_config")
    if config is None:
        raise InvalidAdapter(f'{what} has no __metadata__["adapter_config"] (the adapter_config.json text)')
    return len(header.specs), config


@router.put("/v1/adapters/{name}", response_model=AdapterVersions, openapi_extra=UPLOAD_BODY,
            responses=documented(AdapterVersions, 400, 403, 413, 415, 503, 507))
async def put_adapter(name: AdapterName, request: Request) -> dict:
    """Load ``name`` from the body's tensors, or promote a new version of it (module docstring)."""
    check_adapter_name(name, "name")
    ctx = context(request)
    key = manager(request)
    if not key.may_use(name):
        raise ServerError(403, f"this API key may not manage an adapter named {name!r}", "name")
    if name in ctx.base_aliases:
        raise ServerError(400, f"{name!r} is the base model's name", "name")
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != UPLOAD_MEDIA_TYPE:
        raise ServerError(415, f"the body must be a safetensors file sent as Content-Type: {UPLOAD_MEDIA_TYPE} "
                          f"(got {media or 'none'!r})", "Content-Type")
    try:
        body = await request.body()
        count, config = await asyncio.to_thread(parse_upload, body, name)
        info = await ctx.client.load_adapter(name, tensors=TensorBlob(body), config=config, new_version=True)
    except Exception:
        ctx.metrics.runtime_loads.labels("error").inc()
        raise
    ctx.metrics.runtime_loads.labels("ok").inc()
    reset_openapi(request.app)
    logger.info("adapter %r version v%d loaded from %d uploaded tensors", name, info.version_id, count)
    return await entry_of(ctx, name)


@router.post("/v1/adapters/{name}/pin", response_model=AdapterVersions,
             responses=documented(AdapterVersions, 400, 403, 404, 409, 503))
async def pin_adapter(name: AdapterName, request: Request) -> dict:
    check_adapter_name(name, "name")
    manager(request, name)
    ctx = context(request)
    await ctx.client.pin_adapter(name)
    logger.info("adapter %r pinned", name)
    return await entry_of(ctx, name)


@router.post("/v1/adapters/{name}/unpin", response_model=AdapterVersions,
             responses=documented(AdapterVersions, 400, 403, 404, 503))
async def unpin_adapter(name: AdapterName, request: Request) -> dict:
    check_adapter_name(name, "name")
    manager(request, name)
    ctx = context(request)
    await ctx.client.unpin_adapter(name)
    logger.info("adapter %r unpinned", name)
    return await entry_of(ctx, name)
