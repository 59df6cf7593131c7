"""Adapters loaded from tensors (issue 31, part 1): ``LLM.load_adapter(name, tensors=..., config=...)`` serves
exactly what the same adapter loaded from its folder serves, and what HF transformers + PEFT compute; every
bad state dict is refused with the folder load's typed error, naming the key, and changes nothing; the
tensors survive the trip to an engine in its own process; ``PUT /v1/adapters/{name}`` loads, then promotes,
and refuses hostile bodies with a precise 4xx while the server keeps serving."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
from transformers import AutoTokenizer

from loraplex import LLM, SamplingParams
from loraplex.adapters.reading.safetensors_file import parse_safetensors_bytes, safetensors_bytes
from loraplex.engine import wire
from loraplex.errors import AdapterRankTooLarge, AdapterShapeMismatch, InvalidAdapter
from tests.reference import with_adapter
from tests.server_harness import MODES, Server, tiny_server, wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=2, max_lora_rank=16, kv_cache_blocks=128, max_num_seqs=8)
PROMPTS = [[5, 17, 99, 3, 250, 41], [7, 7, 1000, 12]]
MAX_TOKENS = 8
HEADER = "x-loraplex-adapter-version"
KEYS = """
[[keys]]
key = "sk-admin-0123456789"
tenant = "ops"
adapters = ["*"]
admin = true

[[keys]]
key = "sk-user-0123456789"
tenant = "user"
adapters = ["*"]
"""
ADMIN, USER = "sk-admin-0123456789", "sk-user-0123456789"


def state_dict(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A PEFT folder's tensors (read by the safetensors library) and its config."""
    tensors = safetensors.torch.load_file(folder / "adapter_model.safetensors")
    return tensors, json.loads((folder / "adapter_config.json").read_text())


def upload(tensors: dict[str, torch.Tensor], config: dict | str) -> bytes:
    """A PUT body as a client writes it: the safetensors library's file, the config in its metadata."""
    text = config if isinstance(config, str) else json.dumps(config)
    return safetensors.torch.save(tensors, metadata={"adapter_config": text})


def greedy(llm: LLM, adapter: str | None) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params, adapters=adapter, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_llama), **CONFIG)
    yield llm
    llm.engine.adapters.close()


def test_tensor_load_equals_folder_load_and_peft(llm: LLM, tiny_llama: Path,
                                                  tiny_llama_adapters: dict[str, Path]) -> None:
    folder, other = tiny_llama_adapters["r8_all"], tiny_llama_adapters["r4_attn"]
    tensors, config = state_dict(folder)
    before = {k: v.clone() for k, v in tensors.items()}
    from_tensors = llm.load_adapter("t", tensors=tensors, config=config)
    from_folder = llm.load_adapter("f", str(folder))
    assert from_tensors.content_hash == from_folder.content_hash and from_tensors.in_memory
    assert all(torch.equal(tensors[k], before[k]) for k in tensors), "the caller's tensors are not changed"
    reference = with_adapter(tiny_llama, folder, PROMPTS, MAX_TOKENS)
    assert greedy(llm, "t") == greedy(llm, "f") == reference
    assert reference != with_adapter(tiny_llama, None, PROMPTS, MAX_TOKENS), "the adapter must change the output"
    # a promotion from tensors; the folder-less version is never evicted from host memory (nothing to re-read)
    promoted = llm.load_adapter("t", tensors=state_dict(other)[0], config=state_dict(other)[1], new_version=True)
    for name in ("g", "h"):  # three folder versions over max_cpu_loras=2: the host tier evicts one of them
        llm.load_adapter(name, str(tiny_llama_adapters["r2_qv"]))
    host = llm.engine.adapters.host
    assert llm.stats().adapter_counters.host_evictions >= 1
    assert host.contains(from_tensors.version_id) and host.contains(promoted.version_id)
    assert greedy(llm, "t") == with_adapter(tiny_llama, other, PROMPTS, MAX_TOKENS)
    llm.engine.adapters.check_integrity()
    for name in ("t", "f", "g", "h"):
        llm.unload_adapter(name)
    assert len(host) == 0, "unloaded versions leave host memory, tensor-loaded ones too"


