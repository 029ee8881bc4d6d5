"""The `aioengine` command line: `aioengine serve [MODEL]` (the OpenAI-compatible server),
`aioengine generate "prompt" [--chat]`, `aioengine bench offline|serve|profile|latency|spec ...`
(benchmarks) and `aioengine train-eagle` (an EAGLE-3 draft head for a model)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from aioengine import envs


def speculative_config_arg(text: str) -> dict[str, Any]:
    """`--speculative-config`: vLLM's JSON object, validated here so a bad one stops the
    command before anything loads (with SpeculativeConfig's ConfigError message)."""
    import json

    from aioengine.config import ConfigError
    from aioengine.spec_decode.config import SpeculativeConfig

    try:
        SpeculativeConfig.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return json.loads(text)


def lora_modules_arg(text: str) -> list:
    """One `--lora-modules` value: name=path, a JSON object or a JSON list of them."""
    from aioengine.server.serving_models import parse_lora_modules

    return parse_lora_modules(text)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine settings under vLLM's flag names."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto",
                   help="weights: auto (bfloat16 on CPUs with AVX512-BF16 or AMX and on CUDA, "
                        "else float32), float32, float16, bfloat16")
    g.add_argument("--quantization", "-q", choices=("int8", "w8a8", "gguf"), default=None,
                   help="int8: weight-only int8 with per-output-channel scales, computed at "
                        "load; w8a8: the same weights with activations quantized per token "
                        "(integer matmuls: faster, less exact); gguf: a GGUF's own Q4_1 projections "
                        "as stored (x quantized per 32-block)")
    g.add_argument("--kv-cache-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: float32 on the CPU, the model dtype on CUDA")
    g.add_argument("--device", default="auto")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache size in bytes")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--structured-jump-forward", action=argparse.BooleanOptionalAction,
                   default=True, help="append grammar-forced tokens without sampling them")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule each decode step while the previous one runs")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="priority: lower `priority` first (the request body's vLLM extra)")
    g.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                   metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON object, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                        '"prompt_lookup_max": 5}\' (default: off)')


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        device=args.device, seed=args.seed, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        structured_jump_forward=args.structured_jump_forward,
        async_scheduling=args.async_scheduling, scheduling_policy=args.scheduling_policy,
        speculative_config=args.speculative_config)


async def _generate(args: argparse.Namespace) -> int:
    from aioengine import AsyncEngine, SamplingParams
    from aioengine.config import ConfigError
    from aioengine.errors import InvalidRequestError
    from aioengine.model.default import ModelNotFoundError
    from aioengine.model.loader import ModelLoadError

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sample_seed)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    try:
        engine = await AsyncEngine.create(args.model, **engine_kwargs(args))
    except (ConfigError, ModelLoadError, ModelNotFoundError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    async with engine:
        try:
            async for out in engine.generate(prompt, params):
                for completion in out.outputs:
                    sys.stdout.write(completion.text)
                    sys.stdout.flush()
        except InvalidRequestError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    sys.stdout.write("\n")
    return 0


def _lora_engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(enable_lora=args.enable_lora, max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)


async def _serve(args: argparse.Namespace) -> int:
    from aioengine import AsyncEngine
    from aioengine.config import ConfigError
    from aioengine.model.default import ModelNotFoundError
    from aioengine.model.loader import ModelLoadError
    from aioengine.server.api_server import ServerConfig, bind_socket, serve
    from aioengine.server.serving_models import LoRAModuleError

    model = args.model_positional or args.model
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    try:
        names = args.served_model_name or [_default_model_name(model)]
        engine = await AsyncEngine.create(model, served_model_name=names[0],
                                          **engine_kwargs(args), **_lora_engine_kwargs(args))
    except (ConfigError, ModelLoadError, ModelNotFoundError, FileNotFoundError) as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                          max_request_body_bytes=args.max_request_body_bytes,
                          lora_modules=tuple(args.lora_modules or ()),
                          allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                          enable_auto_tool_choice=args.enable_auto_tool_choice,
                          tool_call_parser=args.tool_call_parser,
                          chat_template=args.chat_template,
                          max_stored_responses=args.max_stored_responses)
    try:
        await serve(engine, names, config, sock)
    except LoRAModuleError as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _default_model_name(model: str | None) -> str:
    """The model as given (vLLM's rule); the bundled one by its file name's stem."""
    from aioengine.model.loader import resolve_model_path

    if model is not None:
        return model
    return os.path.basename(resolve_model_path(None)).split(".")[0]


