"""Pinned adapters (issue 31, part 2): a pinned name's current version keeps its device slot and host copy
under eviction pressure that evicts it without the pin, follows the name through promotions and rollbacks,
waits for a slot when every slot is held by requests, and is bounded to ``max_loras - 1`` names (409).
Over HTTP: pin/unpin are admin calls, and pins show in ``GET /v1/adapters``, ``/v1/slots`` and metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex import LLM, SamplingParams
from loraplex.cli import build_parser
from loraplex.config import ModelConfig
from loraplex.errors import AdapterPinLimit, UnknownAdapter
from tests.reference import with_adapter
from tests.server_harness import Server, tiny_server, wait_until_idle
from tests.test_manager import make_manager

ADMIN, USER = "sk-admin-0123456789", "sk-user-0123456789"
KEYS = f"""
[[keys]]
key = "{ADMIN}"
tenant = "ops"
adapters = ["*"]
admin = true

[[keys]]
key = "{USER}"
tenant = "user"
adapters = ["*"]
"""


def rotate(manager, version_ids: list[int]) -> None:  # noqa: ANN001 - an AdapterManager
    """Requests of each version in turn, one at a time: each acquire may evict the least recently used slot."""
    for version_id in version_ids:
        if not manager.can_acquire(version_id):  # not in host memory: a background re-read started
            manager.wait_for_read(version_id, timeout=30)
        manager.acquire(version_id)
        manager.release(version_id)
        manager.check_integrity()


@pytest.mark.parametrize("pinned", [False, True])
def test_a_pin_survives_the_pressure_that_evicts_it_without_one(pinned: bool, tiny_llama: Path,
                                                                 tiny_llama_adapters: dict[str, Path]) -> None:
    manager = make_manager(ModelConfig.from_hf(tiny_llama), max_loras=2, max_cpu_loras=2)
    a, b, c, d = (manager.load(n, tiny_llama_adapters[n]).version_id for n in ("r8_all", "r4_attn", "r2_qv",
                                                                              "r16_mlp"))
    rotate(manager, [a])  # a is in a slot, and the least recently used one from here on
    slot = manager.slot_table.slot_of[a]
    if pinned:
        manager.pin("r8_all")
    rotate(manager, [b, c, d, b, c])  # four other adapters through two slots, two host places
    assert (a in manager.slot_table.slot_of) is pinned
    assert manager.host.contains(a) is pinned  # a left host memory too, without its pin
    if pinned:
        assert manager.slot_table.slot_of[a] == slot and manager.counters()["adapters_pinned"] == 1
        assert manager.counters()["slots_pinned"] == 0  # the pin is not a request's
        manager.unpin("r8_all")
        rotate(manager, [b, c])
        assert a not in manager.slot_table.slot_of
    manager.close()


def test_a_pin_on_weights_not_in_host_memory_reads_and_keeps_them(tiny_llama: Path,
                                                                  tiny_llama_adapters: dict[str, Path]) -> None:
    manager = make_manager(ModelConfig.from_hf(tiny_llama), max_loras=2, max_cpu_loras=2)
    a, b, c, d = (manager.load(n, tiny_llama_adapters[n]).version_id for n in ("r8_all", "r4_attn", "r2_qv",
                                                                              "r16_mlp"))
    assert not manager.host.contains(a)  # pushed out of host memory by the later loads
    manager.pin("r8_all")  # starts the background re-read; the pin is taken when it lands
    manager.wait_for_read(a, timeout=30)
    assert a in manager.slot_table.slot_of and manager.host.contains(a)
    rotate(manager, [b, c, d, b, c, d])
    assert a in manager.slot_table.slot_of and manager.host.contains(a)
    manager.close()


def test_pins_follow_versions_wait_for_a_slot_and_are_bounded(tiny_llama: Path,
                                                             tiny_llama_adapters: dict[str, Path]) -> None:
    manager = make_manager(ModelConfig.from_hf(tiny_llama), max_loras=3, max_cpu_loras=4)
    a1 = manager.load("a", tiny_llama_adapters["r8_all"]).version_id
    b, c, d = (manager.load(n, tiny_llama_adapters[n]).version_id for n in ("r4_attn", "r2_qv", "r16_mlp"))
    for version_id in (b, c, d):  # every slot held by a running request
        manager.acquire(version_id)
    manager.pin("a")  # no slot free: the pin waits
    assert a1 not in manager.slot_table.slot_of and manager.host.contains(a1)
    manager.release(c)  # the first slot freed goes to the pin
    assert a1 in manager.slot_table.slot_of and c not in manager.slot_table.slot_of
    manager.check_integrity()
    a2 = manager.load("a", tiny_llama_adapters["r2_qv"], new_version=True).version_id  # the pin moves to a2
    manager.release(b)
    manager.release(d)
    assert a2 in manager.slot_table.slot_of and manager.snapshot()["slots"][manager.slot_table.slot_of[a2]]["pinned"]
    assert manager.slot_table.pins(a1) == 0  # a1's pin went back (a1 stays held: the name may roll back to it)
    manager.with_versions(lambda versions: versions.rollback("a"))
    assert manager.slot_table.pins(a1) == 1 and manager.slot_table.pins(a2) == 0
    manager.pin("r4_attn")  # two pinned names of max_loras - 1 = 2
    with pytest.raises(AdapterPinLimit, match="max_loras - 1 = 2"):
        manager.pin("r2_qv")
    manager.pin("a")  # pinning a pinned name again changes nothing
    with pytest.raises(UnknownAdapter):
        manager.pin("nope")
    assert [e["pinned"] for e in manager.with_versions(lambda v: v.listing())] == [True, True, False, False]
    manager.unload("a")  # its pin goes with it
    assert manager.counters()["adapters_pinned"] == 1 and manager.slot_table.pins(a1) == 0
    manager.pin("r16_mlp")
    manager.check_integrity()
    manager.close()


def test_llm_pin_keeps_answers_exact(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_llama), max_loras=2, max_cpu_loras=2, kv_cache_blocks=128)
    names = ["r8_all", "r4_attn", "r2_qv"]
    for name in names:
        llm.load_adapter(name, str(tiny_llama_adapters[name]))
    llm.pin_adapter("r8_all")
    prompts = [[5, 17, 99, 3], [7, 7, 1000, 12], [40, 41, 42]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, adapters=names, use_tqdm=False)
    for out, name, prompt in zip(outs, names, prompts, strict=True):
        assert out.token_ids == with_adapter(tiny_llama, tiny_llama_adapters[name], [prompt], 6)[0]
    assert llm.stats().adapters_pinned == 1 and llm.engine.adapters.resident(llm.engine.adapters.resolve("r8_all"))
    llm.unpin_adapter("r8_all")
    assert llm.stats().adapters_pinned == 0
    llm.engine.adapters.close()


def test_pin_adapter_flag_repeats() -> None:
    assert build_parser().parse_args(["serve", "--pin-adapter", "a", "--pin-adapter", "b"]).pin_adapter == ["a", "b"]
    assert build_parser().parse_args(["serve"]).pin_adapter == []


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all", "r4_attn"), (), tmp_path_factory.mktemp("root"),
                     app_options={"api_keys": str(keys)}, max_loras=2, max_cpu_loras=2,
                     kv_cache_blocks=64) as srv:
        yield srv


def call(server: Server, method: str, path: str, key: str = ADMIN) -> httpx.Response:
    return httpx.request(method, f"{server.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_pin_over_http(server: Server) -> None:
    r = call(server, "POST", "/v1/adapters/r8_all/pin", USER)
    assert r.status_code == 403 and "not an admin key" in r.json()["error"]["message"]
    r = call(server, "POST", "/v1/adapters/r8_all/pin")
    assert r.status_code == 200 and r.json()["name"] == "r8_all" and r.json()["pinned"] is True, r.text
    r = call(server, "POST", "/v1/adapters/r4_attn/pin")  # max_loras - 1 = 1
    assert r.status_code == 409 and r.json()["error"]["type"] == "conflict_error", r.text
    assert call(server, "POST", "/v1/adapters/nope/pin").status_code == 404
    listing = call(server, "GET", "/v1/adapters").json()["data"]
    assert {e["name"]: e["pinned"] for e in listing} == {"r8_all": True, "r4_attn": False}
    slots = call(server, "GET", "/v1/slots").json()
    assert [(s["adapter"], s["pinned"]) for s in slots["slots"] if s["adapter"]] == [("r8_all", True)]
    assert "loraplex_adapters_pinned 1.0" in call(server, "GET", "/metrics").text  # an admin key reads /metrics
    wait_until_idle(server.engine_client)  # a pin is not a request's: the engine is idle with it
    r = call(server, "POST", "/v1/adapters/r8_all/unpin")
    assert r.status_code == 200 and r.json()["pinned"] is False, r.text
    assert "loraplex_adapters_pinned 0.0" in call(server, "GET", "/metrics").text
    server.check_integrity()
