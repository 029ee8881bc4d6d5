"""The --ray-* flags of `aioengine serve`, generated from what they set (RayServeOptions);
importing this module does not import Ray (`aioengine serve --help` works without the
extra)."""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

from aioengine.config import FlagSpec, add_dataclass_flags, flag, flag_values
from aioengine.ray_serve.prefix import DEFAULT_BLOCK_CHARS

ROUTERS = ("prefix", "pow2")
# The affine replica is passed over when its queue is longer than the shorter of two
# others by more than this.
DEFAULT_MAX_IMBALANCE = 8
# By its import path (Ray's own form of it), so that this module does not import the
# router, which imports Ray and this module's DEFAULT_MAX_IMBALANCE.
PREFIX_ROUTER_PATH = "aioengine.ray_serve.router.PrefixAffinityRouter"


@dataclass(frozen=True)
class RayServeOptions:
    """How the engine deployment is replicated, placed and routed (the --ray-* flags)."""
    num_replicas: int = 1
    # Autoscaling (Ray Serve's autoscaling_config) when min or max is set; num_replicas is
    # then the initial count.
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    replica_cpus: float = 1.0  # Ray CPUs per replica; also its torch threads
    max_ongoing_requests: int = 256  # per replica; the engine queues the rest itself
    router: str = "prefix"  # prefix: PrefixAffinityRouter; pow2: Ray's default
    max_imbalance: int = DEFAULT_MAX_IMBALANCE
    prefix_block_chars: int = DEFAULT_BLOCK_CHARS
    health_check_period_s: float = 2.0
    graceful_shutdown_timeout_s: float = 20.0
    # > 0: --lora-modules are loaded on demand, at most this many per replica, through Ray
    # Serve's model multiplexing; 0: every replica loads them all at start-up.
    max_adapters_per_replica: int = 0
    metrics_export_port: int | None = None  # of a Ray started here; None: Ray's default

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError("--ray-replicas must be >= 1")
        if self.max_adapters_per_replica < 0:
            raise ValueError("--ray-max-adapters-per-replica must be >= 0")
        if self.router not in ROUTERS:
            raise ValueError(f"--ray-router must be one of {', '.join(ROUTERS)}")
        if self.replica_cpus <= 0:
            raise ValueError("--ray-replica-cpus must be > 0")
        lo = self.min_replicas if self.min_replicas is not None else 1
        hi = self.max_replicas if self.max_replicas is not None else self.num_replicas
        if self.autoscaling and not 0 <= lo <= self.num_replicas <= hi:
            raise ValueError("autoscaling needs min replicas <= --ray-replicas <= max "
                             "replicas")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def replica_deployment_options(self) -> dict:
        threads = max(1, math.floor(self.replica_cpus))
        env = {"AIOENGINE_CPU_THREADS": os.environ.get("AIOENGINE_CPU_THREADS", str(threads))}
        options: dict = dict(
            name="EngineReplica", max_ongoing_requests=self.max_ongoing_requests,
            ray_actor_options={"num_cpus": self.replica_cpus,
                               "runtime_env": {"env_vars": env}},
            health_check_period_s=self.health_check_period_s,
            graceful_shutdown_timeout_s=self.graceful_shutdown_timeout_s)
        if self.autoscaling:
            autoscaling = {"min_replicas": self.min_replicas if self.min_replicas is not None
                           else 1,
                           "max_replicas": self.max_replicas if self.max_replicas is not None
                           else self.num_replicas,
                           "initial_replicas": self.num_replicas}
            if self.target_ongoing_requests is not None:
                autoscaling["target_ongoing_requests"] = self.target_ongoing_requests
            options["autoscaling_config"] = autoscaling
        else:
            options["num_replicas"] = self.num_replicas
        if self.router == "prefix":
            from ray.serve.config import RequestRouterConfig

            options["request_router_config"] = RequestRouterConfig(
                request_router_class=PREFIX_ROUTER_PATH,
                request_router_kwargs={"max_imbalance": self.max_imbalance})
        return options


