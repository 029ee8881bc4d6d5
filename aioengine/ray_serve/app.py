"""The Ray Serve application: its options, `build_application`, the `serve run` builder
`build_app` and `aioengine serve --ray-replicas N` (`run`)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import replace

from ray import serve
from ray.serve import Application

import aioengine
from aioengine.config import engine_kwargs
from aioengine.ray_serve.deployments import (EngineReplica, EngineReplicaConfig, IngressConfig,
                                             OpenAIIngress)
from aioengine.ray_serve.options import RayServeOptions, options_from_args
from aioengine.serve_args import (lora_engine_kwargs, parse_serve_args, serve_model,
                                  served_names, server_config_from_args)

logger = logging.getLogger("aioengine.ray_serve")

APP_NAME = "aioengine"


def build_application(replica: EngineReplicaConfig, options: RayServeOptions) -> Application:
    """OpenAIIngress (one, no CPU reserved) in front of the EngineReplica deployment."""
    engine = serve.deployment(**options.replica_deployment_options())(EngineReplica)
    ingress = serve.deployment(name="OpenAIIngress", num_replicas=1,
                               max_ongoing_requests=100_000,
                               ray_actor_options={"num_cpus": 0})(OpenAIIngress)
    multiplexed = options.max_adapters_per_replica > 0
    if multiplexed:
        if not replica.server.lora_modules:
            raise ValueError("--ray-max-adapters-per-replica needs --lora-modules")
        if not replica.engine_kwargs.get("enable_lora"):
            raise ValueError("--lora-modules needs --enable-lora")
    replica = replace(replica, max_adapters_per_replica=options.max_adapters_per_replica)
    config = IngressConfig(max_request_body_bytes=replica.server.max_request_body_bytes,
                           prefix_block_chars=options.prefix_block_chars,
                           lora_adapters=frozenset(m.name for m in replica.server.lora_modules),
                           multiplexed=multiplexed)
    return ingress.bind(engine.bind(replica), config)


def application_from_args(args: argparse.Namespace) -> Application:
    """The application for parsed `aioengine serve` arguments: each replica gets the same
    engine and server settings `aioengine serve` would use."""
    replica = EngineReplicaConfig(serve_model(args), served_names(args),
                                  {**engine_kwargs(args), **lora_engine_kwargs(args)},
                                  server_config_from_args(args))
    return build_application(replica, options_from_args(args))


def build_app(cli_args: dict[str, object]) -> Application:
    """`serve run aioengine.ray_serve:build_app ray-replicas=2 max-model-len=4096 ...` (or
    a Serve config file's `import_path` and `args`): each key is an `aioengine serve` flag
    without its dashes ("model" is the model), "true" turns a switch on."""
    return application_from_args(parse_serve_args(serve_argv(cli_args)))


def serve_argv(cli_args: dict[str, object]) -> list[str]:
    """`build_app`'s arguments as an `aioengine serve` command line."""
    argv: list[str] = []
    for key, value in cli_args.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        text = str(value)
        if flag == "--model":
            argv.insert(0, text)
        elif text.lower() == "true":
            argv.append(flag)
        elif text.lower() != "false":
            argv.append(f"{flag}={text}")
    return argv


def run(args: argparse.Namespace) -> int:
    """`aioengine serve --ray-replicas N`: deploys, prints the ready line, serves until
    SIGINT/SIGTERM, then deletes the application (replicas drain, see EngineReplica) and
    disconnects (a Ray started here stops with it)."""
    import ray

    try:
        app = application_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    started_here = not os.environ.get("RAY_ADDRESS")
    port = options_from_args(args).metrics_export_port
    # A local Ray, or the cluster at $RAY_ADDRESS (whose nodes have their own export ports).
    ray.init(**({"_metrics_export_port": port} if started_here and port else {}))
    # After ray.init: Ray's core worker installs a SIGTERM handler that aborts the process.
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # a replica's constructor kept failing (Ray's message)
            print(f"error: the engine replicas did not start: {e}", file=sys.stderr)
            return 1
        url_host = f"[{args.host}]" if ":" in args.host else args.host
        logger.info("aioengine %s ready: serving %s at http://%s:%d (OpenAI API under /v1; "
                    "%d Ray Serve replicas)", aioengine.__version__, served_names(args)[0],
                    url_host, args.port, args.ray_replicas)
        while not stop.wait(1.0):
            pass
        logger.info("shutting down: replicas get --ray-graceful-shutdown-timeout to finish")
    finally:
        serve.delete(APP_NAME)
        if started_here:
            serve.shutdown()
        ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    logger.info("server stopped")
    return 0
