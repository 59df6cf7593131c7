"""A request's adapter version is decided once, first, and everything derived from the adapter follows that
version (design.md invariant 6; issue 29): one name holds two versions whose tokenizers differ (one ships an
added token with its resized embed_tokens/lm_head rows, one is a plain LoRA on the base tokenizer), and under
a promotion, a 50/50 split and a rollback every answer's prompt was tokenized, its tokens computed and its
text decoded by the version its ``x-loraplex-adapter-version`` header names, as HF transformers + PEFT
compute that version alone (token ids) and its own tokenizer decodes them (text). Over real HTTP, with the
engine in this process and in its own process; then a Hypothesis state machine interleaving loads,
promotions, rollbacks and splits with requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from transformers import AutoTokenizer

from tests.format_fixtures import ADDED_TOKENS, peft_model, write_added_tokens_adapter
from tests.reference import hf_greedy
from tests.server_harness import MODES, Server, tiny_server, wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=4, kv_cache_blocks=128, max_num_seqs=4)
TEXT = f"Call {ADDED_TOKENS[0]} then"
MAX_TOKENS = 6
HEADER = "x-loraplex-adapter-version"


@dataclass(frozen=True)
class Expected:
    """One adapter folder alone, computed by HF + PEFT and decoded by its own tokenizer."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str


