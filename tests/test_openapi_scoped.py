"""``/openapi.json`` under scoped API keys lists no adapter name (a tenant must not learn another's
adapters from the schema), before and after a runtime load; without keys it lists every served name,
and the schema is rebuilt after a load (the new name appears)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.server_harness import BASE, Server, tiny_server

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=64, max_num_seqs=2)
ADMIN, SCOPED = "sk-admin-0123456789", "sk-scoped-0123456789"
KEYS = f"""
[[keys]]
key = "{ADMIN}"
tenant = "ops"
adapters = ["*"]
admin = true

[[keys]]
key = "{SCOPED}"
tenant = "alpha"
adapters = ["r8_*"]
"""
LATE = "late-loaded-adapter"  # loaded at runtime; its folder is a copy of r2_qv


def schema_text(server: Server, key: str | None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{server.url}/openapi.json", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert BASE in response.text  # the base model is always named
    return response.text


def load_late(server: Server, key: str | None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=headers, timeout=60,
                        json={"lora_name": LATE, "lora_path": str(server.root / "r2_qv")})
    assert loaded.status_code == 200, loaded.text


def test_scoped_keys_schema_names_no_adapter(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                            tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all", "r4_attn"), ("r2_qv",), tmp_path / "root",
                     app_options={"api_keys": str(keys)}, **CONFIG) as srv:
        for key in (None, SCOPED, ADMIN):
            text = schema_text(srv, key)
            assert "r8_all" not in text and "r4_attn" not in text, key
        load_late(srv, ADMIN)
        for key in (None, SCOPED, ADMIN):
            text = schema_text(srv, key)
            assert LATE not in text and "r8_all" not in text, key


def test_unscoped_schema_names_adapters_and_is_rebuilt_after_a_load(
        tiny_llama: Path, tiny_llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all", "r4_attn"), ("r2_qv",), tmp_path / "root",
                     **CONFIG) as srv:
        text = schema_text(srv, None)
        assert "r8_all" in text and "r4_attn" in text and LATE not in text
        load_late(srv, None)
        assert LATE in schema_text(srv, None)
