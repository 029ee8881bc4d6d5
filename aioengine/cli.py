"""The `aioengine` command line: `aioengine serve [MODEL]` (the OpenAI-compatible server),
`aioengine run-batch -i requests.jsonl -o results.jsonl` (an OpenAI Batch file),
`aioengine generate "prompt" [--chat]`, `aioengine bench MODE ...` (benchmarks: offline,
serve, profile, latency, spec, structured, ...) and `aioengine train-eagle` (an EAGLE-3
draft head for a model). The engine flags are aioengine.config's `add_engine_args`."""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys

from aioengine import envs
from aioengine.config import (FlagSpec, add_dataclass_flags, add_engine_args, engine_kwargs, flag,
                              flag_values)
from aioengine.sampling_params import SamplingParams
from aioengine.serve_args import (add_run_batch_args, add_serve_args, check_run_batch_args,
                                  check_serve_args, lora_engine_kwargs, run_batch_server_config,
                                  server_config_from_args, serve_model, served_names)


# The `serve` arguments are aioengine.serve_args' (Ray Serve's builder parses them too).

# SamplingParams field -> its `generate` flag. A command-line try-out is greedy and longer
# than an API request's default, so those two defaults are the command's own.
GENERATE_FLAGS: dict[str, FlagSpec] = {
    "max_tokens": flag("--max-tokens", type=int, default=128,
                       help="at most this many new tokens"),
    "temperature": flag("--temperature", type=float, default=0.0, help="0 = greedy"),
    "top_p": flag("--top-p", type=float),
    # --seed is the engine's (EngineArgs.seed): this one is the request's.
    "seed": flag("--sample-seed", dest="sample_seed", type=int,
                 help="the request's own RNG seed (default: the engine's RNG)"),
}


async def _generate(args: argparse.Namespace) -> int:
    from aioengine import AsyncEngine
    from aioengine.config import ConfigError
    from aioengine.errors import InvalidRequestError
    from aioengine.model.default import ModelNotFoundError
    from aioengine.model.loader import ModelLoadError

    params = SamplingParams(**flag_values(args, GENERATE_FLAGS))
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    try:
        engine = await AsyncEngine.create(args.model, **engine_kwargs(args))
    except (ConfigError, ModelLoadError, ModelNotFoundError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _started()
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


async def _serve(args: argparse.Namespace) -> int:
    from aioengine import AsyncEngine
    from aioengine.config import ConfigError
    from aioengine.model.default import ModelNotFoundError
    from aioengine.model.loader import ModelLoadError
    from aioengine.server.api_server import bind_socket, serve
    from aioengine.server.serving_models import LoRAModuleError

    model = serve_model(args)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    try:
        names = list(served_names(args))
        engine = await AsyncEngine.create(model, served_model_name=names[0],
                                          **engine_kwargs(args), **lora_engine_kwargs(args))
    except (ConfigError, ModelLoadError, ModelNotFoundError, FileNotFoundError) as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    _started()
    try:
        await serve(engine, names, server_config_from_args(args), sock)
    except (LoRAModuleError, ConfigError) as e:  # ConfigError: --reasoning-parser's tokens
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


async def _run_batch(args: argparse.Namespace) -> int:
    from aioengine import AsyncEngine
    from aioengine.config import ConfigError
    from aioengine.errors import EngineDeadError
    from aioengine.model.default import ModelNotFoundError
    from aioengine.model.loader import ModelLoadError
    from aioengine.server.api_server import build_serving_context
    from aioengine.server.batch import run_batch_file
    from aioengine.server.serving_models import LoRAModuleError

    try:
        names = list(served_names(args))
        engine = await AsyncEngine.create(serve_model(args), served_model_name=names[0],
                                          **engine_kwargs(args), **lora_engine_kwargs(args))
    except (ConfigError, ModelLoadError, ModelNotFoundError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _started()
    async with engine:
        try:
            ctx = await build_serving_context(engine, names, run_batch_server_config(args))
        except (LoRAModuleError, ConfigError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            summary = await run_batch_file(ctx, args.input_file, args.output_file,
                                           args.max_concurrent_requests,
                                           progress=not args.no_progress)
        except EngineDeadError as e:
            print(f"error: the engine stopped: {e}; the lines it did not finish have no "
                  "record, run the same command again to resume", file=sys.stderr)
            return 1
        finally:
            ctx.work.shutdown()
    print(summary.line(), file=sys.stderr)
    return 0


def _started() -> None:
    """The engine is up: the garbage collector back on (aioengine/__main__.py turns it off
    for the start-up), everything alive now frozen out of its collections."""
    gc.enable()
    gc.freeze()


def _serve_on_ray(args: argparse.Namespace) -> int:
    try:
        from aioengine.ray_serve.app import run
    except ImportError as e:
        print(f"error: --ray-replicas needs Ray Serve: pip install 'aioengine[ray]' ({e})",
              file=sys.stderr)
        return 2
    return run(args)


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
        check_serve_args(subparsers["serve"], args)
    if args.command == "run-batch":
        check_run_batch_args(subparsers["run-batch"], args)
    logging.basicConfig(level=envs.AIOENGINE_LOG_LEVEL, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return asyncio.run(_generate(args))
    if args.command == "serve" and args.ray_replicas is not None:
        return _serve_on_ray(args)
    if args.command == "serve":
        return asyncio.run(_serve(args))
    if args.command == "run-batch":
        return asyncio.run(_run_batch(args))
    return 1


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `aioengine` parser and its subcommands' parsers, by name."""
    parser = argparse.ArgumentParser(prog="aioengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    add_run_batch_args(sub.add_parser(
        "run-batch", help="run an OpenAI Batch file (chat, completions) through the engine"))
    gen = sub.add_parser("generate", help="stream one completion to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_dataclass_flags(gen.add_argument_group("sampling"), SamplingParams, GENERATE_FLAGS)
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
