"""Scoped keys cover every route and limits hold under parallel requests (issue 30, item 2), over real HTTP in
both engine modes:

- with a keys file, ``/metrics`` (every adapter's and tenant's traffic) answers only admin keys and keys with
  ``metrics = true``: 401 without a key, 403 with another; with the single ``--api-key`` it stays open;
- ``tokens_per_minute = 300``: 8 parallel requests that may each use 102 tokens: exactly 2 are admitted and
  the tokens served stay within 300 (on main all 8 ran, 808 tokens); a request that ends early gives back
  its unused reservation at once; one that could never fit is a 429 without ``Retry-After``;
- ``max_running_requests``: engine requests (choices) in flight, not HTTP requests: ``n=8`` over a limit of 4
  is refused, ``n=2`` while 3 run is a 429 with ``Retry-After``, and the seats come back when they end.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from loraplex.server.app import create_app
from loraplex.server.tenancy.keys import ApiKey, KeyTable
from loraplex.server.tenancy.quotas import Demand, TenantQuotas
from tests.server_harness import BASE, MODES, Server, running_server, tiny_server
from tests.test_server_tenancy import engine_paused

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=16)
OPS, SCRAPER, ALPHA, TPM, TPM2, SEATS = "sk-ops-1", "sk-scrape-1", "sk-alpha-1", "sk-tpm-1", "sk-tpm-2", "sk-seats-1"
KEYS = KeyTable([
    ApiKey(key=OPS, tenant="ops"),
    ApiKey(key=SCRAPER, tenant="scraper", adapters=(), base_model=False, admin=False, metrics=True),
    ApiKey(key=ALPHA, tenant="alpha", admin=False),
    ApiKey(key=TPM, tenant="tpm", admin=False, tokens_per_minute=300),
    ApiKey(key=TPM2, tenant="tpm2", admin=False, tokens_per_minute=300),
    ApiKey(key=SEATS, tenant="seats", admin=False, max_running_requests=4),
])
PROMPT = "Hello there"  # 2 tokens of the tiny tokenizer


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all",), (), tmp_path_factory.mktemp("root"),
                     mode=request.param, app_options={"api_keys": KEYS}, **CONFIG) as srv:
        yield srv


def post(server: Server, key: str | None, body: dict, path: str = "/v1/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def metrics(url: str, key: str | None) -> httpx.Response:
    return httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)


def test_metrics_need_an_admin_or_scraper_key(server: Server) -> None:
    assert post(server, ALPHA, {"model": "r8_all", "prompt": PROMPT, "max_tokens": 2}).status_code == 200
    anonymous, other = metrics(server.url, None), metrics(server.url, ALPHA)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"
    assert other.status_code == 403 and other.json()["error"]["type"] == "permission_error"
    assert "r8_all" not in anonymous.text + other.text and "alpha" not in anonymous.text + other.text
    for key in (OPS, SCRAPER):
        scraped = metrics(server.url, key)
        assert scraped.status_code == 200 and 'tenant="alpha"' in scraped.text and 'adapter="r8_all"' in scraped.text
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # health stays open


def test_the_single_api_key_leaves_metrics_open(server: Server) -> None:
    app = create_app(server.engine_client, served_model_name=BASE, api_key="sk-single")
    with running_server(app) as url:
        assert metrics(url, None).status_code == 200
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401


def test_parallel_requests_cannot_pass_tokens_per_minute(server: Server) -> None:
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(server, TPM, body), range(8)))
    served = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code != 200]
    assert len(served) == 2, [a.text[:200] for a in answers]  # 2 x 102 <= 300 < 3 x 102
    assert sum(a.json()["usage"]["total_tokens"] for a in served) == 204
    for answer in refused:
        assert answer.status_code == 429 and answer.json()["error"]["type"] == "rate_limit_error"
        assert 1 <= int(answer.headers["retry-after"]) <= 60
        assert "may use 102 tokens" in answer.json()["error"]["message"]


def test_an_early_end_returns_its_unused_tokens(server: Server) -> None:
    probe = post(server, OPS, {"model": BASE, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}).json()
    text = probe["choices"][0]["text"]
    assert text, "the tiny model's greedy text starts with a character (deterministic)"
    early = post(server, TPM2, {"model": BASE, "prompt": PROMPT, "max_tokens": 250, "temperature": 0,
                                "stop": [text[0]]})
    assert early.status_code == 200 and early.json()["usage"]["completion_tokens"] <= 3
    # 252 were reserved; if they were kept, 252 + 252 > 300 would refuse the next one for a minute
    again = post(server, TPM2, {"model": BASE, "prompt": PROMPT, "max_tokens": 250, "temperature": 0, "stop": ["x"]})
    assert again.status_code == 200, again.text
    never = post(server, TPM2, {"model": BASE, "prompt": PROMPT, "max_tokens": 100, "n": 3})
    assert never.status_code == 429 and "retry-after" not in never.headers
    assert "more than this key's tokens_per_minute 300" in never.json()["error"]["message"]


def test_max_running_requests_counts_engine_requests(server: Server) -> None:
    over = post(server, SEATS, {"model": BASE, "prompt": PROMPT, "max_tokens": 2, "n": 8})
    assert over.status_code == 429 and "retry-after" not in over.headers
    assert "needs 8 engine requests" in over.json()["error"]["message"]
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {SEATS}"},
                      json={"model": BASE, "prompt": "Once", "max_tokens": 400, "n": 3, "temperature": 0,
                            "ignore_eos": True, "stream": True}, timeout=60) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        next(lines)
        with engine_paused(server):
            refused = post(server, SEATS, {"model": BASE, "prompt": PROMPT, "max_tokens": 2, "n": 2})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        assert "already runs 3 of its 4" in refused.json()["error"]["message"]
        assert list(lines)[-2] == "data: [DONE]"
    for _ in range(200):  # the stream's lease ends as its response does
        answer = post(server, SEATS, {"model": BASE, "prompt": PROMPT, "max_tokens": 2, "n": 4})
        if answer.status_code != 429:
            break
    assert answer.status_code == 200, answer.text


def test_reservations_with_a_fake_clock() -> None:
    now = [1000.0]
    quotas = TenantQuotas(clock=lambda: now[0])
    key = ApiKey(key="k", tenant="t", tokens_per_minute=100, max_running_requests=5)
    a = quotas.admit(key, Demand(10, 50, 2))
    b = quotas.admit(key, Demand(10, 30, 3))
    assert quotas.reserved(key) == (2, 5, 100)
    with pytest.raises(Exception, match="already runs 5 of its 5"):
        quotas.admit(key, Demand(1, 0, 1))
    a.release(5)  # used 15 of its 60: 45 come back at once
    assert quotas.reserved(key) == (1, 3, 40)
    c = quotas.admit(key, Demand(10, 35, 2))  # 15 spent + 40 + 45 = 100
    with pytest.raises(Exception, match="are spent or reserved") as refused:
        quotas.admit(key, Demand(1, 0, 0))
    assert refused.value.headers["Retry-After"] == "60"  # when the 15 spent expire, 85 + 1 fit
    with pytest.raises(Exception, match="are spent or reserved") as refused:
        quotas.admit(key, Demand(10, 10, 0))
    assert refused.value.headers["Retry-After"] == "1"  # 85 reserved + 20: only the running requests' end helps
    b.release(30)
    c.release(35)
    assert quotas.reserved(key) == (0, 0, 0)
    with pytest.raises(Exception, match="are spent or reserved") as refused:
        quotas.admit(key, Demand(10, 10))  # 15 + 40 + 45 = 100 spent at t=1000
    assert refused.value.headers["Retry-After"] == "60"
    now[0] += 60
    quotas.admit(key, Demand(10, 90)).release()