@pytest.fixture(scope="module")
def folders(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("route-once")
    base_ids = AutoTokenizer.from_pretrained(tiny_llama).encode(TEXT, add_special_tokens=False)
    return {"added": write_added_tokens_adapter(tiny_llama, root / "added", "saved", base_ids, seed=3),
            "plain": tiny_llama_adapters["r4_attn"], "plain2": tiny_llama_adapters["r2_qv"]}


@pytest.fixture(scope="module")
def expected(tiny_llama: Path, folders: dict[str, Path]) -> dict[str, Expected]:
    base = AutoTokenizer.from_pretrained(tiny_llama)
    out = {}
    for name, folder in folders.items():
        own = name == "added"
        tokenizer = AutoTokenizer.from_pretrained(folder) if own else base
        ids = tokenizer.encode(TEXT, add_special_tokens=False)
        model = peft_model(tiny_llama, folder, len(tokenizer) if own else None)
        tokens = hf_greedy(model, ids, MAX_TOKENS)[0]
        out[name] = Expected(ids, tokens, tokenizer.decode(tokens, skip_special_tokens=True))
    assert out["added"].prompt_ids != out["plain"].prompt_ids, "the two tokenizers must encode TEXT differently"
    assert ADDED_TOKENS[0] in out["added"].text, "the added-token version emits (and decodes) its own token"
    return out


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, folders: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(tiny_llama, folders, (), tuple(folders), tmp_path_factory.mktemp("root"),
                     mode=request.param, **CONFIG) as srv:
        yield srv


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def load(server: Server, name: str, folder: str, new_version: bool) -> int:
    """Load ``folder`` (a name in the adapter root) as ``name``; its version id."""
    body = {"lora_name": name, "lora_path": str(server.root / folder), **({"version": "new"} if new_version else {})}
    r = post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 200, r.text
    listing = httpx.get(f"{server.url}/v1/adapters").json()["data"]
    return int(next(e for e in listing if e["name"] == name)["current"][1:])


def hashes(server: Server, name: str) -> dict[str, str]:
    entry = next(e for e in httpx.get(f"{server.url}/v1/adapters").json()["data"] if e["name"] == name)
    return {v["id"]: v["content_hash"] for v in entry["versions"]}


def answer(server: Server, name: str, stream: bool = False) -> tuple[str, str, int, str]:
    """(version header, text, usage.prompt_tokens, system_fingerprint) of one greedy completion."""
    body = {"model": name, "prompt": TEXT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if not stream:
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        full = r.json()
        return r.headers[HEADER], full["choices"][0]["text"], full["usage"]["prompt_tokens"], \
            full["system_fingerprint"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        header = r.headers[HEADER]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return header, text, chunks[-1]["usage"]["prompt_tokens"], chunks[0]["system_fingerprint"]


def check(server: Server, name: str, by_version: dict[str, str], expected: dict[str, Expected],
          stream: bool = False) -> str:
    """One answer is exactly its header's version's; returns that header."""
    header, text, prompt_tokens, fingerprint = answer(server, name, stream)
    want = expected[by_version[header]]
    assert (prompt_tokens, text) == (len(want.prompt_ids), want.text), (header, by_version)
    assert fingerprint == hashes(server, name)[header]
    return header


def test_every_answer_follows_its_routed_version(server: Server, expected: dict[str, Expected]) -> None:
    v_added = load(server, "x", "added", new_version=False)
    v_plain = load(server, "x", "plain", new_version=True)  # a promotion
    by_version = {f"v{v_added}": "added", f"v{v_plain}": "plain"}
    assert check(server, "x", by_version, expected) == f"v{v_plain}"
    r = post(server, "/v1/adapters/x/split", {f"v{v_added}": 0.5, f"v{v_plain}": 0.5})
    assert r.status_code == 200, r.text
    seen = [check(server, "x", by_version, expected, stream=i % 2 == 1) for i in range(8)]
    assert seen.count(f"v{v_added}") == seen.count(f"v{v_plain}") == 4  # smooth round-robin: exact halves
    r = post(server, "/v1/adapters/x/rollback", {})
    assert r.status_code == 200, r.text
    assert {check(server, "x", by_version, expected, stream=s) for s in (False, True)} == {f"v{v_added}"}
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 200, r.text
    wait_until_idle(server.engine_client)


def machine(server: Server, expected: dict[str, Expected]) -> type[RuleBasedStateMachine]:
    class Versions(RuleBasedStateMachine):
        """A name's versions move under requests; each answer must be exactly one version's, the routed one."""

        count = 0

        def __init__(self) -> None:
            super().__init__()
            Versions.count += 1
            self.name = f"h{Versions.count}"
            self.folder_of: dict[str, str] = {}  # "v<id>" -> folder name, for the versions this name holds
            self.held: list[str] = []  # oldest first, as the engine's table

        @rule(folder=st.sampled_from(["added", "plain", "plain2"]))
        def load(self, folder: str) -> None:
            version = f"v{load(server, self.name, folder, new_version=bool(self.held))}"
            self.folder_of[version] = folder
            self.held = [v for v in self.held if v in hashes(server, self.name)] + [version]

        @precondition(lambda self: len(self.held) > 1)
        @rule()
        def rollback(self) -> None:
            assert post(server, f"/v1/adapters/{self.name}/rollback", {}).status_code in (200, 409)

        @precondition(lambda self: len(self.held) > 1)
        @rule(data=st.data())
        def split(self, data: st.DataObject) -> None:
            chosen = data.draw(st.lists(st.sampled_from(self.held), min_size=1, unique=True))
            weights = {v: data.draw(st.integers(1, 3)) for v in chosen}
            assert post(server, f"/v1/adapters/{self.name}/split", weights).status_code == 200

        @precondition(lambda self: bool(self.held))
        @rule(stream=st.booleans())
        def request(self, stream: bool) -> None:
            check(server, self.name, self.folder_of, expected, stream)

        def teardown(self) -> None:
            if self.held:
                post(server, "/v1/unload_lora_adapter", {"lora_name": self.name})

    return Versions


def test_interleaved_version_changes_never_mix_versions(server: Server, expected: dict[str, Expected]) -> None:
    state_machine = machine(server, expected)
    state_machine.TestCase.settings = settings(max_examples=6, stateful_step_count=8, deadline=None,
                                               suppress_health_check=list(HealthCheck))
    state_machine.TestCase().runTest()
    wait_until_idle(server.engine_client)
