"""``loraplex serve`` (the OpenAI-compatible server) and ``loraplex generate`` (offline completions)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from loraplex.config import EngineConfig
from loraplex.engine.pooling.params import POOLING_TYPES
from loraplex.errors import EngineUnavailable, LoraplexError
from loraplex.server.openai.reasoning import REASONING_PARSERS
from loraplex.server.openai.tool_parsers import PARSERS as TOOL_PARSERS

if TYPE_CHECKING:
    from fastapi import FastAPI

    from loraplex.client.base import EngineClient
    from loraplex.server.draining import DrainingServer

logger = logging.getLogger("loraplex.cli")


def adapter_spec(value: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (name, path); anything else, or a name outside the adapter name pattern
    (``adapters/names.py``), is an argparse error."""
    from loraplex.adapters.names import check_adapter_name

    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    try:
        check_adapter_name(name.strip())
    except LoraplexError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name.strip(), path.strip()


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def nonnegative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or a positive integer, got {value!r}")
    return number


def seconds(value: str) -> float:
    number = float(value)
    if not number >= 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {value!r}")
    return number


def cpu_list(value: str) -> list[int]:
    """``0-3,6`` -> [0, 1, 2, 3, 6]."""
    cpus: list[int] = []
    try:
        for part in value.split(","):
            first, _, last = part.partition("-")
            cpus += range(int(first), int(last or first) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected cores like 0-1 or 0,2, got {value!r}") from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"expected cores like 0-1 or 0,2, got {value!r}")
    return cpus


def _engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=d.model,
                   help="local HF folder, a GGUF file (or a folder holding one), or the embedded default (%(default)s)")
    p.add_argument("--adapter", action="append", type=adapter_spec, default=[], metavar="NAME=PATH",
                   help="load a PEFT adapter folder at start (repeatable)")
    p.add_argument("--no-demo-adapters", action="store_true",
                   help="with the embedded model and no --adapter, do not load the demo adapters")
    p.add_argument("--max-loras", type=int, default=d.max_loras, help="device adapter slots")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help=f"adapters kept in host memory (default: max({d.max_cpu_loras}, --max-loras))")
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="requests decoding at once")
    p.add_argument("--kv-cache-blocks", type=int, default=None,
                   help=f"KV cache size in blocks of {d.block_size} tokens (default: {d.kv_cache_bytes >> 20} MiB)")
    p.add_argument("--saved-rows-budget-mib", type=int, default=d.saved_rows_budget_bytes >> 20,
                   help="host memory for adapters' saved embed_tokens/lm_head rows (modules_to_save, trainable "
                        "tokens, added tokens); a load past it fails (default: %(default)s)")
    p.add_argument("--dtype", default=d.dtype, help="auto (float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--quantization", default=None, choices=EngineConfig.QUANTIZATIONS,
                   help="store the base weights as weight-only int8 (LoRA stays float)")
    p.add_argument("--lora-dtype", default=d.lora_dtype, choices=EngineConfig.LORA_DTYPES,
                   help="adapter weights in the host tier and slots: bfloat16 halves their bytes (%(default)s)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (default: off)')
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="recompute every prompt instead of reusing cached K/V of a shared prefix")
    p.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=EngineConfig.SCHEDULING_POLICIES,
                   help="admission order: fair share per tenant (virtual token counters) or fcfs (%(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the kernels (default: torch's, one per core; fewer on a busy host)")
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=d.max_num_batched_tokens, metavar="N",
                   help="tokens one engine step computes at most: running streams decode while a longer prompt "
                        "is prefilled in chunks of what is left (%(default)s; docs/server.md: Chunked prefill)")
    p.add_argument("--max-request-output-tokens", type=positive_int, default=None, metavar="N",
                   help="the most tokens the choices of one prompt may generate together, n x max_tokens (each "
                        "choice's real maximum: the rest of the context without max_tokens); past it a 400 on n "
                        "(default: 16 x the context length)")
    p.add_argument("--max-prompt-logprobs-tokens", type=positive_int, default=None, metavar="N",
                   help="the most prompt tokens a request may ask prompt_logprobs of; past it a 400 on "
                        "prompt_logprobs (default: the context length)")
    p.add_argument("--max-adapters-per-request", type=positive_int, default=d.max_adapters_per_request, metavar="N",
                   help="the most adapters one request may blend (adapter_mix entries; each takes a device slot "
                        "while it runs); past it a 400 on adapter_mix (default: %(default)s)")
    p.add_argument("--grammar-compile-timeout", type=seconds, default=d.grammar_compile_timeout_s, metavar="SECONDS",
                   help="time budget of one structured-output grammar compile; past it a 400 on structured_outputs "
                        "and its worker process is killed (%(default)s)")
    p.add_argument("--grammar-compile-workers", type=positive_int, default=d.grammar_compile_workers, metavar="N",
                   help="grammar-compile worker processes; one tenant may hold all but one (%(default)s)")


