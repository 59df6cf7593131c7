"""One tenant's hostile grammar does not stall another's (issue 30, item 4), over real HTTP in both engine
modes, with scoped keys (tenants ``attacker``, ``victim``, ``reader``) and a 6 s compile budget:

the attacker sends a schema within every static limit that takes long to compile (512 properties with a
``pattern`` of twelve optional letters each: 59 s here); while it compiles, the victim's small schema is
answered (200, one of its choices) *before* the attacker's answer, which is a 400 on
``structured_outputs`` naming the budget; and the reader's stream keeps flowing meanwhile (chunks arrive
between the bomb's send and the victim's answer). On main the bomb got no answer in 45-60 s and the
victim's schema waited behind it. Ordering, not wall-clock bounds: the victim must not wait for the
bomb's budget, whatever the host's speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.server.tenancy.keys import ApiKey, KeyTable
from tests.server_harness import BASE, MODES, Server, tiny_server
from tests.test_grammar_compile_pool import HOSTILE

TIMEOUT_S = 6.0  # far below the bomb's compile, far above the victim's request
CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=128, max_num_seqs=4,
              grammar_compile_timeout_s=TIMEOUT_S, grammar_compile_workers=2)
KEYS = KeyTable([ApiKey(key=f"sk-{tenant}", tenant=tenant, admin=False) for tenant in ("attacker", "victim", "reader")])
CHOICES = ["red", "green", "blue"]


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(tiny_llama, tiny_llama_adapters, (), (), tmp_path_factory.mktemp("root"), mode=request.param,
                     app_options={"api_keys": KEYS}, **CONFIG) as srv:
        assert complete(srv, "victim", {"choice": ["a", "b"]}).status_code == 200  # the compile workers started
        yield srv


def complete(server: Server, tenant: str, structured: dict) -> httpx.Response:
    body = {"model": BASE, "prompt": "Colour:", "max_tokens": 6, "temperature": 0, "structured_outputs": structured}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer sk-{tenant}"},
                      timeout=120)


def test_a_hostile_schema_does_not_stall_another_tenants_schema_or_streams(server: Server) -> None:
    events: list[str] = []  # in arrival order: "chunk" (the reader's stream), "bomb sent", "victim", "bomb"
    answers: dict[str, httpx.Response] = {}
    reading = threading.Event()

    def read() -> None:
        body = {"model": BASE, "prompt": "Once", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": "Bearer sk-reader"}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events.append("chunk")
                    reading.set()

    def attack() -> None:
        events.append("bomb sent")
        answers["bomb"] = complete(server, "attacker", {"json": HOSTILE})
        events.append("bomb")

    reader = threading.Thread(target=read)
    reader.start()
    assert reading.wait(60)
    attacker = threading.Thread(target=attack)
    attacker.start()
    time.sleep(0.5)  # lets the bomb reach its compile worker first (an ordering aid: nothing is timed)
    answers["victim"] = complete(server, "victim", {"choice": CHOICES})
    events.append("victim")
    attacker.join(120)
    reader.join(120)

    victim, bomb = answers["victim"], answers["bomb"]
    assert victim.status_code == 200 and victim.json()["choices"][0]["text"] in CHOICES, victim.text[:300]
    assert bomb.status_code == 400, bomb.text[:300]
    error = bomb.json()["error"]
    assert error["param"] == "structured_outputs" and f"within {TIMEOUT_S:g} s" in error["message"], error
    assert events.index("victim") < events.index("bomb")  # the victim did not queue behind the bomb
    between = events[events.index("bomb sent"):events.index("victim")]
    assert between.count("chunk") >= 5, events  # the reader's stream flowed while the bomb compiled