def test_tensor_loads_get_the_folder_loads_errors(llm: LLM, tiny_llama_adapters: dict[str, Path]) -> None:
    tensors, config = state_dict(tiny_llama_adapters["r8_all"])
    key = next(k for k in sorted(tensors) if "q_proj.lora_A" in k)
    b_key = key.replace("lora_A", "lora_B")
    cases = [
        ({**tensors, key: tensors[key][:, :-1]}, config, AdapterShapeMismatch, key.removeprefix("base_model.model.")
         .removesuffix(".weight")),
        ({**tensors, b_key: torch.full_like(tensors[b_key], float("nan"))}, config, InvalidAdapter, "NaN"),
        ({**tensors, "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": tensors[key]}, config,
         InvalidAdapter, "rotary"),
        (tensors, {**config, "r": 32}, AdapterRankTooLarge, "max_lora_rank=16"),
        (tensors, "{not json", InvalidAdapter, "adapter_config"),
    ]
    for bad_tensors, bad_config, error, words in cases:
        with pytest.raises(error, match=words.replace(".", r"\.") if error is AdapterShapeMismatch else words):
            llm.load_adapter("bad", tensors=bad_tensors, config=bad_config)
        assert llm.list_adapters() == []
    for kwargs in ({"path": "x", "tensors": tensors, "config": config}, {}, {"tensors": tensors},
                   {"path": "x", "config": config}):
        with pytest.raises(ValueError, match="exactly one of path"):
            llm.engine.load_adapter("bad", **kwargs)
    llm.engine.adapters.check_integrity()


def test_a_spooled_blob_is_a_private_file_read_once() -> None:
    tensors = {"a": torch.randn(4, 3, generator=torch.Generator().manual_seed(1))}
    blob = wire.TensorBlob.of(tensors).spooled()
    assert blob.path is not None and blob.data == b"" and (Path(blob.path).stat().st_mode & 0o777) == 0o600
    assert torch.equal(blob.tensors()["a"], tensors["a"]) and not Path(blob.path).exists()
    unread = wire.packed_kwargs({"tensors": tensors, "config": "{}"})
    assert Path(unread["tensors"].path).exists() and unread["config"] == "{}"
    wire.remove_spooled(unread)
    assert not Path(unread["tensors"].path).exists()


def test_safetensors_bytes_round_trip() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = {"b": torch.randn(3, 5, generator=generator), "a": torch.randn(7, generator=generator).bfloat16(),
               "empty": torch.zeros(0, 4), "i": torch.arange(6, dtype=torch.int64).view(2, 3)}
    flat = torch.randn(20, generator=generator)
    tensors |= {"view1": flat[:10].view(2, 5), "view2": flat[10:]}  # views of one storage
    data = safetensors_bytes(tensors, {"k": "v"})
    loaded = safetensors.torch.load(data)  # the library reads what we write
    parsed, metadata = parse_safetensors_bytes(data)
    assert metadata == {"k": "v"} and set(loaded) == set(parsed) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == parsed[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor) and torch.equal(parsed[name], tensor)


