"""The `aioengine` command line: `aioengine serve [MODEL]` (the OpenAI-compatible server),
`aioengine generate "prompt" [--chat]`, `aioengine bench MODE ...` (benchmarks: offline,
serve, profile, latency, spec, structured, ...) and `aioengine train-eagle` (an EAGLE-3
draft head for a model). The engine flags are aioengine.config's `add_engine_args`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import TYPE_CHECKING

from aioengine import envs
from aioengine.config import add_engine_args, engine_default, engine_kwargs
from aioengine.ray_serve.options import add_ray_args

if TYPE_CHECKING:
    from aioengine.server.api_server import ServerConfig


def lora_modules_arg(text: str) -> list:
    """One `--lora-modules` value: name=path, a JSON object or a JSON list of them."""
    from aioengine.server.serving_models import parse_lora_modules

    return parse_lora_modules(text)


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


def lora_engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(enable_lora=args.enable_lora, max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)


async def _serve(args: argparse.Namespace) -> int:
    from aioengine import AsyncEngine
    from aioengine.config import ConfigError
    from aioengine.model.default import ModelNotFoundError
    from aioengine.model.loader import ModelLoadError
    from aioengine.server.api_server import bind_socket, serve
    from aioengine.server.serving_models import LoRAModuleError

    model = args.model_positional or args.model
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    try:
        names = args.served_model_name or [default_model_name(model)]
        engine = await AsyncEngine.create(model, served_model_name=names[0],
                                          **engine_kwargs(args), **lora_engine_kwargs(args))
    except (ConfigError, ModelLoadError, ModelNotFoundError, FileNotFoundError) as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        await serve(engine, names, server_config_from_args(args), sock)
    except LoRAModuleError as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of parsed `serve` arguments (a plain server or each Ray replica)."""
    from aioengine.server.api_server import ServerConfig

    return ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                        max_request_body_bytes=args.max_request_body_bytes,
                        lora_modules=tuple(args.lora_modules or ()),
                        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser,
                        chat_template=args.chat_template,
                        max_stored_responses=args.max_stored_responses,
                        max_queued_requests=args.max_queued_requests)


def _serve_on_ray(args: argparse.Namespace) -> int:
    try:
        from aioengine.ray_serve.app import run
    except ImportError as e:
        print(f"error: --ray-replicas needs Ray Serve: pip install 'aioengine[ray]' ({e})",
              file=sys.stderr)
        return 2
    return run(args)


def default_model_name(model: str | None) -> str:
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
    srv.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                     help="beyond N waiting requests new ones get 503 with Retry-After "
                          "(SGLang's flag; default: unlimited)")
    add_engine_args(srv)
    _add_lora_args(srv)
    _add_tool_args(srv)
    add_ray_args(srv)


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
    g.add_argument("--enable-lora", action="store_true", default=engine_default("enable_lora"),
                   help="serve PEFT LoRA adapters, each under its own model name")
    g.add_argument("--lora-modules", type=lora_modules_arg, nargs="+", action="extend",
                   default=None, metavar="NAME=PATH|JSON",
                   help="adapters loaded at start-up: name=path, or a JSON object "
                        '\'{"name": "name", "path": "lora_path", "base_model_name": "id"}\' '
                        "(base_model_name: its parent in /v1/models); several allowed")
    g.add_argument("--max-loras", type=int, default=engine_default("max_loras"),
                   help="distinct adapters in one batch (default: %(default)s)")
    g.add_argument("--max-lora-rank", type=int, default=engine_default("max_lora_rank"),
                   help="largest adapter rank that loads (default: %(default)s)")
    g.add_argument("--max-cpu-loras", type=int, default=engine_default("max_cpu_loras"),
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
    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        parser.error("--max-queued-requests must be >= 1")
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
    parser, subparsers = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        _check_serve_args(subparsers["serve"], args)
    logging.basicConfig(level=envs.AIOENGINE_LOG_LEVEL, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return asyncio.run(_generate(args))
    if args.command == "serve" and args.ray_replicas is not None:
        return _serve_on_ray(args)
    if args.command == "serve":
        return asyncio.run(_serve(args))
    return 1


def _check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    _check_lora_args(parser, args)
    _check_tool_args(parser, args)
    if args.ray_replicas is not None and args.port == 0:
        parser.error("--ray-replicas needs a --port (Ray's proxy cannot pick one)")


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """`aioengine serve ARGV` parsed and checked as the command line would be (Ray
    Serve's `build_app` builder takes its arguments this way)."""
    parser, subparsers = build_parser()
    args = parser.parse_args(["serve", *argv])
    _check_serve_args(subparsers["serve"], args)
    return args


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `aioengine` parser and its subcommands' parsers, by name."""
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
                   help="benchmarks: `aioengine bench --help` lists the modes")
    sub.add_parser("train-eagle", add_help=False,
                   help="train an EAGLE-3 draft head for a model: `aioengine train-eagle "
                        "--help`")
    return parser, sub.choices


if __name__ == "__main__":
    sys.exit(main())
