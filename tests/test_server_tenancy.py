"""Scoped API keys over real HTTP (server/tenancy/keys.py, server/tenancy/quotas.py), in both engine modes: a
key sees and uses only its scope (an adapter outside it is a 404 with the unknown model's exact body, in
/v1/models too), non-admin loads are 403, limits answer 429 with Retry-After, the tenant label is bounded to the
configured tenants, the tenant reaches the engine, and no key is ever logged."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.server.openai.errors import ServerError
from loraplex.server.tenancy.keys import ApiKey, KeyTable
from loraplex.server.tenancy.quotas import TenantQuotas
from tests.server_harness import BASE, MODES, Server, tiny_server

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=8)
KEYS_TOML = """
[[keys]]
key = "sk-ops-0123456789"
tenant = "ops"
adapters = ["*"]
admin = true

[[keys]]
key = "sk-alpha-0123456789"
tenant = "alpha"
adapters = ["r8_*"]
base_model = false
max_concurrent_requests = 1

[[keys]]
key = "sk-beta-0123456789"
tenant = "beta"
adapters = ["r4_attn"]
tokens_per_minute = 18  # the first request below reserves 2 + 12
"""
KEYS_YAML = """
keys:
  - key: sk-ops-0123456789
    tenant: ops
    adapters: ["*"]
    admin: true
  - key: sk-alpha-0123456789
    tenant: alpha
    adapters: ["r8_*"]
    base_model: false
    max_concurrent_requests: 1
  - key: sk-beta-0123456789
    tenant: beta
    adapters: [r4_attn]
    tokens_per_minute: 18
