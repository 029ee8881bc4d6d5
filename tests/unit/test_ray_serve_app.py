"""The Ray Serve application's configuration without a cluster: `build_app`'s arguments
as `aioengine serve` flags, and the deployment options the --ray-* flags give."""
from __future__ import annotations

from pathlib import Path

import pytest

from aioengine.serve_args import parse_serve_args
from aioengine.ray_serve.options import RayServeOptions, options_from_args

pytest.importorskip("ray.serve")

from aioengine.ray_serve.app import build_app, serve_argv  # noqa: E402
from aioengine.ray_serve.router import PrefixAffinityRouter  # noqa: E402


def test_build_app_arguments_are_serve_flags() -> None:
    argv = serve_argv({"ray-replicas": 2, "max_model_len": "4096", "model": "/m.gguf",
                       "enable-auto-tool-choice": "true", "tool-call-parser": "hermes",
                       "enable-lora": "false"})
    assert argv == ["/m.gguf", "--ray-replicas=2", "--max-model-len=4096",
                    "--enable-auto-tool-choice", "--tool-call-parser=hermes"]
    args = parse_serve_args(argv)
    assert (args.model_positional, args.ray_replicas, args.max_model_len) == ("/m.gguf", 2, 4096)
    assert type(build_app({"ray-replicas": 2})).__name__ == "Application"


def test_fixed_replicas_and_the_prefix_router() -> None:
    options = options_from_args(parse_serve_args(["--ray-replicas", "3",
                                                  "--ray-replica-cpus", "2"]))
    d = options.replica_deployment_options()
    assert d["num_replicas"] == 3 and "autoscaling_config" not in d
    assert d["ray_actor_options"]["num_cpus"] == 2.0
    assert d["max_ongoing_requests"] == 256 and d["health_check_period_s"] == 2.0
    router = d["request_router_config"]
    assert router.request_router_class.endswith("PrefixAffinityRouter")
    assert router.get_request_router_class().__name__ == PrefixAffinityRouter.__name__
    assert router.request_router_kwargs == {"max_imbalance": 8}
    pow2 = RayServeOptions(router="pow2").replica_deployment_options()
    assert "request_router_config" not in pow2


def test_autoscaling_passthrough_and_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIOENGINE_CPU_THREADS", raising=False)
    options = options_from_args(parse_serve_args(
        ["--ray-replicas", "2", "--ray-min-replicas", "1", "--ray-max-replicas", "4",
         "--ray-target-ongoing-requests", "16"]))
    d = options.replica_deployment_options()
    assert "num_replicas" not in d
    assert d["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4,
                                       "initial_replicas": 2, "target_ongoing_requests": 16}
    assert d["ray_actor_options"]["runtime_env"] == {"env_vars": {"AIOENGINE_CPU_THREADS": "1"}}
    with pytest.raises(ValueError):
        RayServeOptions(num_replicas=5, max_replicas=4)
    with pytest.raises(ValueError):
        RayServeOptions(num_replicas=0)
    with pytest.raises(SystemExit):  # Ray's proxy needs a port
        parse_serve_args(["--ray-replicas", "2", "--port", "0"])


def test_adapter_multiplexing_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="needs --lora-modules"):
        build_app({"ray-max-adapters-per-replica": 2})
    with pytest.raises(SystemExit):  # the serve flags' own check: needs --enable-lora
        build_app({"ray-max-adapters-per-replica": 2, "lora-modules": "a=/tmp/a"})
    with pytest.raises(ValueError):
        RayServeOptions(max_adapters_per_replica=-1)
    args = parse_serve_args(["--ray-replicas", "2", "--ray-max-adapters-per-replica", "3",
                             "--ray-metrics-export-port", "9100"])
    options = options_from_args(args)
    assert (options.max_adapters_per_replica, options.metrics_export_port) == (3, 9100)
    pirate = Path(__file__).parents[2] / "lora" / "examples" / "pirate"
    assert type(build_app({"ray-max-adapters-per-replica": 2, "lora-modules": f"a={pirate}",
                           "enable-lora": "true"})).__name__ == "Application"
