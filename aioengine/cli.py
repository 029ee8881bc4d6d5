"""The `aioengine` command line: `aioengine generate "prompt" [--chat]`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from aioengine import envs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine settings under vLLM's flag names."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto (float32 on CPU), float32, float16, bfloat16")
    g.add_argument("--device", default="auto")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype, device=args.device, seed=args.seed, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill)


async def _generate(args: argparse.Namespace) -> int:
    from aioengine import AsyncEngine, SamplingParams
    from aioengine.errors import InvalidRequestError

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sample_seed)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    async with await AsyncEngine.create(args.model, **engine_kwargs(args)) as engine:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aioengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream one completion to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None)
    add_engine_args(gen)
    args = parser.parse_args(argv)
    logging.basicConfig(level=envs.AIOENGINE_LOG_LEVEL, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return asyncio.run(_generate(args))
    return 1


if __name__ == "__main__":
    sys.exit(main())