# RayServeOptions field -> its --ray-* flag (dest: the Namespace attribute it has always
# had). --ray-replicas defaults to None, not num_replicas' 1: given at all, it moves
# `aioengine serve` onto Ray Serve.
RAY_FLAGS: dict[str, FlagSpec] = {
    "num_replicas": flag(
        "--ray-replicas", dest="ray_replicas", type=int, default=None, metavar="N",
        help="serve N engine replicas on Ray Serve behind Ray's HTTP proxy on --host/--port "
             "(a local Ray, or the cluster at $RAY_ADDRESS); with autoscaling, the initial "
             "count"),
    "min_replicas": flag("--ray-min-replicas", dest="ray_min_replicas", type=int, metavar="N",
                         help="autoscale: at least N replicas"),
    "max_replicas": flag("--ray-max-replicas", dest="ray_max_replicas", type=int, metavar="N",
                         help="autoscale: at most N replicas"),
    "target_ongoing_requests": flag(
        "--ray-target-ongoing-requests", dest="ray_target_ongoing_requests", type=float,
        metavar="R", help="autoscale toward R ongoing requests per replica (Ray's default: 2)"),
    "replica_cpus": flag(
        "--ray-replica-cpus", dest="ray_replica_cpus", type=float, metavar="C",
        help="Ray CPUs per replica, and its torch threads unless AIOENGINE_CPU_THREADS is set "
             "(default: %(default)s)"),
    "max_ongoing_requests": flag(
        "--ray-max-ongoing-requests", dest="ray_max_ongoing_requests", type=int, metavar="N",
        help="requests a replica takes at once (default: %(default)s)"),
    "router": flag(
        "--ray-router", dest="ray_router", choices=ROUTERS,
        help="prefix: prefix-cache affinity, then power of two choices; pow2: Ray's default "
             "router (default: %(default)s)"),
    "max_imbalance": flag(
        "--ray-max-imbalance", dest="ray_max_imbalance", type=int, metavar="N",
        help="the affine replica is passed over when its queue is longer than the other's by "
             "more (default: %(default)s)"),
    "prefix_block_chars": flag(
        "--ray-prefix-block-chars", dest="ray_prefix_block_chars", type=int, metavar="N",
        help="prompt bytes per routing block (default: %(default)s)"),
    "max_adapters_per_replica": flag(
        "--ray-max-adapters-per-replica", dest="ray_max_adapters_per_replica", type=int,
        metavar="K",
        help="load the --lora-modules adapters on demand through Ray Serve's model "
             "multiplexing, at most K per replica (least recently used evicted), and route "
             "each adapter's requests to replicas that hold it; 0: every replica loads them "
             "all at start-up (default: %(default)s)"),
    "metrics_export_port": flag(
        "--ray-metrics-export-port", dest="ray_metrics_export_port", type=int, metavar="PORT",
        help="the port of Ray's Prometheus export, where every replica's engine metrics "
             "appear (a Ray started here; default: Ray's)"),
    "health_check_period_s": flag(
        "--ray-health-check-period", dest="ray_health_check_period", type=float, metavar="S",
        help="seconds between replica health checks (default: %(default)s)"),
    "graceful_shutdown_timeout_s": flag(
        "--ray-graceful-shutdown-timeout", dest="ray_graceful_shutdown_timeout", type=float,
        metavar="S",
        help="seconds a stopping replica's requests may run before Ray kills it (streams "
             "still running then end with an error event; default: %(default)s)"),
}


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """The --ray-* flags of `aioengine serve`."""
    add_dataclass_flags(
        parser.add_argument_group("Ray Serve scale-out (pip install 'aioengine[ray]')"),
        RayServeOptions, RAY_FLAGS)


def options_from_args(args: argparse.Namespace) -> RayServeOptions:
    """The RayServeOptions of parsed `serve` arguments (no --ray-replicas: one replica)."""
    values = flag_values(args, RAY_FLAGS)
    values["num_replicas"] = values["num_replicas"] or RayServeOptions.num_replicas
    return RayServeOptions(**values)