def _connection_args(serve: argparse.ArgumentParser) -> None:
    """Connection limits (``server/connections.py``) and the health check's stall timeout."""
    from loraplex.server.connections import ConnectionLimits
    from loraplex.server.routes.ops import DEFAULT_STALL_TIMEOUT_S

    d = ConnectionLimits()
    serve.add_argument("--header-timeout", type=seconds, default=d.header_timeout, metavar="SECONDS",
                       help="close a connection whose request header is not complete this long after it opened "
                            "or after its previous response (slowloris; default: %(default)g)")
    serve.add_argument("--timeout-keep-alive", type=seconds, default=d.timeout_keep_alive, metavar="SECONDS",
                       help="close an idle kept-alive connection after this long (uvicorn's; default: %(default)g)")
    serve.add_argument("--h11-max-incomplete-event-size", type=positive_int, default=d.h11_max_incomplete_event_size,
                       metavar="BYTES", help="most bytes of an incomplete request header (uvicorn's; default: "
                                             "%(default)d)")
    serve.add_argument("--limit-concurrency", type=positive_int, default=None, metavar="N",
                       help="most open connections and tasks; more get 503 (uvicorn's; default: no limit)")
    serve.add_argument("--stall-timeout", type=seconds, default=DEFAULT_STALL_TIMEOUT_S, metavar="SECONDS",
                       help="/health answers 503 'stalled' when requests are open and no engine step finished "
                            "for this long (default: %(default)g)")
    serve.add_argument("--no-engine-restart", action="store_true",
                       help="when the engine process dies, exit non-zero instead of restarting it (for supervisors)")


def _parser_args(serve: argparse.ArgumentParser) -> None:
    """How chat output is read: tool calls and reasoning (``server/openai/tool_parsers``, ``reasoning``)."""
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS), metavar="NAME",
                       help="the tool-call format of tool_choice auto, vLLM's names: " + ", ".join(sorted(TOOL_PARSERS))
                            + " (default: detected from each adapter version's chat template, else hermes)")
    serve.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS), metavar="NAME",
                       help="split chat output into reasoning_content and content, vLLM's names: "
                            + ", ".join(sorted(REASONING_PARSERS)) + " (default: none)")


def _pooling_args(serve: argparse.ArgumentParser) -> None:
    """How ``/v1/embeddings`` pools (``models/pooling_config.py``)."""
    serve.add_argument("--pooling", default=None, choices=POOLING_TYPES,
                       help="how /v1/embeddings pools the final hidden states: last token, mean or first (cls) "
                            "(default: the model's sentence-transformers config, else last)")


def _observability_args(serve: argparse.ArgumentParser) -> None:
    """Traces (``server/tracing.py``); the metrics need no flag (``/metrics``)."""
    serve.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="export one OpenTelemetry trace per request over OTLP/HTTP protobuf to URL, e.g. "
                            "http://localhost:4318/v1/traces (needs loraplex[otel]; default: off)")