def _add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("model_positional", nargs="?", metavar="MODEL", default=None,
                     help="HF directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    srv.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    srv.add_argument("--served-model-name", nargs="+", default=None,
                     help="model name(s) in the API (default: MODEL)")
    srv.add_argument("--api-key", default=envs.AIOENGINE_API_KEY,
                     help="require `Authorization: Bearer KEY` on /v1/* "
                          "(default: $AIOENGINE_API_KEY)")
    srv.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                     help="larger request bodies get a 413")
    add_engine_args(srv)
    _add_lora_args(srv)
    _add_tool_args(srv)


def _add_tool_args(parser: argparse.ArgumentParser) -> None:
    """Tool calling, chat templates and the Responses API under vLLM's flag names."""
    from aioengine.server.tool_parsers import TOOL_PARSERS

    g = parser.add_argument_group("tool calling and chat")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto", the default '
                        "when a request has tools); needs --tool-call-parser")
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the model's tool-call format, read back into tool_calls and used "
                        "for constrained calls (default for forced calls: hermes)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING",
                   help="a Jinja chat template (a file, or the template itself) instead of "
                        "the model's")
    g.add_argument("--max-stored-responses", type=int, default=1024,
                   help="responses kept for previous_response_id and GET /v1/responses/ID "
                        "(least recently stored dropped first; default: 1024)")


def _add_lora_args(parser: argparse.ArgumentParser) -> None:
    """Multi-LoRA under vLLM's flag names (serve only)."""
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters, each under its own model name")
    g.add_argument("--lora-modules", type=lora_modules_arg, nargs="+", action="extend",
                   default=None, metavar="NAME=PATH|JSON",
                   help="adapters loaded at start-up: name=path, or a JSON object "
                        '\'{"name": "name", "path": "lora_path", "base_model_name": "id"}\' '
                        "(base_model_name: its parent in /v1/models); several allowed")
    g.add_argument("--max-loras", type=int, default=1,
                   help="distinct adapters in one batch (default: 1)")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help="largest adapter rank that loads (default: 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in CPU memory, least recently used evicted and read "
                        "again when needed (default: --max-loras)")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; for trusted clients only)")


def _check_tool_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--enable-auto-tool-choice needs a parser; --chat-template is read now."""
    from aioengine.server.chat_prompt import load_chat_template

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.max_stored_responses < 0:
        parser.error("--max-stored-responses must be >= 0")
    if args.chat_template is not None:
        try:
            args.chat_template = load_chat_template(args.chat_template)
        except (OSError, ValueError) as e:
            parser.error(str(e))


def _check_lora_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flattens --lora-modules; LoRA flags without --enable-lora and adapter directories
    that do not exist stop the command before anything loads."""
    args.lora_modules = [m for group in args.lora_modules or () for m in group]
    given = [flag for flag, on in (("--lora-modules", args.lora_modules),
                                   ("--allow-runtime-lora-updating",
                                    args.allow_runtime_lora_updating)) if on]
    if given and not args.enable_lora:
        parser.error(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} "
                     f"--enable-lora")
    for m in args.lora_modules:
        if not os.path.isdir(m.path):
            parser.error(f"--lora-modules {m.name}={m.path}: no LoRA adapter directory at "
                         f"{m.path!r}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        # Everything after `bench` belongs to the benchmark's own parser (its --help too).
        from aioengine.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["train-eagle"]:
        from aioengine.spec_decode.train.cli import main as train_main

        return train_main(argv[1:])
    parser = argparse.ArgumentParser(prog="aioengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
    gen = sub.add_parser("generate", help="stream one completion to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None)
    add_engine_args(gen)
    # Listed for --help; main() hands `bench ...` to aioengine.bench before parsing.
    sub.add_parser("bench", add_help=False,
                   help="benchmarks: `aioengine bench offline|serve|profile|latency --help`")
    sub.add_parser("train-eagle", add_help=False,
                   help="train an EAGLE-3 draft head for a model: `aioengine train-eagle "
                        "--help`")
    args = parser.parse_args(argv)
    if args.command == "serve":
        _check_lora_args(sub.choices["serve"], args)
        _check_tool_args(sub.choices["serve"], args)
    logging.basicConfig(level=envs.AIOENGINE_LOG_LEVEL, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return asyncio.run(_generate(args))
    if args.command == "serve":
        return asyncio.run(_serve(args))
    return 1


if __name__ == "__main__":
    sys.exit(main())