@pytest.fixture(autouse=True)
def spool_every_blob(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every uploaded body crosses to the engine process as a spooled file (``TensorBlob.spooled``; the tiny
    adapters are under the 1 MiB at which real ones start to), and none is left behind."""
    monkeypatch.setattr(wire, "SPOOL_BYTES", 0)
    before = set(Path(wire._spool_folder()).glob("loraplex-tensors-*"))
    yield
    assert set(Path(wire._spool_folder()).glob("loraplex-tensors-*")) == before


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    options = {"api_keys": str(keys), "max_request_bytes": 1 << 20}
    with tiny_server(tiny_llama, tiny_llama_adapters, (), (), tmp_path_factory.mktemp("root"),
                     mode=request.param, app_options=options, **CONFIG) as srv:
        yield srv


def put(server: Server, name: str, body: bytes, key: str = ADMIN,
        media: str = "application/octet-stream") -> httpx.Response:
    return httpx.put(f"{server.url}/v1/adapters/{name}", content=body, timeout=60,
                     headers={"Authorization": f"Bearer {key}", "Content-Type": media})


def complete(server: Server, model: str) -> tuple[str, list[str]]:
    """(version header, texts) of greedy completions of ``PROMPTS``."""
    body = {"model": model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {USER}"})
    assert r.status_code == 200, r.text
    return r.headers[HEADER], [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def test_put_loads_then_promotes(server: Server, tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    decode = AutoTokenizer.from_pretrained(tiny_llama).decode
    first, second = tiny_llama_adapters["r8_all"], tiny_llama_adapters["r2_qv"]
    r = put(server, "live", upload(*state_dict(first)))
    assert r.status_code == 200, r.text
    entry = r.json()
    assert entry["name"] == "live" and [v["id"] for v in entry["versions"]] == [entry["current"]]
    listing = httpx.get(f"{server.url}/v1/adapters", headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"]
    assert listing == [entry]
    header, texts = complete(server, "live")
    assert header == entry["current"]
    assert texts == [decode(t, skip_special_tokens=True) for t in with_adapter(tiny_llama, first, PROMPTS, MAX_TOKENS)]
    r = put(server, "live", upload(*state_dict(second)))
    assert r.status_code == 200, r.text
    promoted = r.json()
    assert promoted["current"] != entry["current"] and len(promoted["versions"]) == 2
    header, texts = complete(server, "live")
    assert header == promoted["current"]
    assert texts == [decode(t, skip_special_tokens=True) for t in with_adapter(tiny_llama, second, PROMPTS, MAX_TOKENS)]
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "live"},
                   headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    wait_until_idle(server.engine_client)
    server.check_integrity()


def hostile_bodies(good: bytes, tensors: dict[str, torch.Tensor], config: dict) -> list[tuple[str, bytes, str]]:
    """(case, body, words the 400's message must hold)."""
    length = int.from_bytes(good[:8], "little")
    key = next(k for k in sorted(tensors) if "v_proj.lora_B" in k)
    return [
        ("truncated", good[:-7], "truncated"),
        ("header past the body", len(good).to_bytes(8, "little") + good[8:], "runs past the end"),
        ("2^63 header length", (1 << 63).to_bytes(8, "little") + good[8:], f"header length {1 << 63}"),
        ("shorter than a length", good[:5], "shorter than the 8-byte header length"),
        ("shape mismatch", upload({**tensors, key: torch.zeros(tensors[key].shape[0], 3)}, config),
         key.removeprefix("base_model.model.").removesuffix(".weight")),
        ("rank over the limit", upload(tensors, {**config, "r": 64}), "max_lora_rank=16"),
        ("NaN weights", upload({**tensors, key: torch.full_like(tensors[key], float("nan"))}, config), "NaN"),
        ("unknown module", upload({**tensors, "base_model.model.model.layers.0.mlp.extra.lora_A.weight":
                                   tensors[key].clone()}, config), "mlp.extra"),
        ("a pickle", pickle.dumps(tensors), "header length"),
        ("a torch.save file", torch_save_bytes(tensors), "header length"),
        ("no adapter_config", safetensors.torch.save(tensors), "adapter_config"),
        ("config not JSON", upload(tensors, "{'r': 8"), "adapter_config"),
        ("header not JSON", good[:8] + b"[" * length + good[8 + length:], "header"),
    ]


def torch_save_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def test_hostile_puts_are_precise_4xx_and_harmless(server: Server, tiny_llama: Path,
                                                   tiny_llama_adapters: dict[str, Path]) -> None:
    decode = AutoTokenizer.from_pretrained(tiny_llama).decode
    tensors, config = state_dict(tiny_llama_adapters["r4_attn"])
    good = upload(tensors, config)
    base = complete(server, "tiny")
    assert base[1] == [decode(t, skip_special_tokens=True) for t in with_adapter(tiny_llama, None, PROMPTS, MAX_TOKENS)]
    for case, body, words in hostile_bodies(good, tensors, config):
        r = put(server, "hostile", body)
        assert r.status_code == 400, (case, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert words in error["message"], (case, error["message"])
    refusals = [(put(server, "hostile", good, key=USER), 403, "not an admin key"),
                (put(server, "hostile", good, media="application/json"), 415, "application/octet-stream"),
                (put(server, "hostile", good + b"\0" * (1 << 20)), 413, "larger than"),
                (put(server, "tiny", good), 400, "base model"),
                (put(server, "bad%20name", good), 400, "bad name")]
    for r, status, words in refusals:
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    names = httpx.get(f"{server.url}/v1/adapters", headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"]
    assert names == [] and complete(server, "tiny") == base  # nothing loaded, the server unharmed
    wait_until_idle(server.engine_client)
    server.check_integrity()


def test_put_is_off_without_runtime_adapters(llm: LLM, tiny_llama_adapters: dict[str, Path]) -> None:
    from fastapi.testclient import TestClient

    from loraplex.server.app import create_app

    with TestClient(create_app(llm, served_model_name="tiny")) as client:
        r = client.put("/v1/adapters/x", content=upload(*state_dict(tiny_llama_adapters["r2_qv"])),
                       headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 403 and "--allow-runtime-adapters" in r.json()["error"]["message"], r.text
    assert llm.list_adapters() == []
