"""Benchmarks for aioengine and any OpenAI-compatible server.

    aioengine bench offline [--engines aioengine,hf,hf-cb] [dataset flags] [engine flags]
    aioengine bench serve --base-url http://127.0.0.1:8000 [--endpoint completions|chat]
                          [--max-concurrency N | --request-rate R [--burstiness K]]
                          [--slo ttft:MS,tpot:MS] [dataset flags]

    aioengine bench profile [dataset flags] [engine flags]

    aioengine bench latency [--input-len 256 | --dataset text|grounded] [--output-len 128]
                            [--repeats 3] [--engines aioengine,hf] [engine flags]

    aioengine bench export-hf [MODEL.gguf] [--dtype float32]

    aioengine bench gguf FILE.gguf [--llama-server PATH] [--runs 2]

    aioengine bench spec [--specs off,ngram,eagle3:2,...] [--num-prompts N] [engine flags]

    aioengine bench structured [--num-prompts 16] [--output-len 96] [--repeats 3] [engine flags]

    aioengine bench compare A.json B.json --plot PATH.png   (also: bench --compare A B ...)

`offline` and `latency` take `--vllm-python PATH` (and `latency` `--llamacpp-python PATH`):
the python of a venv holding that peer, which then runs as one more engine in a child
process (aioengine/bench/peers.py, docs/peers.md). `export-hf` writes a GGUF as the Hugging
Face directory vLLM reads and prints its path. `gguf` serves one GGUF file with our server
and with llama-server in turn and compares start-up, memory, TPOT, concurrent and prefill
throughput (aioengine/bench/gguf_bench.py; random-weight files at real shapes:
`python -m aioengine.bench.real_shapes`).

All modes take `--dataset random|shared-prefix|text|grounded`, `--save-json PATH`,
`--plot PATH.png` and `--seed` (`latency`: `--dataset random|text|grounded`, no plot).
The engine flags include `--speculative-config JSON` (vLLM's); `offline` and `latency`
then report the drafts, accepted tokens and mean acceptance length of our engine.
`offline` runs the workload in-process through our engine and through
Hugging Face transformers (static batches, and its continuous batching) on the same
weights, and prints each engine's tok/s and our ratio to each. `serve` streams every
request and reports TTFT, TPOT, ITL and end-to-end latency percentiles and goodput.
`profile` runs the workload through AsyncEngine and prints its per-step timeline (with
`--plot`, draws it and each request's time: a PNG and a self-contained HTML); `compare`
draws two saved `profile` runs side by side.
`latency` times one request (TTFT, TPOT, ITL) through AsyncEngine and transformers and
compares TPOT with the weight-streaming floor (weight bytes / measured memory bandwidth).
`structured` runs chat prompts under a JSON schema, with and without jump-forward, and
unconstrained: TPOT, forward steps (the engine's step timeline, as `profile` reads it),
steps saved by jump-forward, bitmask cost and grammar compile times.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

AddParser = Callable[[Any], None]


def _mode_parsers() -> list[AddParser]:
    """Each mode's `add_*_parser`, in the order `--help` lists them. Each mode's module
    holds its parser and its `*_main`; the imports are deferred so that importing this
    package (the CLI does, for `aioengine bench ...`) loads no mode."""
    from aioengine.bench.accuracy import add_accuracy_parser
    from aioengine.bench.compare import add_compare_parser
    from aioengine.bench.gguf_bench import add_gguf_parser
    from aioengine.bench.hf_export import add_export_parser
    from aioengine.bench.latency import add_latency_parser
    from aioengine.bench.lora import add_lora_parser
    from aioengine.bench.offline import add_offline_parser
    from aioengine.bench.profile import add_profile_parser
    from aioengine.bench.serve import add_serve_parser
    from aioengine.bench.soak import add_soak_parser
    from aioengine.bench.spec import add_spec_parser
    from aioengine.bench.structured import add_structured_parser

    return [add_offline_parser, add_serve_parser, add_profile_parser, add_latency_parser,
            add_export_parser, add_gguf_parser, add_accuracy_parser, add_spec_parser,
            add_lora_parser, add_structured_parser, add_soak_parser, add_compare_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aioengine bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in _mode_parsers():
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`aioengine bench MODE ...`: parses the mode's flags and runs its `*_main`."""
    # Loading a GGUF draws a progress bar per tensor on stderr; silence tqdm's default
    # before anything imports it (it reads TQDM_* once). Our own bars pass `disable`
    # explicitly, which wins over the environment default.
    os.environ.setdefault("TQDM_DISABLE", "1")
    args = build_parser().parse_args(_compare_flag_as_mode(argv))
    return args.func(args)


def _compare_flag_as_mode(argv: list[str] | None) -> list[str] | None:
    """`aioengine bench --compare A.json B.json ...` (the spelling issue 54 asked for) is
    the `compare` mode: `aioengine bench compare A.json B.json ...`."""
    if argv and argv[0] == "--compare":
        return ["compare", *argv[1:]]
    return argv
