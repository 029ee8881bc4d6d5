"""Frozen configuration of one engine: EngineArgs, the one home of every engine default,
and SchedulerConfig built from it; the mechanism that generates flags from a dataclass's
fields (`add_dataclass_flags`), and with it the engine flags (`add_engine_args`,
`engine_kwargs`) that every command running the engine shares."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields
from typing import Any

import torch

from aioengine.kv.block_pool import PREFIX_CACHING_HASH_ALGOS
# ConfigError is defined with the other typed errors, so that aioengine.spec_decode.config
# need not import this module (no import circle); callers import it from here.
from aioengine.errors import ConfigError
from aioengine.generation_config import check_generation_config_setting
from aioengine.spec_decode.config import (DEFAULT_SPECULATIVE_CONFIG, METHODS,
                                          SpeculativeConfig, speculative_config_dict)
from aioengine.tracing import INSTALL_HINT, check_traces_endpoint

QUANTIZATIONS = ("int8", "w8a8", "gguf")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
SCHEDULING_POLICIES = ("fcfs", "priority")
# (query, key) pairs of a long prompt's chunk per step while other requests run or wait
# (sched/chunking.py): 90 tokens at position 0, 8 at 1,000, 1 at 8,000 (alone: 4x that);
# docs/benchmarks.md, "Fair prefill", measured 4x, 5x and 58x a short chat's TTFT for
# 8192, 16384 and none.
DEFAULT_PREFILL_ATTENTION_BUDGET = 8192
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineArgs:
    """Flat user-facing settings, vLLM's names. `model=None` is the bundled SmolLM2."""

    model: str | None = None
    # vLLM's tokenizer: a HF tokenizer directory or a .gguf file read instead of the model's
    # own (None: the model's).
    tokenizer: str | None = None
    dtype: str = "auto"
    # Quantization computed at load from any checkpoint: "int8" (weight-only, per output
    # channel scales) or "w8a8" (the same weights, activations quantized per token: integer
    # matmuls); "gguf" keeps a GGUF's own Q4_1 projection blocks; None keeps the weights in
    # `dtype`.
    quantization: str | None = None
    # "auto": on the CPU bf16 where the weights are bf16 (the C attention widens it as it
    # reads: half the bytes), else float32 (the activations' dtype); the model dtype on CUDA.
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # vLLM's name. sha256 (default): collisions cannot be crafted, so no request reads
    # another's KV; xxhash (xxh3_128) is faster but not cryptographic; builtin is
    # Python's hash(), trivially collidable (docs/architecture.md, "KV cache blocks").
    prefix_caching_hash_algo: str = "sha256"
    enable_chunked_prefill: bool = True
    # vLLM's name: a prompt chunk is at most this many tokens, so a long prompt leaves room
    # for decodes and short prompts in every step (the one in flight when they arrive too).
    # None: a quarter of max_num_batched_tokens; 0: off (a prompt takes the whole budget).
    long_prefill_token_threshold: int | None = None
    # A long prompt's chunk shrinks as its context grows: its tokens times the positions
    # they attend stay within this (sched/chunking.py). None: DEFAULT_PREFILL_ATTENTION_BUDGET;
    # 0: off (the token cap alone).
    long_prefill_attention_budget: int | None = None
    scheduling_policy: str = "fcfs"
    # Structured output: append grammar-forced tokens without sampling them one by one.
    structured_jump_forward: bool = True
    # Seconds one grammar compile may take (queueing included) before its request gets a
    # 400; xgrammar's C++ compile cannot be interrupted (structured/compiler.py).
    structured_outputs_compile_timeout: float = 10.0
    # AsyncEngine: schedule a decode step while the one before it runs, so the worker goes
    # straight on to it (Scheduler.schedule_ahead). The synchronous LLM never does.
    async_scheduling: bool = True
    # vLLM's speculative_config (a dict, its JSON text or a method's name), validated by
    # aioengine.spec_decode.SpeculativeConfig.parse; None = no speculative decoding. On by
    # default: "auto" drafts only where a request's drafts pay (spec_decode/auto.py).
    speculative_config: dict | str | None = DEFAULT_SPECULATIVE_CONFIG
    # Multi-LoRA (vLLM's names): adapters per step, their largest rank, adapters kept
    # loaded in CPU memory (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # The GPU path (vLLM's names). The attention backend: "auto" = triton on CUDA, torch
    # elsewhere; "triton" on the CPU runs under TRITON_INTERPRET=1 (tests only: slow).
    attention_backend: str = "auto"
    # CUDA: no CUDA graphs for decode steps (every step eager).
    enforce_eager: bool = False
    # CUDA: the share of the device's memory the engine may use (weights, activations of
    # the largest step, KV cache); the KV cache gets what the profiling run leaves.
    gpu_memory_utilization: float = 0.9
    # vLLM's name. The sampling defaults of a request that omits a field: "auto" the
    # model's own (generation_config.json, GGUF general.sampling.*, the bundled model's
    # shipped ones), "vllm" none (SamplingParams'), or a directory's generation_config.json.
    generation_config: str = "auto"
    # vLLM's name: export a trace of every request (OTLP, aioengine/tracing.py) to this
    # collector URL; the protocol is $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (http/protobuf by
    # default, or grpc). None: no tracing, and opentelemetry is never imported.
    otlp_traces_endpoint: str | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except RuntimeError as e:
            raise ConfigError(f"bad device {self.device!r}: {e}") from e

    def validate(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0, got "
                              f"{self.long_prefill_token_threshold}")
        if (self.long_prefill_attention_budget is not None
                and self.long_prefill_attention_budget < 0):
            raise ConfigError("long_prefill_attention_budget must be >= 0, got "
                              f"{self.long_prefill_attention_budget}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {list(QUANTIZATIONS)} or None, "
                              f"got {self.quantization!r}")
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ConfigError(f"prefix_caching_hash_algo must be one of "
                              f"{list(PREFIX_CACHING_HASH_ALGOS)}, "
                              f"got {self.prefix_caching_hash_algo!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory is not None and self.num_kv_blocks is not None:
            raise ConfigError("set kv_cache_memory or num_kv_blocks, not both")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} "
                              f"and {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                              f"({self.max_loras})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                              f"got {self.attention_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], "
                              f"got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ConfigError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")
        check_generation_config_setting(self.generation_config)
        if self.otlp_traces_endpoint is not None:
            check_traces_endpoint(self.otlp_traces_endpoint)  # the SDK installed, before loading


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs of EngineArgs, resolved (`from_engine_args`): its defaults
    are EngineArgs' (so the two cannot drift), but max_model_len, which only the loaded
    model resolves, and the speculative-decoding numbers, which its config gives."""
    max_model_len: int
    max_num_batched_tokens: int = EngineArgs.max_num_batched_tokens
    max_num_seqs: int = EngineArgs.max_num_seqs
    enable_chunked_prefill: bool = EngineArgs.enable_chunked_prefill
    long_prefill_token_threshold: int | None = EngineArgs.long_prefill_token_threshold
    long_prefill_attention_budget: int | None = EngineArgs.long_prefill_attention_budget
    # "fcfs" or "priority" (lower value first, then arrival): EngineArgs.scheduling_policy.
    policy: str = EngineArgs.scheduling_policy
    # Speculative decoding: drafts per request per step (0 = off), and the batch size above
    # which a step verifies none (None = no limit).
    num_speculative_tokens: int = 0
    spec_disable_by_batch_size: int | None = None
    # Speculation chosen per request (method "auto"): a step whose proposals found no draft
    # worth verifying lets the next ones rest from proposing (spec_decode/step.py).
    spec_rest_when_idle: bool = False
    # Slots allocated past each step's tokens for a draft head's chain (EAGLE: k).
    num_lookahead_tokens: int = 0

    @property
    def prefill_chunk_cap(self) -> int:
        """long_prefill_token_threshold resolved: 0 = no cap (chunked prefill off too)."""
        if not self.enable_chunked_prefill:
            return 0
        if self.long_prefill_token_threshold is None:
            return max(1, self.max_num_batched_tokens // 4)
        return self.long_prefill_token_threshold

    @property
    def prefill_attention_budget(self) -> int:
        """long_prefill_attention_budget resolved: 0 = none (also when chunks are uncapped)."""
        if not self.prefill_chunk_cap:
            return 0
        if self.long_prefill_attention_budget is None:
            return DEFAULT_PREFILL_ATTENTION_BUDGET
        return self.long_prefill_attention_budget

    @classmethod
    def from_engine_args(cls, args: EngineArgs, max_model_len: int,
                         spec: SpeculativeConfig | None = None,
                         num_lookahead_tokens: int = 0) -> SchedulerConfig:
        """The scheduler's settings of `args`, with the model's resolved `max_model_len`
        and the resolved speculative config (its draft head's lookahead slots)."""
        return cls(max_model_len=max_model_len,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   max_num_seqs=args.max_num_seqs,
                   enable_chunked_prefill=args.enable_chunked_prefill,
                   long_prefill_token_threshold=args.long_prefill_token_threshold,
                   long_prefill_attention_budget=args.long_prefill_attention_budget,
                   policy=args.scheduling_policy,
                   num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                   spec_disable_by_batch_size=spec.disable_by_batch_size if spec else None,
                   spec_rest_when_idle=spec is not None and spec.method == "auto",
                   num_lookahead_tokens=num_lookahead_tokens)


def gpu_kv_cache_budget(total: int, utilization: float, peak_torch: int,
                        non_torch: int) -> int:
    """vLLM's rule for the KV cache on a GPU: of `utilization` x the device's memory, what
    the profiling run's peak of torch memory (weights + the largest step's activations,
    without KV) and the memory outside torch (CUDA context, other processes) leave."""
    return max(0, int(total * utilization) - peak_torch - non_torch)


# ---- Flags from dataclasses ---------------------------------------------------------------
# Every flag of `aioengine` is generated from a field of the dataclass it sets (EngineArgs
# here; ServerConfig and the LoRA flags in aioengine.serve_args; RayServeOptions in
# aioengine.ray_serve.options; SamplingParams for `generate` in aioengine.cli): a table maps
# each field to its flag names and argparse options, and the flag's default is the field's,
# so the dataclass stays the one home of that default.

FlagSpec = tuple[tuple[str, ...], dict[str, Any]]


def flag(*names: str, **options: Any) -> FlagSpec:
    """A flag table entry: its names and argparse options. `dest` defaults to the field's
    name; `default` to the field's default and is given only where leaving the flag out
    means something else than the field's default (an environment variable, "not on Ray")."""
    return names, options


def field_defaults(owner: type) -> dict[str, Any]:
    """The dataclass `owner`'s fields that have a plain default, and those defaults."""
    return {f.name: f.default for f in fields(owner) if f.default is not MISSING}


def add_dataclass_flags(group: argparse._ActionsContainer, owner: type,
                        table: dict[str, FlagSpec]) -> None:
    """One flag per entry of `table` (keys: fields of the dataclass `owner`), in order."""
    defaults = field_defaults(owner)
    known = {f.name for f in fields(owner)}
    for name, (names, options) in table.items():
        if name not in known:
            raise KeyError(f"{owner.__name__} has no field {name!r} for flag {names[0]}")
        options = {"dest": name, **options}
        if "default" not in options:
            options["default"] = defaults[name]
        group.add_argument(*names, **options)


def flag_values(args: argparse.Namespace, table: dict[str, FlagSpec]) -> dict[str, Any]:
    """The parsed values of `table`'s flags, by field name."""
    return {name: getattr(args, options.get("dest", name))
            for name, (_, options) in table.items()}


# ---- Engine flags -------------------------------------------------------------------------
# `aioengine serve|generate` and every `aioengine bench` mode that runs our engine take the
# same flags, under vLLM's names, each generated from its EngineArgs field.

def speculative_config_arg(text: str) -> dict[str, Any] | str | None:
    """`--speculative-config`: vLLM's JSON object, a method's name, or none / null (off),
    validated here so a bad one stops the command before anything loads (with
    SpeculativeConfig's ConfigError message)."""
    try:
        SpeculativeConfig.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    # A bare method name stays the name, as EngineArgs' default is ("auto").
    return text.strip() if text.strip() in METHODS else speculative_config_dict(text)


_BOOL = argparse.BooleanOptionalAction
# EngineArgs field -> its flag (names, argparse options).
ENGINE_FLAGS: dict[str, FlagSpec] = {
    "model": flag("--model", help="HF directory or .gguf file (default: bundled "
                                  "SmolLM2-135M-Instruct)"),
    "tokenizer": flag("--tokenizer", help="a tokenizer used instead of the model's: a HF "
                                          "directory with tokenizer files, or a .gguf file "
                                          "(default: the model's)"),
    "dtype": flag("--dtype", help="weights: auto (bfloat16 on CPUs with AVX512-BF16 or AMX "
                                  "and on CUDA, else float32), float32, float16, bfloat16"),
    "quantization": flag(
        "--quantization", "-q", choices=QUANTIZATIONS,
        help="int8: weight-only int8 with per-output-channel scales, computed at load; w8a8: "
             "the same weights with activations quantized per token (integer matmuls: "
             "faster, less exact); gguf: a GGUF's own Q4_1 projections as stored (x "
             "quantized per 32-block)"),
    "kv_cache_dtype": flag("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                           help="auto: on the CPU bfloat16 with bf16 weights, else float32; "
                                "the model dtype on CUDA"),
    "device": flag("--device"),
    "seed": flag("--seed", type=int),
    "max_model_len": flag("--max-model-len", type=int),
    "max_num_seqs": flag("--max-num-seqs", type=int),
    "max_num_batched_tokens": flag("--max-num-batched-tokens", type=int),
    "block_size": flag("--block-size", type=int),
    "kv_cache_memory": flag("--kv-cache-memory", "--kv-cache-memory-bytes", type=int,
                            help="KV cache size in bytes"),
    "num_kv_blocks": flag("--num-kv-blocks", type=int, help="KV cache size in blocks"),
    "enable_prefix_caching": flag("--enable-prefix-caching", action=_BOOL),
    "prefix_caching_hash_algo": flag(
        "--prefix-caching-hash-algo", choices=PREFIX_CACHING_HASH_ALGOS,
        help="prefix-cache block hash: sha256 (default; collision-resistant), xxhash "
             "(xxh3_128: faster, not cryptographic), builtin (Python's hash(): one trusted "
             "tenant only)"),
    "enable_chunked_prefill": flag("--enable-chunked-prefill", action=_BOOL),
    "long_prefill_token_threshold": flag(
        "--long-prefill-token-threshold", type=int,
        help="largest prompt chunk of a step (default: a quarter of "
             "--max-num-batched-tokens; 0: off)"),
    "long_prefill_attention_budget": flag(
        "--long-prefill-attention-budget", type=int, metavar="PAIRS",
        help="a long prompt's chunk: at most this many (query, key) position pairs, so "
             "its steps stay short as its context grows (default "
             f"{DEFAULT_PREFILL_ATTENTION_BUDGET}; 0: off)"),
    "structured_jump_forward": flag("--structured-jump-forward", action=_BOOL,
                                    help="append grammar-forced tokens without sampling them"),
    "structured_outputs_compile_timeout": flag(
        "--structured-outputs-compile-timeout", type=float, metavar="SECONDS",
        help="budget of one grammar compile; a request whose grammar takes longer gets a 400"),
    "async_scheduling": flag("--async-scheduling", action=_BOOL,
                             help="schedule each decode step while the previous one runs"),
    "scheduling_policy": flag("--scheduling-policy", choices=SCHEDULING_POLICIES,
                              help="priority: lower `priority` first (the request body's "
                                   "vLLM extra)"),
    "speculative_config": flag(
        "--speculative-config", type=speculative_config_arg, metavar="JSON",
        help='speculative decoding, vLLM\'s JSON object, e.g. \'{"method": "ngram", '
             '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\''
             "; auto (the default): per request the best of suffix decoding, n-gram lookup "
             "and the model's shipped draft head, where drafts pay; none: off"),
    "attention_backend": flag("--attention-backend", choices=ATTENTION_BACKENDS,
                              help="auto: triton on CUDA, torch elsewhere"),
    "enforce_eager": flag("--enforce-eager", action=_BOOL,
                          help="CUDA: run every decode step eagerly (no CUDA graphs)"),
    "gpu_memory_utilization": flag("--gpu-memory-utilization", type=float,
                                   help="CUDA: share of device memory for the engine "
                                        "(default 0.9); the KV cache gets what is left"),
    "generation_config": flag(
        "--generation-config", metavar="auto|vllm|DIR",
        help="sampling defaults of a request that leaves a field out: auto = the model's "
             "(generation_config.json, GGUF general.sampling.*, the bundled model's), vllm = "
             "none (temperature 1, top_p 1), DIR = DIR/generation_config.json"),
    "otlp_traces_endpoint": flag(
        "--otlp-traces-endpoint", metavar="URL",
        help="export an OpenTelemetry trace of every request to this OTLP collector, e.g. "
             "http://127.0.0.1:4318/v1/traces (OTLP/HTTP; gRPC with "
             f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc); needs {INSTALL_HINT}"),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags, in an "engine" group."""
    add_dataclass_flags(parser.add_argument_group("engine"), EngineArgs, ENGINE_FLAGS)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs keywords from parsed engine flags; `model` is left to the caller (`serve`
    also takes it as a positional argument)."""
    values = flag_values(args, ENGINE_FLAGS)
    del values["model"]
    return values

