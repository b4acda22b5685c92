"""The prefill tier as a Ray Serve application: ``[fleet].replicas`` replicas of the prefill server
(``replica.py``) behind one ingress (``ingress.py``), routed by prefix affinity (``router.py``).

``edgedecode prefill-server --ray`` runs it (``run_fleet``); so does
``serve run edgedecode.prefill.fleet.app:app_builder config=/etc/edgedecode/edgedecode.toml``
on a running Ray cluster.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray import serve

import edgedecode
from edgedecode.config import Config, load_config
from edgedecode.prefill.fleet.ingress import PrefillIngress
from edgedecode.prefill.fleet.replica import PrefillReplica
from edgedecode.prefill.fleet.router import PrefixAffinityRouter

logger = logging.getLogger(__name__)
APP_NAME = "edgedecode-prefill"
REPLICAS_DEPLOYMENT = "PrefillReplica"
ROUTING_STATS_PERIOD_S = 2.0  # how often replicas tell the router which prefixes they hold
INGRESS_MAX_ONGOING = 1024  # the ingress only relays: it holds many requests at once


def build_app(config: Config) -> serve.Application:
    """The tier's Serve application for ``config`` (``[fleet]`` sizes it, ``[prefill]`` configures
    each replica's server, ``[model]`` its model and device)."""
    fleet = config.fleet
    scaling: dict[str, Any] = {"num_replicas": fleet.replicas}
    if fleet.max_replicas:
        scaling = {
            "autoscaling_config": {
                "min_replicas": fleet.min_replicas,
                "initial_replicas": fleet.replicas,
                "max_replicas": fleet.max_replicas,
                "target_ongoing_requests": fleet.target_ongoing_requests,
            }
        }
    replicas = serve.deployment(
        name=REPLICAS_DEPLOYMENT,
        ray_actor_options={"num_cpus": fleet.replica_cpus, "num_gpus": fleet.replica_gpus},
        max_ongoing_requests=fleet.max_ongoing_requests,
        max_queued_requests=fleet.max_queued_requests,
        health_check_period_s=fleet.health_check_period_s,
        health_check_timeout_s=fleet.health_check_timeout_s,
        graceful_shutdown_timeout_s=fleet.graceful_shutdown_s,
        request_router_config={
            "request_router_class": PrefixAffinityRouter,
            "request_router_kwargs": {"policy": fleet.routing, "imbalance": fleet.affinity_imbalance},
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
        },
        **scaling,
    )(PrefillReplica).bind(config)
    ingress = serve.deployment(
        name="PrefillIngress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        graceful_shutdown_timeout_s=fleet.graceful_shutdown_s,
    )(PrefillIngress)
    return ingress.bind(replicas, config)


def app_builder(args: dict[str, str]) -> serve.Application:
    """For ``serve run edgedecode.prefill.fleet.app:app_builder [config=PATH]``."""
    path = args.get("config")
    return build_app(load_config(Path(path) if path else None))


def start_fleet(config: Config, **ray_options: Any) -> str:
    """Connect to Ray (``fleet.ray_address``; "" starts a Ray instance of its own here, with
    ``ray_options`` for ``ray.init``), start Serve's HTTP proxy on ``prefill.host``/``prefill.port`` (0: a free port)
    and deploy the tier; returns its URL once every replica is up. Replicas import this package
    from where this process does."""
    package_root = str(Path(edgedecode.__file__).resolve().parent.parent)
    ray.init(
        address=config.fleet.ray_address or "local",  # "local": a new instance, never one found running
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": package_root}},
        configure_logging=False,
        **ray_options,
    )
    host, port = config.prefill.host, config.prefill.port or free_port(config.prefill.host)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"


def stop_fleet() -> None:
    """Take the tier down (replicas finish their requests first) and leave Ray."""
    serve.shutdown()
    ray.shutdown()


def run_fleet(config: Config, announce: Callable[[str], None]) -> None:
    """Run the tier until SIGTERM/SIGINT; ``announce`` gets its URL."""
    stop = threading.Event()
    try:
        url = start_fleet(config)
        for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, whose own handler aborts the process
            signal.signal(sig, lambda *_: stop.set())
        announce(url)
        stop.wait()
        logger.info("shutting the prefill tier down")
    finally:
        stop_fleet()


def replica_names() -> list[str]:
    """The names (Serve ids) of the tier's live replicas, from Ray's named actors."""
    prefix = f"SERVE_REPLICA::{APP_NAME}#{REPLICAS_DEPLOYMENT}#"
    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(actor["name"][len(prefix) :] for actor in names if actor["name"].startswith(prefix))


def replica_actor(name: str) -> ray.actor.ActorHandle:
    """The Ray actor of the replica ``name`` (to stop it, for instance)."""
    return ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{REPLICAS_DEPLOYMENT}#{name}", namespace="serve")


def free_port(host: str) -> int:
    """A port free on ``host`` just now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
