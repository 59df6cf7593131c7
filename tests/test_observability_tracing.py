"""``--otlp-traces-endpoint``: one span tree per request reaches a real OTLP/HTTP receiver (a small HTTP server
decoding the protobuf with ``opentelemetry-proto``): a root per request, its children in order with monotone
timestamps, the GenAI and loraplex attributes, and a client's ``traceparent`` honoured, in detail with the
engine in a thread (``tiny_server``); end to end through ``loraplex serve`` (the engine in its own process, its
instants carried across in the outputs)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.server_harness import BASE, Server, tiny_server

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=8)
CHILDREN = ["preparation", "queue", "prefill", "decode"]
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class Receiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                message = ExportTraceServiceRequest.FromString(body)
                receiver.spans += [s for rs in message.resource_spans for ss in rs.scope_spans for s in ss.spans]
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def roots(self, count: int) -> list:
        deadline = time.monotonic() + 30
        while len([s for s in self.spans if s.kind == s.SPAN_KIND_SERVER]) < count:
            assert time.monotonic() < deadline, "the spans never arrived"
            time.sleep(0.05)
        return [s for s in self.spans if s.kind == s.SPAN_KIND_SERVER]


@pytest.fixture(scope="module")
def traced( tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Receiver]]:
    receiver = Receiver()
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all", "r4_attn"), (), tmp_path_factory.mktemp("root"),
                     app_options={"otlp_traces_endpoint": receiver.url}, **CONFIG) as srv:
        yield srv, receiver
    receiver.server.shutdown()


def attrs(span) -> dict:  # noqa: ANN001 - a protobuf Span
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = (list(x.string_value for x in v.array_value.values) if v.HasField("array_value")
                       else v.int_value if v.HasField("int_value") else v.string_value)
    return out


def test_one_span_tree_per_request(traced: tuple[Server, Receiver]) -> None:
    server, receiver = traced
    runs = [("r8_all", True, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}), ("r4_attn", False, {}),
            (BASE, True, {}), (BASE, False, {})]
    for model, stream, headers in runs:
        with httpx.stream("POST", f"{server.url}/v1/completions", headers=headers, timeout=60, json={
                "model": model, "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True,
                "stream": stream}) as response:
            assert response.status_code == 200
            response.read()
    roots = receiver.roots(len(runs))
    assert len(roots) == len(runs)
    by_adapter = {}
    for root in roots:
        a = attrs(root)
        by_adapter.setdefault(a["loraplex.adapter"], []).append((root, a))
        assert a["gen_ai.request.model"] in ("r8_all", "r4_attn", BASE)
        assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.usage.input_tokens"] > 0
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["loraplex.tenant"] == "none" and a["loraplex.prefix_cached_tokens"] >= 0
        version = a["loraplex.adapter_version"]
        is_base = a["loraplex.adapter"] == "base"
        assert version == "base" if is_base else version.startswith("v") and version[1:].isdigit()
        children = sorted((s for s in receiver.spans if s.parent_span_id == root.span_id),
                          key=lambda s: s.start_time_unix_nano)
        assert [c.name for c in children] == CHILDREN
        instants = [root.start_time_unix_nano]
        for child in children:
            assert child.trace_id == root.trace_id
            instants += [child.start_time_unix_nano, child.end_time_unix_nano]
        instants.append(root.end_time_unix_nano)
        assert instants == sorted(instants), instants
        events = [e.name for e in root.events]
        assert events == ["first_token", "finish"]
        first = root.events[0].time_unix_nano
        assert children[2].end_time_unix_nano == first  # the prefill ends at the engine's first token
    assert sorted(by_adapter) == ["base", "r4_attn", "r8_all"] and len(by_adapter["base"]) == 2
    (joined, _), = by_adapter["r8_all"]
    assert joined.trace_id.hex() == TRACE_ID and joined.parent_span_id.hex() == PARENT_ID
    assert all(root.trace_id.hex() != TRACE_ID for root in roots if root is not joined)
    assert all(not root.parent_span_id for root in roots if root is not joined)


def test_tracing_off_imports_no_opentelemetry() -> None:
    """Off by default: the server and the CLI import neither the OpenTelemetry SDK nor its exporter (they load
    with the flag; the API package alone comes with FastAPI)."""
    code = ("import sys, loraplex.cli, loraplex.server.app, loraplex.server.generation; "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def test_loraplex_serve_flag_exports_traces(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                            tmp_path: Path) -> None:
    """``loraplex serve --otlp-traces-endpoint URL`` end to end: a request with a ``traceparent`` reaches the
    receiver as a root span joining that trace, with its adapter; SIGTERM flushes and exits 0."""
    from tests.test_cli import free_port, wait_healthy

    receiver, port = Receiver(), free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(tiny_llama), "--adapter",
           f"chat={tiny_llama_adapters['r4_attn']}", "--port", str(port), "--kv-cache-blocks", "64",
           "--otlp-traces-endpoint", receiver.url]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log)
        r = httpx.post(f"{url}/v1/completions", timeout=60, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                       json={"model": "chat", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200
        (root,) = receiver.roots(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    receiver.server.shutdown()
    assert code == 0, log.read_text()
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == PARENT_ID
    assert attrs(root)["loraplex.adapter"] == "chat" and attrs(root)["gen_ai.usage.output_tokens"] == 3
    children = sorted((s for s in receiver.spans if s.parent_span_id == root.span_id),
                      key=lambda s: s.start_time_unix_nano)
    assert [s.name for s in children] == CHILDREN
