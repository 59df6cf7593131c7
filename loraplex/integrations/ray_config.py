"""``RayServeConfig``: everything ``loraplex serve-ray`` needs. Importing it does not import Ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loraplex.config import EngineConfig

APP_NAME = "loraplex"
ENGINE_DEPLOYMENT = "LoraplexEngine"
INGRESS_DEPLOYMENT = "LoraplexIngress"
REPLICA_HEADER = "x-loraplex-replica"  # the engine replica that served the request
AFFINITY_HEADER = "x-loraplex-adapter-cache"  # "hit": that replica already held the adapter; "miss"


@dataclass(frozen=True)
class RayServeConfig:
    """A Ray Serve deployment of ``replicas`` engines behind one OpenAI-compatible endpoint.

    Adapters: ``adapters`` (name, folder) are loaded on every replica at start. Any other adapter
    is loaded lazily, per replica: a request for ``model=NAME`` makes the replica it is routed to
    load ``<root>/NAME`` from the first of ``adapter_roots`` that has it, on first use.
    ``max_adapters_per_replica`` is the size of each replica's Serve multiplexing set: the adapters
    it advertises to the router, which sends a request to a replica already holding its adapter
    when one has room. Leaving that set only stops the advertising: the engine keeps the adapter
    registered (its host tier and device slots have their own LRU), so no request ever fails for it.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    replicas: int = 2
    adapters: tuple[tuple[str, str], ...] = ()
    adapter_roots: tuple[str, ...] = ()
    served_model_name: str | None = None
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1/* when set
    max_adapters_per_replica: int = 16
    max_ongoing_requests: int | None = None  # per replica; None: the engine's max_num_seqs
    num_cpus_per_replica: float = 1.0  # Ray's scheduling unit, not a thread count
    torch_threads: int | None = None  # per replica; None: torch's default
    retries: int = 1  # re-sends of a request whose replica died before sending anything
    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self) -> None:
        for name in ("replicas", "max_adapters_per_replica"):
            if getattr(self, name) < 1:
                raise ValueError(f"RayServeConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError(f"RayServeConfig.max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        if self.num_cpus_per_replica < 0:
            raise ValueError(f"RayServeConfig.num_cpus_per_replica must be >= 0, got {self.num_cpus_per_replica}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"RayServeConfig.torch_threads must be >= 1, got {self.torch_threads}")
        if self.retries < 0:
            raise ValueError(f"RayServeConfig.retries must be >= 0, got {self.retries}")
        for root in self.adapter_roots:
            if not Path(root).is_dir():
                raise ValueError(f"adapter root {root!r} is not a folder")

    @property
    def replica_max_ongoing_requests(self) -> int:
        return self.max_ongoing_requests or self.engine.max_num_seqs

    @property
    def base_model_names(self) -> frozenset[str]:
        """Every ``model`` value that means the base model (as ``create_app`` accepts them)."""
        model = self.engine.model
        name = Path(model).name if Path(model).is_dir() else model
        return frozenset({self.served_model_name or name, name, model})
