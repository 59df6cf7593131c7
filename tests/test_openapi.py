"""``/openapi.json`` tells the truth: a bounded ``schemathesis run --checks all`` against a running server
(tiny model, adapters, runtime loading and an API key on) finds no undocumented status, no response that
breaks its schema and no schema/validation mismatch; the schema's statuses and ranges are the server's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.client.inproc import AsyncEngine
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.sampling.params import MAX_LOGPROBS, MAX_N, TEMPERATURE_MAX
from loraplex.server.app import create_app
from tests.classifier_fixtures import write_classifier_adapter
from tests.fixtures import write_tiny_model
from tests.server_harness import BASE, running_server

MAX_LEN = 40  # a short context keeps every generated request small (a minimal chat prompt is 30 tokens)
KEY = "test-key"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("short"), "llama", max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def url(model: Path, tmp_path_factory: pytest.TempPathFactory, tiny_llama_adapters: dict[str, Path]) -> Iterator[str]:
    engine = Engine(EngineConfig(model=str(model), max_num_seqs=32, kv_cache_blocks=96, max_lora_rank=16))
    engine.load_adapter("r4_attn", tiny_llama_adapters["r4_attn"])
    engine.load_adapter("relevance", write_classifier_adapter(model, tmp_path_factory.mktemp("cls") / "relevance", 1))
    root = tmp_path_factory.mktemp("root")
    app = create_app(AsyncEngine(engine), served_model_name=BASE, allow_runtime_adapters=True, adapter_roots=[root],
                     api_key=KEY)
    with running_server(app) as base:
        yield base


def test_schema_documents_statuses_and_ranges(url: str) -> None:
    schema = httpx.get(f"{url}/openapi.json").json()
    statuses = {path: {m: set(op["responses"]) for m, op in ops.items()} for path, ops in schema["paths"].items()}
    assert statuses["/v1/completions"]["post"] == {"200", "400", "401", "404", "409", "413", "429", "503", "504"}
    for path in ("/v1/completions", "/v1/chat/completions"):  # a full queue's 503 says when to retry
        assert "Retry-After" in schema["paths"][path]["post"]["responses"]["503"]["headers"]
    assert statuses["/v1/load_lora_adapter"]["post"] == {"200", "400", "401", "403", "404", "409", "413", "503",
                                                         "507"}
    assert statuses["/tokenize"]["post"] == {"200", "400", "404", "413", "503"}  # outside /v1: no key, as vLLM
    assert all("503" in codes for ops in statuses.values() for codes in ops.values())  # a draining server's
    assert not any("422" in codes for ops in statuses.values() for codes in ops.values())
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert (props["temperature"]["minimum"], props["temperature"]["maximum"]) == (0, TEMPERATURE_MAX)
    assert (props["n"]["maximum"], props["logprobs"]["maximum"]) == (MAX_N, MAX_LOGPROBS)
    assert props["prompt"]["items"]["maximum"] == 49151
    assert "best_of" in props and "tools" in schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]


def test_schemathesis_finds_no_mismatch(url: str, model: Path, tmp_path: Path) -> None:
    """Bounded: a fixed seed, at most 8 fuzzed examples per operation besides the coverage phase's boundary
    values (about 1,700 requests)."""
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks", "LORAPLEX_TEST_MAX_MODEL_LEN": str(MAX_LEN),
           "LORAPLEX_TEST_MODEL": str(model), "PYTHONPATH": str(Path(__file__).parent.parent)}
    cli = Path(sys.executable).parent / "schemathesis"
    result = subprocess.run(
        [str(cli), "run", f"{url}/openapi.json", "--checks", "all", "--max-examples", "8", "--seed", "1",
         "--workers", "1", "--request-timeout", "30", "--max-response-time", "30", "-H", f"Authorization: Bearer {KEY}",
         "--output-sanitize", "false", "--generation-database", "none"],
        capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)  # its cache stays out of the repo
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failure" not in result.stdout.split("SUMMARY")[-1]
