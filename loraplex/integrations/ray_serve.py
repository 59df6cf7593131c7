"""Scale-out on Ray Serve: N engine replicas behind one OpenAI-compatible endpoint.

```
client --HTTP--> Serve proxy --> Ingress (1 replica, no engine)
                                   | model=NAME -> handle.options(multiplexed_model_id=NAME)
                                   v
                    EngineReplica x N (Engine + the `loraplex serve` FastAPI app, in-process)
```

- **Same API.** Each replica runs ``loraplex.server.app.create_app`` over its own engine; the
  ingress forwards raw requests and relays responses, streams included (``asgi_bridge``).
- **Adapter affinity.** The ingress sets Serve's multiplexed model id to the adapter a completion
  or chat request names; Serve's router sends it to a replica that already holds that adapter
  when one has room (else to the replica holding the fewest), and the replica's
  ``@serve.multiplexed`` loader registers it there. Base-model requests go to any replica.
- **Adapters: lazy, per replica, from shared roots.** Start-up adapters (``adapters``) are loaded
  on every replica; any other ``model=NAME`` is loaded from ``<root>/NAME`` by the replica that
  first serves it. Publishing an adapter = copying its folder into a root (treat folders as
  immutable: a changed folder fails requests with ``AdapterContentChanged`` on replicas that
  re-read it; publish a new name instead). The load/unload endpoints answer 403.
- **Failures.** Serve restarts a dead replica; the ingress re-sends a request whose replica died
  before answering and ends a stream cut mid-way with an error event.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import ray
from ray import serve
from ray.actor import ActorHandle
from ray.serve import Application

from loraplex.integrations.ray_config import APP_NAME, ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, RayServeConfig
from loraplex.integrations.ray_ingress import Ingress
from loraplex.integrations.ray_replica import EngineReplica

logger = logging.getLogger(__name__)

INGRESS_MAX_ONGOING_REQUESTS = 1024  # the ingress only relays; the engines' limits do the queueing
SERVE_NAMESPACE = "serve"


def build_application(config: RayServeConfig) -> Application:
    """The Serve application: the ingress bound to ``config.replicas`` engine replicas."""
    engine = serve.deployment(
        name=ENGINE_DEPLOYMENT, num_replicas=config.replicas,
        max_ongoing_requests=config.replica_max_ongoing_requests,
        ray_actor_options={"num_cpus": config.num_cpus_per_replica},
        graceful_shutdown_timeout_s=10,
    )(EngineReplica)
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0},
    )(Ingress)
    return ingress.bind(engine.bind(replace(config, api_key=None)), config)  # the key stays at the ingress


def deploy(config: RayServeConfig) -> str:
    """Start Serve's HTTP proxy on ``config.host:config.port`` (Ray must be initialised, or is
    started locally) and deploy; returns the base URL once every replica is ready."""
    start = time.monotonic()
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(build_application(config), name=APP_NAME, route_prefix="/")
    url = f"http://{config.host}:{config.port}"
    logger.info("%d engine replica(s) serving %s on %s/v1 after %.1f s", config.replicas, config.engine.model,
                url, time.monotonic() - start)
    return url


def engine_replica_actors() -> dict[str, ActorHandle]:
    """Replica id (as in the ``x-loraplex-replica`` header) -> its Ray actor, for every live engine
    replica of the application (e.g. to kill one in a failure drill)."""
    prefix = f"SERVE_REPLICA::{APP_NAME}#{ENGINE_DEPLOYMENT}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == SERVE_NAMESPACE and a["name"].startswith(prefix)]
    return {name[len(prefix):]: ray.get_actor(name, namespace=SERVE_NAMESPACE) for name in names}


def shutdown() -> None:
    """Delete the application and stop Serve (Ray itself keeps running)."""
    serve.shutdown()
