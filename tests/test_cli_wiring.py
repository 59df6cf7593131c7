"""Every ``loraplex serve`` flag reaches what it configures.

One row per flag: the argv that sets it, where its value lands (the ``EngineConfig`` the engine is
started with, a ``create_app`` argument, the engine process's arguments, the uvicorn config, the
drain timeout, the preparation workers, the pins) and the value expected there. ``serve()`` runs for
real with its collaborators replaced by recorders, so nothing is started. Each row also runs without
its flag and must observe a different value (a flag that is parsed but dropped fails), and the
completeness check fails for a serve option that has no row.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import signal
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from loraplex import cli
from loraplex.cli import build_parser
from loraplex.client.base import EngineHealth
from loraplex.client.restart import RestartPolicy
from loraplex.config import EngineConfig, SpeculativeConfig


@dataclasses.dataclass
class Seen:
    """What ``serve()`` handed to each collaborator."""

    config: EngineConfig | None = None
    engine: dict = dataclasses.field(default_factory=dict)  # in_process, adapters, cpus, log_level
    app: dict = dataclasses.field(default_factory=dict)  # create_app's keyword arguments
    uvicorn: object = None
    shutdown_timeout: float | None = None
    prepare_workers: int | None = None
    pins: list[str] = dataclasses.field(default_factory=list)


class FakeClient:
    def __init__(self, seen: Seen) -> None:
        self.seen = seen
        self.info = SimpleNamespace(model_name="m", model_path="p", dtype="float32", device="cpu", pid=1)

    async def pin_adapter(self, name: str) -> None:
        self.seen.pins.append(name)

    async def stats(self) -> SimpleNamespace:
        return SimpleNamespace(kv_blocks_total=1)

    async def list_adapters(self) -> list:
        return []

    def start(self) -> None:
        pass

    def health(self) -> EngineHealth:
        return EngineHealth("ready")

    def shutdown(self) -> None:
        pass


def run_serve(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Seen:
    """``loraplex serve ARGV`` up to the point it would serve, recording what each part got."""
    import loraplex.client.inproc as inproc
    import loraplex.client.process as process
    import loraplex.server.app as app_module
    import loraplex.server.draining as draining
    import loraplex.server.prepare.preparer as preparer_module

    seen = Seen()

    def engine_process(config: EngineConfig, adapters: list, *, cpus: list[int] | None = None,
                       log_level: str | None = None, restart: RestartPolicy | None = None,
                       on_dead: object = None) -> FakeClient:
        seen.config = config
        seen.engine = {"in_process": False, "adapters": list(adapters), "cpus": cpus, "log_level": log_level,
                       "restart": restart}
        return FakeClient(seen)

    def in_process(config: EngineConfig, adapters: list) -> FakeClient:
        seen.config = config
        seen.engine = {"in_process": True, "adapters": list(adapters), "cpus": None, "log_level": None}
        return FakeClient(seen)

    class Preparer:
        def __init__(self, processes: int) -> None:
            seen.prepare_workers = processes

        def start(self) -> None:
            pass

        def shutdown(self) -> None:
            pass

    def create_app(client: FakeClient, **kwargs: object) -> SimpleNamespace:
        seen.app = kwargs
        return SimpleNamespace(state=SimpleNamespace(lifecycle=None))

    class Server:
        def __init__(self, config: object, lifecycle: object, shutdown_timeout: float) -> None:
            seen.uvicorn, seen.shutdown_timeout = config, shutdown_timeout

        def run(self) -> None:
            pass

    monkeypatch.setattr(process, "EngineProcess", engine_process)
    monkeypatch.setattr(inproc.AsyncEngine, "from_config", staticmethod(in_process))
    monkeypatch.setattr(preparer_module, "RequestPreparer", Preparer)
    monkeypatch.setattr(app_module, "create_app", create_app)
    monkeypatch.setattr(draining, "DrainingServer", Server)
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    monkeypatch.setattr(gc, "freeze", lambda: None)
    parser = build_parser()
    args = parser.parse_args(["serve", *argv])
    cli.serve(args, parser)
    return seen


def keys_file(tmp: Path) -> str:
    path = tmp / "keys.toml"
    path.write_text('[[keys]]\nkey = "sk-wiring-1"\ntenant = "team-a"\n'
                    '[[keys]]\nkey = "sk-wiring-2"\ntenant = "team-b"\nadmin = true\n')
    return str(path)


Observe = Callable[[Seen], object]
# flag -> (argv using it, where its value lands, the value expected there). {tmp} is a scratch folder.
ROWS: dict[str, tuple[list[str], Observe, object]] = {
    "--model": (["--model", "/m/folder"], lambda s: s.config.model, "/m/folder"),
    "--adapter": (["--adapter", "a=/x/a", "--adapter", "b=/x/b"], lambda s: s.engine["adapters"],
                  [("a", "/x/a"), ("b", "/x/b")]),
    "--no-demo-adapters": (["--no-demo-adapters"], lambda s: s.engine["adapters"], []),
    "--max-loras": (["--max-loras", "3"], lambda s: s.config.max_loras, 3),
    "--max-cpu-loras": (["--max-cpu-loras", "21"], lambda s: s.config.max_cpu_loras, 21),
    "--max-lora-rank": (["--max-lora-rank", "8"], lambda s: s.config.max_lora_rank, 8),
    "--max-num-seqs": (["--max-num-seqs", "5"], lambda s: s.config.max_num_seqs, 5),
    "--kv-cache-blocks": (["--kv-cache-blocks", "77"], lambda s: s.config.kv_cache_blocks, 77),
    "--saved-rows-budget-mib": (["--saved-rows-budget-mib", "3"], lambda s: s.config.saved_rows_budget_bytes,
                                3 << 20),
    "--dtype": (["--dtype", "bfloat16"], lambda s: s.config.dtype, "bfloat16"),
    "--device": (["--device", "cpu"], lambda s: s.config.device, "cpu"),
    "--quantization": (["--quantization", "int8"], lambda s: s.config.quantization, "int8"),
    "--lora-dtype": (["--lora-dtype", "bfloat16"], lambda s: s.config.lora_dtype, "bfloat16"),
    "--speculative-config": (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
                             lambda s: s.config.speculative_config, SpeculativeConfig(num_speculative_tokens=3)),
    "--no-prefix-caching": (["--no-prefix-caching"], lambda s: s.config.enable_prefix_caching, False),
    "--scheduling-policy": (["--scheduling-policy", "fcfs"], lambda s: s.config.scheduling_policy, "fcfs"),
    "--threads": (["--threads", "1"], lambda s: s.config.num_threads, 1),
    "--log-level": (["--log-level", "warning"], lambda s: (s.engine["log_level"], s.uvicorn.log_level),
                    ("WARNING", "warning")),
    "--host": (["--host", "0.0.0.0"], lambda s: s.uvicorn.host, "0.0.0.0"),
    "--port": (["--port", "8123"], lambda s: s.uvicorn.port, 8123),
    "--served-model-name": (["--served-model-name", "base-x"], lambda s: s.app["served_model_name"], "base-x"),
    "--allow-runtime-adapters": (["--allow-runtime-adapters"], lambda s: s.app["allow_runtime_adapters"], True),
    "--adapter-root": (["--adapter-root", "/r1", "--adapter-root", "/r2"], lambda s: s.app["adapter_roots"],
                       ["/r1", "/r2"]),
    "--api-key": (["--api-key", "sk-one"], lambda s: s.app["api_key"], "sk-one"),
    "--api-keys": (["--api-keys", "{tmp}"], lambda s: s.app["api_keys"] and
                   sorted((k.key, k.tenant, k.admin) for k in s.app["api_keys"].keys),
                   [("sk-wiring-1", "team-a", False), ("sk-wiring-2", "team-b", True)]),
    "--load-on-demand": (["--load-on-demand", "--adapter-root", "/r"], lambda s: s.app["load_on_demand"], True),
    "--max-request-bytes": (["--max-request-bytes", "4096"], lambda s: s.app["max_request_bytes"], 4096),
    "--max-waiting-requests": (["--max-waiting-requests", "0"], lambda s: s.config.max_waiting_requests, 0),
    "--request-timeout": (["--request-timeout", "2.5"], lambda s: s.app["request_timeout"], 2.5),
    "--shutdown-timeout": (["--shutdown-timeout", "1.5"], lambda s: s.shutdown_timeout, 1.5),
    "--engine-cpus": (["--engine-cpus", "0-1,3"], lambda s: s.engine["cpus"], [0, 1, 3]),
    "--no-engine-restart": (["--no-engine-restart"], lambda s: s.engine["restart"], None),
    "--prepare-workers": (["--prepare-workers", "0"], lambda s: s.prepare_workers, 0),
    "--pin-adapter": (["--adapter", "a=/x/a", "--pin-adapter", "a"], lambda s: s.pins, ["a"]),
    "--in-process-engine": (["--in-process-engine"], lambda s: s.engine["in_process"], True),
    "--max-num-batched-tokens": (["--max-num-batched-tokens", "64"], lambda s: s.config.max_num_batched_tokens, 64),
    "--max-request-output-tokens": (["--max-request-output-tokens", "999"],
                                    lambda s: s.config.max_request_output_tokens, 999),
    "--max-prompt-logprobs-tokens": (["--max-prompt-logprobs-tokens", "33"],
                                     lambda s: s.config.max_prompt_logprobs_tokens, 33),
    "--max-adapters-per-request": (["--max-adapters-per-request", "3"],
                                   lambda s: s.config.max_adapters_per_request, 3),
    "--grammar-compile-timeout": (["--grammar-compile-timeout", "4.5"],
                                  lambda s: s.config.grammar_compile_timeout_s, 4.5),
    "--grammar-compile-workers": (["--grammar-compile-workers", "3"], lambda s: s.config.grammar_compile_workers, 3),
    "--header-timeout": (["--header-timeout", "2.5"], lambda s: s.uvicorn.http.header_timeout, 2.5),
    "--timeout-keep-alive": (["--timeout-keep-alive", "7"], lambda s: s.uvicorn.timeout_keep_alive, 7),
    "--h11-max-incomplete-event-size": (["--h11-max-incomplete-event-size", "4096"],
                                        lambda s: s.uvicorn.h11_max_incomplete_event_size, 4096),
    "--limit-concurrency": (["--limit-concurrency", "9"], lambda s: s.uvicorn.limit_concurrency, 9),
    "--stall-timeout": (["--stall-timeout", "3"], lambda s: s.app["stall_timeout"], 3),
    "--tool-call-parser": (["--tool-call-parser", "pythonic"], lambda s: s.app["tool_call_parser"], "pythonic"),
    "--reasoning-parser": (["--reasoning-parser", "qwen3"], lambda s: s.app["reasoning_parser"], "qwen3"),
    "--pooling": (["--pooling", "mean"], lambda s: s.app["pooling"], "mean"),
    "--otlp-traces-endpoint": (["--otlp-traces-endpoint", "http://127.0.0.1:9/v1/traces"],
                               lambda s: s.app["otlp_traces_endpoint"], "http://127.0.0.1:9/v1/traces"),
}


def serve_options() -> set[str]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {o for a in commands.choices["serve"]._actions for o in a.option_strings
            if o.startswith("--") and o != "--help"}


def test_every_serve_flag_has_a_row() -> None:
    missing, stale = serve_options() - ROWS.keys(), ROWS.keys() - serve_options()
    assert not missing, f"serve flags without a row in ROWS: {sorted(missing)}"
    assert not stale, f"rows for flags serve does not have: {sorted(stale)}"


@pytest.mark.parametrize("flag", sorted(ROWS))
def test_flag_reaches_what_it_configures(flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPLEX_API_KEY", raising=False)
    argv, observe, expected = ROWS[flag]
    argv = [keys_file(tmp_path) if a == "{tmp}" else a for a in argv]
    assert flag in argv
    assert observe(run_serve(argv, monkeypatch)) == expected
    # Without the flag (its companions kept) the value differs: the row bites.
    without = [a for i, a in enumerate(argv) if a != flag and not (i and argv[i - 1] == flag
                                                                     and not a.startswith("--"))]
    assert observe(run_serve(without, monkeypatch)) != expected


def test_engine_config_reads_max_waiting_requests_only_on_serve() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--max-waiting-requests", "4"])
    assert cli.engine_config(args, parser).max_waiting_requests == 4
    assert cli.engine_config(parser.parse_args(["serve"]), parser).max_waiting_requests is None
    assert cli.engine_config(parser.parse_args(["generate", "x"]), parser).max_waiting_requests is None
    del args.max_waiting_requests  # a renamed flag is an error, not an unbounded queue
    with pytest.raises(AttributeError):
        cli.engine_config(args, parser)


def test_serve_starts_the_grammar_compile_workers_with_the_engine() -> None:
    parser = build_parser()
    assert cli.engine_config(parser.parse_args(["serve"]), parser).grammar_compile_warm
    assert not cli.engine_config(parser.parse_args(["generate", "x"]), parser).grammar_compile_warm
