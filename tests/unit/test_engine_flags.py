"""The engine flags (aioengine.config): EngineArgs is the one home of their defaults, the
CLI and the benchmarks share them, bench never imports the CLI; and `--tokenizer`. The
configs built from EngineArgs (SchedulerConfig, LoRAConfig) take its defaults, and the
`serve` flags are generated from ServerConfig and RayServeOptions (aioengine.serve_args)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aioengine.cli import build_parser as cli_parser
from aioengine.config import ENGINE_FLAGS, EngineArgs, SchedulerConfig, engine_kwargs
from aioengine.lora.manager import LoRAConfig
from aioengine.model.loader import ModelLoadError, load_model

from tests.tiny_models import bundled_tokenizer, make_tiny_model_dir

LORA_FIELDS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
# Every engine flag and its aliases (those of aioengine/cli.py before they moved, and
# --tokenizer, --prefix-caching-hash-algo, --otlp-traces-endpoint since).
FLAG_NAMES = {
    "--model", "--tokenizer", "--dtype", "--quantization", "-q", "--kv-cache-dtype",
    "--device", "--seed", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
    "--block-size", "--kv-cache-memory", "--kv-cache-memory-bytes", "--num-kv-blocks",
    "--enable-prefix-caching", "--enable-chunked-prefill", "--structured-jump-forward",
    "--async-scheduling", "--scheduling-policy", "--speculative-config",
    "--prefix-caching-hash-algo", "--attention-backend", "--enforce-eager",
    "--no-enforce-eager", "--gpu-memory-utilization",
    "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
    "--no-structured-jump-forward", "--no-async-scheduling", "--long-prefill-token-threshold",
    "--structured-outputs-compile-timeout", "--long-prefill-attention-budget",
    "--generation-config", "--otlp-traces-endpoint"}
# The other flags of `serve`: its own, LoRA, tool calling and --ray-* (those of
# aioengine/cli.py before they were generated from their dataclasses).
SERVE_FLAG_NAMES = {
    "-h", "--help", "--host", "--port", "--served-model-name", "--api-key",
    "--max-request-body-bytes", "--max-queued-requests", "--enable-lora", "--lora-modules",
    "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--allow-runtime-lora-updating",
    "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser", "--chat-template",
    "--max-stored-responses", "--ray-replicas", "--ray-min-replicas", "--ray-max-replicas",
    "--ray-target-ongoing-requests", "--ray-replica-cpus", "--ray-max-ongoing-requests",
    "--ray-router", "--ray-max-imbalance", "--ray-prefix-block-chars",
    "--ray-max-adapters-per-replica", "--ray-metrics-export-port",
    "--ray-health-check-period", "--ray-graceful-shutdown-timeout",
    "--metrics-without-api-key", "--keepalive-timeout", "--body-read-timeout",
    "--max-connections", "--stream-write-timeout", "--pooling", "--allowed-hosts",
    "--allowed-origins", "--trust-message-special-tokens", "--max-json-depth",
    "--max-pooling-inputs", "--max-stop-strings", "--max-stop-chars", "--max-logit-bias",
    "--max-tools", "--max-schema-bytes", "--max-stored-response-bytes"}


def _parsed(command: list[str]):
    return cli_parser()[0].parse_args(command)


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_cli_defaults_are_engine_args_defaults(command: list[str]) -> None:
    args = _parsed(command)
    defaults = EngineArgs()
    checked = [f.name for f in dataclasses.fields(EngineArgs) if hasattr(args, f.name)]
    assert set(ENGINE_FLAGS) <= set(checked)
    if command[0] == "serve":
        assert set(LORA_FIELDS) <= set(checked)
    for name in checked:
        assert getattr(args, name) == getattr(defaults, name), name
    assert EngineArgs(model=args.model, **engine_kwargs(args)) == defaults


def test_bench_defaults_are_engine_args_defaults() -> None:
    from aioengine.bench import build_parser

    args = build_parser().parse_args(["latency"])
    assert EngineArgs(model=args.model, **engine_kwargs(args)) == EngineArgs()


def test_every_flag_keeps_its_name() -> None:
    parser = cli_parser()[1]["generate"]
    names = {opt for action in parser._actions for opt in action.option_strings
             if action.dest in ENGINE_FLAGS}
    assert names == FLAG_NAMES
    args = _parsed(["generate", "hi", "-q", "int8", "--kv-cache-memory-bytes", "4096",
                    "--no-enable-prefix-caching", "--max-num-seqs", "3",
                    "--tokenizer", "/tok", "--enforce-eager", "--gpu-memory-utilization", "0.5",
                    "--attention-backend", "torch"])
    kwargs = engine_kwargs(args)
    assert (kwargs["enforce_eager"], kwargs["gpu_memory_utilization"]) == (True, 0.5)
    assert kwargs["attention_backend"] == "torch"
    assert (kwargs["quantization"], kwargs["kv_cache_memory"]) == ("int8", 4096)
    assert (kwargs["enable_prefix_caching"], kwargs["max_num_seqs"]) == (False, 3)
    assert kwargs["tokenizer"] == "/tok" and "model" not in kwargs


def test_configs_built_from_engine_args_take_its_defaults() -> None:
    """Every field SchedulerConfig or LoRAConfig shares with EngineArgs has its default,
    and built from EngineArgs() each is its own default (max_model_len aside, which only
    the model resolves): no default of theirs can drift from EngineArgs'."""
    engine = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    for config in (SchedulerConfig, LoRAConfig):
        # max_model_len has none (the model resolves EngineArgs' None).
        shared = [f for f in dataclasses.fields(config) if f.name in engine
                  and (config, f.name) != (SchedulerConfig, "max_model_len")]
        assert shared, config
        for f in shared:
            assert f.default == engine[f.name], (config.__name__, f.name)
    assert SchedulerConfig.from_engine_args(EngineArgs(), 96) == SchedulerConfig(max_model_len=96)
    assert LoRAConfig.from_engine_args(EngineArgs()) == LoRAConfig()