def build_parser() -> argparse.ArgumentParser:
    from loraplex.server.draining import DEFAULT_SHUTDOWN_TIMEOUT_S
    from loraplex.server.limits import BYTES_PER_CONTEXT_TOKEN

    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the base model's name in the API")
    serve.add_argument("--allow-runtime-adapters", action="store_true",
                       help="enable /v1/load_lora_adapter and /v1/unload_lora_adapter")
    serve.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                       help="runtime loads must resolve inside one of these folders (repeatable)")
    serve.add_argument("--api-key", default=os.environ.get("LORAPLEX_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $LORAPLEX_API_KEY)")
    serve.add_argument("--api-keys", default=None, metavar="FILE",
                       help="scoped API keys (TOML or YAML): tenant, adapters, admin, limits per key (docs/server.md)")
    serve.add_argument("--load-on-demand", action="store_true",
                       help="a request for an adapter that is not loaded loads <adapter-root>/NAME first")
    serve.add_argument("--max-request-bytes", type=positive_int, default=None, metavar="N",
                       help="larger request bodies get 413 before they are read "
                            f"(default: {BYTES_PER_CONTEXT_TOKEN} bytes per token of context, at least 1 MiB)")
    serve.add_argument("--max-waiting-requests", type=nonnegative_int, default=None, metavar="N",
                       help="requests that may wait to start beyond the free --max-num-seqs seats; more get 503 "
                            "with Retry-After (default: unbounded)")
    serve.add_argument("--request-timeout", type=seconds, default=None, metavar="SECONDS",
                       help="stop a generation request running longer: 504, or an error event on a stream "
                            "(default: no limit)")
    serve.add_argument("--shutdown-timeout", type=seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                       help="on SIGTERM, new requests get 503 and running ones may finish for this long; then "
                            "they end with an error and the server exits (default: %(default)g; SIGINT twice: at once)")
    serve.add_argument("--engine-cpus", type=cpu_list, default=None, metavar="LIST",
                       help="bind the engine process's OpenMP threads to these cores, e.g. 0-1 or 0,2 "
                            "(default: no binding)")
    serve.add_argument("--prepare-workers", type=nonnegative_int, default=2, metavar="N",
                       help="processes that parse, template and tokenize requests (0: threads of the API process)")
    serve.add_argument("--pin-adapter", action="append", default=[], metavar="NAME",
                       help="keep this start-up adapter in a device slot and host memory (repeatable; at most "
                            "--max-loras - 1)")
    serve.add_argument("--in-process-engine", action="store_true",
                       help="run the step loop in a thread of the API process instead of its own process")
    _connection_args(serve)
    _parser_args(serve)
    _pooling_args(serve)
    _observability_args(serve)
    gen = sub.add_parser("generate", help="print completions of PROMPT(s)")
    _engine_args(gen)
    gen.add_argument("--use", default=None, metavar="NAME", help="the adapter to generate with (default: base)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    ray = sub.add_parser("serve-ray", help="serve the HTTP API from N engine replicas on Ray Serve (loraplex[ray])")
    _engine_args(ray)
    from loraplex.integrations import ray_cli  # its flags; Ray itself is imported only when serve-ray runs

    ray_cli.add_arguments(ray)
    return parser


def engine_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    cpu_loras = args.max_cpu_loras if args.max_cpu_loras is not None else max(16, args.max_loras)
    try:
        return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_loras=args.max_loras,
                            max_cpu_loras=cpu_loras, max_lora_rank=args.max_lora_rank,
                            max_num_seqs=args.max_num_seqs, kv_cache_blocks=args.kv_cache_blocks,
                            max_waiting_requests=args.max_waiting_requests if args.command == "serve" else None,
                            num_threads=args.threads, quantization=args.quantization,
                            saved_rows_budget_bytes=args.saved_rows_budget_mib << 20,
                            enable_prefix_caching=not args.no_prefix_caching,
                            scheduling_policy=args.scheduling_policy, lora_dtype=args.lora_dtype,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            max_request_output_tokens=args.max_request_output_tokens,
                            max_prompt_logprobs_tokens=args.max_prompt_logprobs_tokens,
                            max_adapters_per_request=args.max_adapters_per_request,
                            speculative_config=args.speculative_config,
                            grammar_compile_timeout_s=args.grammar_compile_timeout,
                            grammar_compile_workers=args.grammar_compile_workers,
                            grammar_compile_warm=args.command == "serve")
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def startup_adapters(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``--adapter`` pairs; with none on the embedded model, the shipped demo adapters."""
    from loraplex.models.embedded import EMBEDDED_MODEL

    if args.adapter or args.no_demo_adapters or args.model.lower() != EMBEDDED_MODEL:
        return list(args.adapter)
    from loraplex.demo_adapters import DEMO_ADAPTERS

    return [(name, str(path)) for name, path in DEMO_ADAPTERS.items()]


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    import asyncio
    import gc

    from loraplex.server.app import create_app
    from loraplex.server.prepare.preparer import RequestPreparer
    from loraplex.server.tenancy.keys import KeyTable

    config = engine_config(args, parser)
    if args.api_keys and args.api_key:
        parser.error("--api-key and --api-keys are exclusive (the keys file can hold a key of every scope)")
    if args.load_on_demand and not args.adapter_root:
        parser.error("--load-on-demand needs --adapter-root DIR (the folders adapters are loaded from)")
    try:
        keys = KeyTable.load(args.api_keys) if args.api_keys else None
    except (OSError, ValueError) as exc:
        parser.error(f"--api-keys: {exc}")
    preparer = RequestPreparer(processes=args.prepare_workers)
    preparer.start()  # the worker processes import while the engine loads the model
    try:
        client = _start_engine(args, config)
    except BaseException:
        preparer.shutdown()
        raise
    try:
        app = create_app(client, served_model_name=args.served_model_name,
                         allow_runtime_adapters=args.allow_runtime_adapters, adapter_roots=args.adapter_root,
                         api_key=args.api_key, api_keys=keys, load_on_demand=args.load_on_demand,
                         max_request_bytes=args.max_request_bytes,
                         preparer=preparer, request_timeout=args.request_timeout or None,
                         stall_timeout=args.stall_timeout, tool_call_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser,
                         otlp_traces_endpoint=args.otlp_traces_endpoint, pooling=args.pooling)
        _pin(client, args.pin_adapter, parser)
        stats, adapters = asyncio.run(_describe(client))
        info = client.info
        logger.info("model %s (%s) dtype %s on %s; engine %s (pid %d)", info.model_name, info.model_path, info.dtype,
                    info.device, "in this process" if args.in_process_engine else "in its own process", info.pid)
        logger.info("%d adapter slots, %d in host memory, max rank %d; KV cache %d blocks x %d tokens, prefix "
                    "caching %s", config.max_loras, config.max_cpu_loras, config.max_lora_rank,
                    stats.kv_blocks_total, config.block_size, "on" if config.enable_prefix_caching else "off")
        logger.info("adapters: %s; pinned: %s", ", ".join(f"{i.name}={i.path}" for i in adapters) or "none",
                    ", ".join(args.pin_adapter) or "none")
        logger.info("runtime adapter loading %s%s; auth %s", "on" if args.allow_runtime_adapters else "off",
                    f" (roots: {', '.join(args.adapter_root)})" if args.adapter_root else "",
                    f"on ({len(keys.keys)} scoped keys)" if keys else "on" if args.api_key else "off")
        logger.info("serving on http://%s:%d/v1; the playground is at http://%s:%d/", args.host, args.port,
                    args.host, args.port)
        gc.freeze()  # what start-up built (modules, the app, the tokenizer) stays out of later collections
        # A signal before or after serving ends the process normally (the engine is stopped below); while
        # serving, SIGTERM drains (server/draining.py) and serve() returns.
        signal.signal(signal.SIGTERM, _exit_normally)
        signal.signal(signal.SIGINT, _exit_normally)
        _http_server(app, args).run()
        if client.health().state == "dead":  # the engine process died for good: a supervisor restarts us
            raise EngineUnavailable(f"{client.health().detail}; exiting")
    finally:
        client.shutdown()


def _start_engine(args: argparse.Namespace, config: EngineConfig) -> EngineClient:
    """The engine ``serve`` runs: in this process, or in its own process (started and ready)."""
    if args.in_process_engine:
        from loraplex.client.inproc import AsyncEngine

        return AsyncEngine.from_config(config, startup_adapters(args))
    from loraplex.client.process import EngineProcess
    from loraplex.client.restart import RestartPolicy

    client = EngineProcess(config, startup_adapters(args), cpus=args.engine_cpus, log_level=args.log_level,
                           restart=None if args.no_engine_restart else RestartPolicy(), on_dead=_stop_serving)
    client.start()
    return client


def _http_server(app: FastAPI, args: argparse.Namespace) -> DrainingServer:
    """The draining uvicorn server of ``app``, with the connection limits of ``args``."""
    import uvicorn

    from loraplex.server.connections import ConnectionLimits
    from loraplex.server.draining import DrainingServer  # noqa: F811 - the run-time import of the hint

    limits = ConnectionLimits(args.header_timeout, args.timeout_keep_alive, args.h11_max_incomplete_event_size,
                              args.limit_concurrency)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            **limits.uvicorn_options())
    return DrainingServer(config, app.state.lifecycle, args.shutdown_timeout)


def _stop_serving() -> None:
    """The engine process is gone for good: drain as on SIGTERM; ``serve`` then exits non-zero."""
    os.kill(os.getpid(), signal.SIGTERM)


def _exit_normally(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _pin(client: EngineClient, names: Sequence[str], parser: argparse.ArgumentParser) -> None:
    """``--pin-adapter`` names, pinned once the start-up adapters are loaded; a refusal is a usage error."""
    import asyncio

    for name in names:
        try:
            asyncio.run(client.pin_adapter(name))
        except LoraplexError as exc:
            parser.error(f"--pin-adapter {name}: {exc}")


async def _describe(client: EngineClient) -> tuple:
    """The engine's stats and adapters, for the start-up log."""
    return await client.stats(), await client.list_adapters()


def generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from loraplex.engine.request import SamplingParams
    from loraplex.llm import LLM

    llm = LLM(**vars(engine_config(args, parser)))
    for name, path in startup_adapters(args):
        llm.load_adapter(name, path)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    outputs = llm.generate(args.prompts, params, adapters=args.use, use_tqdm=False)
    for prompt, out in zip(args.prompts, outputs, strict=True):
        if len(args.prompts) > 1:
            print(f"### {prompt}")
        print(out.text)


def serve_ray(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from loraplex.integrations import ray_cli

    ray_cli.serve_ray(args, engine_config(args, parser), parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        {"serve": serve, "generate": generate, "serve-ray": serve_ray}[args.command](args, parser)
    except LoraplexError as exc:
        print(f"loraplex: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