"""
OPS, ALPHA, BETA = "sk-ops-0123456789", "sk-alpha-0123456789", "sk-beta-0123456789"


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("keys") / ("keys.toml" if request.param == "thread" else "keys.yaml")
    keys.write_text(KEYS_TOML if request.param == "thread" else KEYS_YAML)
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all", "r4_attn"), (), tmp_path_factory.mktemp("root"),
                     mode=request.param, app_options={"api_keys": str(keys)}, **CONFIG) as srv:
        yield srv


def post(server: Server, path: str, key: str | None, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def complete(server: Server, key: str, model: str, **extra: object) -> httpx.Response:
    return post(server, "/v1/completions", key, {"model": model, "prompt": "Hello there", "max_tokens": 4,
                                                 "temperature": 0, **extra})


def without(text: str, name: str) -> str:
    return text.replace(repr(name), "'<model>'")


def test_a_model_outside_the_scope_is_exactly_an_unknown_one(server: Server) -> None:
    assert complete(server, ALPHA, "r8_all").status_code == 200
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})):
        hidden = post(server, path, ALPHA, {"model": "r4_attn", **body})
        unknown = post(server, path, ALPHA, {"model": "no-such-adapter", **body})
        assert hidden.status_code == unknown.status_code == 404
        assert without(hidden.text, "r4_attn") == without(unknown.text, "no-such-adapter")
        assert post(server, path, ALPHA, {"model": BASE, **body}).status_code == 404  # base_model = false
    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {ALPHA}"}).json()
    assert [m["id"] for m in models["data"]] == ["r8_all"]
    versions = httpx.get(f"{server.url}/v1/adapters", headers={"Authorization": f"Bearer {ALPHA}"}).json()
    assert [v["name"] for v in versions["data"]] == ["r8_all"]
    ops = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {OPS}"}).json()
    assert [m["id"] for m in ops["data"]] == [BASE, "r8_all", "r4_attn"]
    for key, model in ((None, "r4_attn"), (ALPHA, "r4_attn")):  # /tokenize needs no key: then the base only
        hidden = post(server, "/tokenize", key, {"model": model, "prompt": "Hi"})
        unknown = post(server, "/tokenize", key, {"model": "nope", "prompt": "Hi"})
        assert hidden.status_code == unknown.status_code == 404
        assert without(hidden.text, model) == without(unknown.text, "nope")
    assert post(server, "/tokenize", BETA, {"model": "r4_attn", "prompt": "Hi"}).status_code == 200
    assert post(server, "/tokenize", None, {"model": BASE, "prompt": "Hi"}).status_code == 200
    assert httpx.get(f"{server.url}/v1/slots", headers={"Authorization": f"Bearer {ALPHA}"}).status_code == 403
    assert httpx.get(f"{server.url}/v1/slots", headers={"Authorization": f"Bearer {OPS}"}).status_code == 200
    assert complete(server, "sk-wrong", "r8_all").status_code == 401


def test_only_admin_keys_manage_adapters(server: Server, tiny_llama_adapters: dict[str, Path]) -> None:
    if not (server.root / "r2_qv").exists():
        shutil.copytree(tiny_llama_adapters["r2_qv"], server.root / "r2_qv")
    body = {"lora_name": "r8_extra", "lora_path": str(server.root / "r2_qv")}
    refused = post(server, "/v1/load_lora_adapter", ALPHA, body)
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    assert post(server, "/v1/adapters/r8_all/rollback", ALPHA, {}).status_code == 403
    assert post(server, "/v1/load_lora_adapter", OPS, body).status_code == 200
    assert complete(server, ALPHA, "r8_extra").status_code == 200  # in alpha's scope (r8_*) once loaded
    assert post(server, "/v1/unload_lora_adapter", OPS, {"lora_name": "r8_extra"}).status_code == 200


@contextmanager
def engine_paused(server: Server) -> Iterator[None]:
    """No engine step runs inside the block: the in-process step loop waits on a gate; the engine process is
    stopped (SIGSTOP)."""
    if server.engine is None:
        pid = server.engine_client.info.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)
        return
    gate, step = threading.Event(), server.engine.step
    server.engine.step = lambda: (gate.wait(), step())[1]
    try:
        yield
    finally:
        server.engine.step = step
        gate.set()


def test_concurrency_limit_is_a_429_with_retry_after(server: Server) -> None:
    """alpha may run one request at a time: a second one while its stream is open (the engine paused
    mid-stream) is refused; once the stream ended, alpha is admitted again."""
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {ALPHA}"},
                      json={"model": "r8_all", "prompt": "Once", "max_tokens": 480, "n": 16, "temperature": 0,
                            "ignore_eos": True, "stream": True}, timeout=60) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        next(lines)
        with engine_paused(server):
            refused = complete(server, ALPHA, "r8_all")
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert complete(server, OPS, "r8_all").status_code == 200  # other keys are not limited by it
        assert list(lines)[-2] == "data: [DONE]"
    deadline = time.monotonic() + 30
    while (response := complete(server, ALPHA, "r8_all")).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.05)  # the stream's lease ends as its response does
    assert response.status_code == 200


def test_tokens_per_minute_is_a_429_with_retry_after(server: Server) -> None:
    first = complete(server, BETA, "r4_attn", max_tokens=12, ignore_eos=True)
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] >= 12
    refused = complete(server, BETA, "r4_attn")
    assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60


def test_tenant_metrics_are_bounded_and_the_tenant_reaches_the_engine(server: Server) -> None:
    before = tenant_requests(server)
    assert complete(server, OPS, "r4_attn").status_code == 200
    after = tenant_requests(server)
    assert after[("ops", "length")] == before.get(("ops", "length"), 0) + 1
    assert {tenant for tenant, _ in after} <= {"ops", "alpha", "beta", "none"}
    if server.engine is not None:
        assert server.engine.scheduler.fair_share.counters["ops"] > 0


def tenant_requests(server: Server) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {OPS}"}).text
    return {(s.labels["tenant"], s.labels["status"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "loraplex_tenant_requests_total"}


def test_keys_are_never_logged(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        complete(server, "sk-not-a-key-42", "r8_all")
        complete(server, OPS, "r8_all")
        post(server, "/v1/load_lora_adapter", ALPHA, {"lora_name": "x", "lora_path": "/nowhere"})
    logged = caplog.text + "".join(repr(r.args) for r in caplog.records)
    assert not any(k in logged for k in (OPS, ALPHA, BETA, "sk-not-a-key-42"))
    assert OPS not in repr(KeyTable.single(OPS).keys[0])


def test_keys_file_errors_name_the_entry_and_field(tmp_path: Path) -> None:
    cases = {"keys = []": "non-empty list 'keys'",
             '[[keys]]\nkey = "a"': r"keys\[0\]\.tenant: required",
             '[[keys]]\nkey = "a"\ntenant = "t"\nadmins = true': "unknown field 'admins'",
             '[[keys]]\nkey = "a"\ntenant = "t"\ntokens_per_minute = 0': r"keys\[0\]\.tokens_per_minute",
             '[[keys]]\nkey = "a"\ntenant = "t"\n[[keys]]\nkey = "a"\ntenant = "u"': "listed twice"}
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"k{i}.toml"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            KeyTable.load(path)


def test_quota_windows_and_retry_after_with_a_fake_clock() -> None:
    now = [1000.0]
    quotas = TenantQuotas(clock=lambda: now[0])
    key = ApiKey(key="k", tenant="t", tokens_per_minute=100, max_concurrent_requests=2)
    a = quotas.admit(key, 30)
    now[0] += 10
    b = quotas.admit(key, 30)
    with pytest.raises(ServerError) as refused:
        quotas.admit(key, 1)
    assert refused.value.status == 429 and "max_concurrent_requests" in str(refused.value)
    a.release(50)  # 80 tokens in the window now (30 + 50, at t=1010) and b's 30 reserved
    a.release(50)  # a second release is a no-op
    with pytest.raises(ServerError) as refused:
        quotas.admit(key, 1)
    assert refused.value.headers["Retry-After"] == "60"  # at t=1070 the 80 expire: 30 reserved + 1 <= 100
    now[0] += 60
    quotas.admit(key, 1).release()
    b.release()
