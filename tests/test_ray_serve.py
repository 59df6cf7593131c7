"""Scale-out on Ray Serve: a local Ray (127.0.0.1, 2 CPUs), two engine replicas on the tiny llama.

Completions and chat, streamed and not, for the base model, a start-up adapter and three adapters
loaded lazily from the adapter root, all equal to HF transformers + PEFT's greedy text
(``tests/hf_text.py``); repeated requests for one adapter stay on the replica that holds it; a client
that disconnects aborts its request on its replica; a replica killed mid-stream fails its streams with
a clear error, its unanswered requests are re-sent, and Serve restarts it; ``import loraplex`` needs no Ray.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from loraplex.config import EngineConfig
from loraplex.integrations import ray_serve
from loraplex.integrations.asgi_bridge import ForwardedRequest, ResponseStart
from loraplex.integrations.ray_config import (
    AFFINITY_HEADER,
    APP_NAME,
    ENGINE_DEPLOYMENT,
    REPLICA_HEADER,
    RayServeConfig,
)
from loraplex.integrations.ray_ingress import routing_key
from tests.hf_text import hf_chat, hf_complete

pytestmark = pytest.mark.ray
logger = logging.getLogger(__name__)

BASE = "tiny"
STARTUP = "r8_all"  # loaded on every replica at start
LAZY = ("r4_attn", "r16_mlp", "r2_qv")  # in the adapter root, loaded by the replica that first serves them
AFFINE = "r4_attn_copy"  # also in the root; only the affinity test uses it
DROPPED = "r16_mlp_copy"  # also in the root; only the disconnect test uses it
DORA = "dora"  # in the root, but invalid (use_dora=true)
ESCAPE = "escape"  # a symlink in the root to an adapter folder outside it
ROOT = {**{name: name for name in LAZY}, AFFINE: "r4_attn", DROPPED: "r16_mlp", DORA: "r2_qv"}  # root name -> source
ENGINE = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=8)
MESSAGES = [{"role": "user", "content": "Name a colour."}]
API_KEY = "ray-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Deployment:
    url: str

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=AUTH, timeout=60)

    def async_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=AUTH, timeout=60)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def deployment(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("ray-adapter-root")
    for name, source in ROOT.items():
        shutil.copytree(tiny_llama_adapters[source], root / name)
    peft_config = json.loads((root / DORA / "adapter_config.json").read_text())
    (root / DORA / "adapter_config.json").write_text(json.dumps({**peft_config, "use_dora": True}))
    (root / ESCAPE).symlink_to(tiny_llama_adapters["r2_qv"], target_is_directory=True)
    config = RayServeConfig(
        engine=EngineConfig(model=str(tiny_llama), **ENGINE), replicas=2,
        adapters=((STARTUP, str(tiny_llama_adapters[STARTUP])),), adapter_roots=(str(root),),
        served_model_name=BASE, api_key=API_KEY, num_cpus_per_replica=0.5, torch_threads=1, port=free_port(),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
        try:
            start = time.monotonic()
            url = ray_serve.deploy(config)
            logger.warning("2-replica deployment ready in %.1f s (Ray already running)", time.monotonic() - start)
            yield Deployment(url)
        finally:
            ray_serve.shutdown()
            ray.shutdown()


@dataclass(frozen=True)
class Reference:
    """HF + PEFT's greedy texts (EOS ignored) for a served name: the expected side of every answer."""

    base: Path
    adapters: dict[str, Path]

    def complete(self, model: str, prompt: str, max_tokens: int) -> str:
        return hf_complete(self.base, self.adapters.get(model), prompt, max_tokens, ignore_eos=True).text

    def chat(self, model: str, messages: list[dict], max_tokens: int) -> str:
        return hf_chat(self.base, self.adapters.get(model), messages, max_tokens, ignore_eos=True).text