def test_configs_built_from_engine_args_take_its_values() -> None:
    args = EngineArgs(max_num_batched_tokens=77, max_num_seqs=5, scheduling_policy="priority",
                      enable_chunked_prefill=False, enable_lora=True, max_loras=3,
                      max_lora_rank=8, max_cpu_loras=6)
    config = SchedulerConfig.from_engine_args(args, 128, num_lookahead_tokens=2)
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.policy) == (
        77, 5, "priority")
    assert config.enable_chunked_prefill is False
    assert (config.max_model_len, config.num_lookahead_tokens) == (128, 2)
    assert config.num_speculative_tokens == 0 and config.spec_disable_by_batch_size is None
    assert LoRAConfig.from_engine_args(args) == LoRAConfig(3, 8, 6)


def test_serve_flag_defaults_are_their_dataclasses_defaults(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from aioengine.ray_serve.options import RayServeOptions, options_from_args
    from aioengine.serve_args import parse_serve_args, server_config_from_args
    from aioengine.server.server_config import ServerConfig

    monkeypatch.delenv("AIOENGINE_API_KEY", raising=False)
    args = parse_serve_args([])
    assert server_config_from_args(args) == ServerConfig()
    assert options_from_args(args) == RayServeOptions()
    assert args.ray_replicas is None  # not on Ray unless --ray-replicas is given
    monkeypatch.setenv("AIOENGINE_API_KEY", "k")
    assert server_config_from_args(parse_serve_args([])).api_key == "k"


def test_every_serve_flag_keeps_its_name_and_dest() -> None:
    from aioengine.serve_args import parse_serve_args, server_config_from_args

    parser = cli_parser()[1]["serve"]
    names = {opt for action in parser._actions for opt in action.option_strings
             if action.dest not in ENGINE_FLAGS}
    assert names == SERVE_FLAG_NAMES
    args = parse_serve_args(["--host", "::", "--port", "9", "--api-key", "k",
                             "--max-queued-requests", "4", "--max-stored-responses", "0",
                             "--ray-replicas", "3", "--ray-health-check-period", "1.5",
                             "--ray-graceful-shutdown-timeout", "7", "--ray-router", "pow2"])
    config = server_config_from_args(args)
    assert (config.host, config.port, config.api_key) == ("::", 9, "k")
    limits = server_config_from_args(parse_serve_args(
        ["--max-tools", "3", "--max-json-depth", "9", "--allowed-hosts", "a", "b"]))
    assert (limits.limits.max_tools, limits.limits.max_json_depth) == (3, 9)
    assert server_config_from_args(parse_serve_args(
        ["--reasoning-parser", "qwen3"])).reasoning_parser == "qwen3"
    assert limits.allowed_hosts == ("a", "b")
    assert (config.max_queued_requests, config.max_stored_responses) == (4, 0)
    assert (args.ray_replicas, args.ray_health_check_period) == (3, 1.5)
    assert (args.ray_graceful_shutdown_timeout, args.ray_router) == (7.0, "pow2")


def test_bench_does_not_import_the_cli() -> None:
    code = ("import sys; from aioengine.bench import build_parser; build_parser(); "
            "assert 'aioengine.cli' not in sys.modules, 'bench imported aioengine.cli'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def marked_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled tokenizer saved with a chat template of its own, to tell it apart."""
    out = tmp_path_factory.mktemp("tokenizer")
    tokenizer = bundled_tokenizer()
    template = tokenizer.chat_template
    tokenizer.chat_template = "MARKED {{ messages[0]['content'] }}"
    try:
        tokenizer.save_pretrained(out)
    finally:
        tokenizer.chat_template = template  # the cached tokenizer is shared
    return out


def test_load_model_uses_the_given_tokenizer(tiny_dir: Path, marked_tokenizer_dir: Path) -> None:
    cpu = torch.device("cpu")
    own = load_model(str(tiny_dir), torch.float32, cpu)
    assert not own.tokenizer.chat_template.startswith("MARKED")
    other = load_model(str(tiny_dir), torch.float32, cpu, tokenizer=str(marked_tokenizer_dir))
    assert other.tokenizer.chat_template.startswith("MARKED")
    assert other.model_path == own.model_path
    with pytest.raises(ModelLoadError, match="is not a directory or a .gguf file"):
        load_model(str(tiny_dir), torch.float32, cpu, tokenizer=str(tiny_dir / "nope"))


def test_engine_args_tokenizer_reaches_the_engine(tiny_dir: Path,
                                                  marked_tokenizer_dir: Path) -> None:
    from aioengine import LLM

    llm = LLM(str(tiny_dir), tokenizer=str(marked_tokenizer_dir), dtype="float32",
              num_kv_blocks=16, max_model_len=64)
    assert llm.tokenizer.chat_template.startswith("MARKED")


def test_python_dash_m_aioengine_is_the_cli() -> None:
    """`python -m aioengine` (and the `aioengine` script) run the CLI through
    aioengine/__main__.py, which pauses the garbage collector while it starts."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "aioengine", "serve", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--long-prefill-attention-budget" in done.stdout
