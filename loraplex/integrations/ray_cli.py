"""``loraplex serve-ray``: its arguments, and the command. Ray is imported only when it runs, so the
CLI (and ``import loraplex``) work without the ``ray`` extra installed."""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

from loraplex.config import EngineConfig
from loraplex.integrations.ray_config import RayServeConfig

logger = logging.getLogger("loraplex.cli")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The serve-ray flags beyond the engine's (``--model``, ``--adapter``, ``--max-loras``, ...)."""
    d = RayServeConfig()
    p.add_argument("--replicas", type=int, default=d.replicas, help="engine replicas (%(default)s)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--served-model-name", default=None, help="the base model's name in the API")
    p.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                   help="model=NAME loads DIR/NAME lazily on the replica that serves it (repeatable)")
    p.add_argument("--api-key", default=os.environ.get("LORAPLEX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $LORAPLEX_API_KEY)")
    p.add_argument("--max-adapters-per-replica", type=int, default=d.max_adapters_per_replica,
                   help="adapters each replica advertises for affinity routing (Serve multiplexing, LRU)")
    p.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="requests in flight per replica before Serve queues (default: --max-num-seqs)")
    p.add_argument("--num-cpus-per-replica", type=float, default=d.num_cpus_per_replica,
                   help="Ray CPUs reserved per replica")
    p.add_argument("--torch-threads", type=int, default=None, help="torch threads per replica")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto); default: start a local one")


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve()) if Path(path).expanduser().exists() else path


def config_from_args(args: argparse.Namespace, engine: EngineConfig) -> RayServeConfig:
    """Paths made absolute: replicas run in other processes (and, on a cluster, other machines)."""
    return RayServeConfig(
        engine=replace(engine, model=_absolute(engine.model)), replicas=args.replicas,
        adapters=tuple((name, _absolute(path)) for name, path in args.adapter),
        adapter_roots=tuple(_absolute(r) for r in args.adapter_root), served_model_name=args.served_model_name,
        api_key=args.api_key or None, max_adapters_per_replica=args.max_adapters_per_replica,
        max_ongoing_requests=args.max_ongoing_requests, num_cpus_per_replica=args.num_cpus_per_replica,
        torch_threads=args.torch_threads, host=args.host, port=args.port,
    )


def serve_ray(args: argparse.Namespace, engine: EngineConfig, parser: argparse.ArgumentParser) -> None:
    """Start (or join) Ray, deploy, and serve until interrupted."""
    try:
        config = config_from_args(args, engine)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        import ray

        from loraplex.integrations import ray_serve
    except ImportError as exc:
        parser.error(f"serve-ray needs Ray Serve: pip install 'loraplex[ray]' ({exc})")
    start = time.monotonic()
    ray.init(address=args.ray_address, include_dashboard=False)
    url = ray_serve.deploy(config)
    logger.info("ready in %.1f s: %s/v1 (%d replicas; adapters from %s); Ctrl-C stops", time.monotonic() - start,
                url, config.replicas, ", ".join(config.adapter_roots) or "start-up only")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        logger.info("shutting down")
    finally:
        ray_serve.shutdown()
        ray.shutdown()