@pytest.fixture(scope="module")
def offline(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> Reference:
    return Reference(tiny_llama, tiny_llama_adapters)


def run(coro: object, timeout: float = 120) -> object:
    return asyncio.run(asyncio.wait_for(coro, timeout))  # type: ignore[arg-type]


def test_routing_key_is_the_adapter_of_generation_requests() -> None:
    base = frozenset({BASE, "/models/tiny"})

    def key(path: str, body: bytes, method: str = "POST") -> str:
        return routing_key(ForwardedRequest(method, path, body=body), base)

    assert key("/v1/completions", b'{"model": "sql", "prompt": "x"}') == "sql"
    assert key("/v1/chat/completions", b'{"model": "sql", "messages": []}') == "sql"
    assert key("/v1/completions", b'{"model": "tiny"}') == key("/v1/completions", b'{"model": "/models/tiny"}') == ""
    assert key("/v1/completions", b"not json") == key("/v1/completions", b'["sql"]') == ""
    assert key("/v1/completions", b'{"model": 3}') == key("/v1/models", b"", "GET") == ""


def test_config_rejects_bad_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        RayServeConfig(replicas=0)
    with pytest.raises(ValueError, match="is not a folder"):
        RayServeConfig(adapter_roots=(str(tmp_path / "missing"),))


def test_models_lists_base_startup_and_root_adapters(deployment: Deployment) -> None:
    for _ in range(4):  # whichever replica answers, the same list
        ids = [card["id"] for card in deployment.http().get("/v1/models").json()["data"]]
        assert ids == [BASE, STARTUP, *sorted(ROOT)]


def test_ingress_checks_the_api_key_and_explains_lazy_loading(deployment: Deployment) -> None:
    body = {"model": BASE, "prompt": "Hi", "max_tokens": 1}
    denied = httpx.post(f"{deployment.url}/v1/completions", json=body, timeout=60)
    assert denied.status_code == 401 and "API key" in denied.json()["error"]["message"]
    assert httpx.get(f"{deployment.url}/health", timeout=60).json() == {"status": "ok"}
    assert deployment.http().post("/v1/completions", json=body).status_code == 200
    r = deployment.http().post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert r.status_code == 403 and "<adapter root>/NAME" in r.json()["error"]["message"]


def test_bad_root_adapters_fail_their_requests_only(deployment: Deployment) -> None:
    http = deployment.http()
    for _ in range(2):  # a failed load is not remembered as held
        r = http.post("/v1/completions", json={"model": DORA, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 400 and "use_dora=true" in r.json()["error"]["message"], r.text
    r = http.post("/v1/completions", json={"model": ESCAPE, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 403 and "outside the allowed adapter roots" in r.json()["error"]["message"], r.text
    r = http.post("/v1/completions", json={"model": "../r2_qv", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    assert http.post("/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_outputs_equal_hf(deployment: Deployment, offline: Reference) -> None:
    """Every model, completions (whole and streamed) and chat, sent concurrently."""
    models = [BASE, STARTUP, *LAZY]
    prompts = {m: f"Request for {m}: the weather today is" for m in models}

    async def complete(client: openai.AsyncOpenAI, model: str) -> str:
        out = await client.completions.create(model=model, prompt=prompts[model], max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
        return out.choices[0].text

    async def stream(client: openai.AsyncOpenAI, model: str) -> str:
        chunks = await client.completions.create(model=model, prompt=prompts[model], max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in chunks])

    async def chat(client: openai.AsyncOpenAI, model: str) -> str:
        out = await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                                   extra_body={"ignore_eos": True})
        return out.choices[0].message.content or ""

    async def all_requests() -> list[str]:
        client = deployment.client()
        return await asyncio.gather(*(f(client, m) for m in models for f in (complete, stream, chat)))

    got = run(all_requests())
    want = [text for m in models for text in (offline.complete(m, prompts[m], 12), offline.complete(m, prompts[m], 12),
                                              offline.chat(m, MESSAGES, 8))]
    assert got == want


def test_repeated_requests_stay_on_the_replica_holding_the_adapter(deployment: Deployment) -> None:
    def once(model: str) -> httpx.Response:
        r = deployment.http().post("/v1/completions",
                                   json={"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        return r

    first = once(AFFINE)  # no replica holds it yet: Serve picks one, which loads it
    home = first.headers[REPLICA_HEADER]
    assert first.headers[AFFINITY_HEADER] == "miss"
    time.sleep(1.5)  # the replica advertises its adapters to Serve's router every 0.1 s
    for _ in range(8):
        r = once(AFFINE)
        assert (r.headers[REPLICA_HEADER], r.headers[AFFINITY_HEADER]) == (home, "hit")
    assert REPLICA_HEADER in once(BASE).headers and AFFINITY_HEADER not in once(BASE).headers


def replica_metrics(adapter: str) -> tuple[str, dict[tuple[str, str], float]]:
    """(replica id, requests by (adapter, status)) of the replica Serve routes ``adapter`` to."""
    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)

    async def fetch() -> list[ResponseStart | bytes]:
        gen = handle.options(stream=True, multiplexed_model_id=adapter).handle_http.remote(
            ForwardedRequest("GET", "/metrics"))
        return [item async for item in gen]

    start, *body = run(fetch())
    text = b"".join(body).decode()
    counts = {(s.labels["adapter"], s.labels["status"]): s.value for family in text_string_to_metric_families(text)
              if family.name == "loraplex_requests" for s in family.samples if s.name.endswith("_total")}
    return start.header(REPLICA_HEADER), counts


def test_disconnected_client_aborts_its_request(deployment: Deployment) -> None:
    model = DROPPED
    body = {"model": model, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with deployment.http().stream("POST", "/v1/completions", json=body) as r:
        home = r.headers[REPLICA_HEADER]
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
    deadline = time.monotonic() + 30
    while True:
        replica, counts = replica_metrics(model)
        if replica == home and counts.get((model, "abort")) == 1:
            break
        assert time.monotonic() < deadline, f"no abort recorded on {home}: {replica} {counts}"
        time.sleep(0.2)
    assert (model, "length") not in counts


def test_replica_failure_is_survived(deployment: Deployment, offline: Reference) -> None:
    streamed = [BASE, STARTUP, LAZY[0], BASE, STARTUP, LAZY[0]]
    whole = [BASE, STARTUP, LAZY[2]]

    async def stream(client: httpx.AsyncClient, model: str, live: list[str]) -> tuple[str, str]:
        """(replica, "ok" | the error event); ``live`` gets the replica once tokens arrive."""
        body = {"model": model, "prompt": f"{model} says", "max_tokens": 450, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            replica, events = r.headers[REPLICA_HEADER], 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    events += 1
                    if events == 1:
                        live.append(replica)
                    if '"error"' in line:
                        return replica, line
            return replica, f"ok after {events} events"

    async def complete(client: httpx.AsyncClient, model: str) -> tuple[int, str]:
        r = await client.post("/v1/completions", json={"model": model, "prompt": f"{model}:", "max_tokens": 200,
                                                       "ignore_eos": True, "temperature": 0})
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

    async def drill() -> tuple[str, list[tuple[str, str]], list[tuple[int, str]]]:
        async with deployment.async_http() as client:
            live: list[str] = []
            streams = [asyncio.ensure_future(stream(client, m, live)) for m in streamed]
            wholes = [asyncio.ensure_future(complete(client, m)) for m in whole]
            while not live:
                await asyncio.sleep(0.01)
            victim_id = live[0]
            ray.kill(ray_serve.engine_replica_actors()[victim_id], no_restart=True)
            return victim_id, await asyncio.gather(*streams), await asyncio.gather(*wholes)

    victim, stream_results, whole_results = run(drill())
    on_victim = [outcome for replica, outcome in stream_results if replica == victim]
    assert on_victim and all("failed mid-stream" in o for o in on_victim), stream_results
    assert all(o.startswith("ok") for replica, o in stream_results if replica != victim), stream_results
    assert whole_results == [(200, offline.complete(m, f"{m}:", 200)) for m in whole]

    deadline = time.monotonic() + 90  # Serve replaces the dead replica
    while not (len(actors := ray_serve.engine_replica_actors()) == 2 and victim not in actors):
        assert time.monotonic() < deadline, f"Serve did not restart {victim}: {sorted(actors)}"
        time.sleep(0.5)
    for model in (BASE, LAZY[0], LAZY[2]):
        r = deployment.http().post("/v1/completions",
                                   json={"model": model, "prompt": "after", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] != victim


def test_loraplex_imports_and_explains_without_ray(tiny_llama: Path) -> None:
    script = ("import sys; sys.modules['ray'] = None\n"  # makes every `import ray` fail
              "import loraplex, loraplex.cli, loraplex.integrations\n"
              "loraplex.cli.build_parser()\n"
              f"sys.exit(loraplex.cli.main(['serve-ray', '--model', {str(tiny_llama)!r}]))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "serve-ray needs Ray Serve: pip install 'loraplex[ray]'" in done.stderr
