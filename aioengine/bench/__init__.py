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
`profile` runs the workload through AsyncEngine and prints its per-step timeline.
`latency` times one request (TTFT, TPOT, ITL) through AsyncEngine and transformers and
compares TPOT with the weight-streaming floor (weight bytes / measured memory bandwidth).
`structured` runs chat prompts under a JSON schema, with and without jump-forward, and
unconstrained: TPOT, forward steps (the engine's step timeline, as `profile` reads it),
steps saved by jump-forward, bitmask cost and grammar compile times.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from typing import Any

from aioengine.bench.common import emit, run_config, set_threads


def _common_args(p: argparse.ArgumentParser) -> None:
    from aioengine.bench.datasets import add_dataset_args

    add_dataset_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--save-json", default=None, metavar="PATH",
                   help="config, environment, summary and per-request numbers")
    g.add_argument("--plot", default=None, metavar="PATH.png")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_offline_parser(sub: Any) -> None:
    from aioengine.bench.offline import OUR_ENGINE, RUNNERS, parse_engines
    from aioengine.config import add_engine_args

    p = sub.add_parser("offline", help="one batch of requests, all at once, vs transformers")
    _common_args(p)
    p.add_argument("--hf-batch-size", type=int, default=16,
                   help="static batch size of the transformers `generate` baseline")
    p.add_argument("--engines", type=parse_engines, default=[OUR_ENGINE, "hf", "hf-cb"],
                   help=f"comma-separated, run in order, from {sorted(RUNNERS)}")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for every engine (default: os.cpu_count())")
    # The engine flags (vLLM names) are the CLI's (aioengine.config); their --seed
    # seeds both the workload and the engine, and --model names the weights for all.
    add_engine_args(p)
    from aioengine.bench.peers import OFFLINE_PEERS, add_peer_args

    add_peer_args(p, OFFLINE_PEERS)
    p.set_defaults(func=offline_main)


def _add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="stream requests to an OpenAI-compatible server")
    p.add_argument("--base-url", required=True, help="http://HOST:PORT (a trailing /v1 is fine)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="model name in the API (default: the "
                   "server's first in /v1/models)")
    p.add_argument("--tokenizer", default=None, help="HF directory or .gguf for the dataset "
                   "(default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: unbounded)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (default: inf, all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier")
    p.add_argument("--slo", default=None, metavar="ttft:MS,tpot:MS",
                   help="goodput counts requests within every bound (also e2el:MS)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival times")
    _common_args(p)
    p.set_defaults(func=serve_main)


def offline_main(args: argparse.Namespace) -> int:
    from aioengine.bench import report as rep
    from aioengine.bench.datasets import build_workload
    from aioengine.bench.offline import load_hf_tokenizer, run_offline
    from aioengine.bench.peers import OFFLINE_PEERS, with_peers
    from aioengine.model.default import bundled_model_path

    args.engines = with_peers(args.engines, args, OFFLINE_PEERS)
    set_threads(args.threads)
    model = args.model or bundled_model_path()
    workload = build_workload(args, load_hf_tokenizer(args.tokenizer or model))
    report = {"mode": "offline", "environment": rep.environment_info(), "model": model,
              "config": run_config(args), "workload": workload.summary(),
              **run_offline(args, workload, model, progress=not args.no_progress)}
    emit(report, rep.format_offline(report), args.save_json)
    if args.plot:
        rep.plot_offline(args.plot, report)
        print(f"saved {args.plot}", file=sys.stderr)
    return 0


def serve_main(args: argparse.Namespace) -> int:
    from aioengine.bench import report as rep
    from aioengine.bench.datasets import build_workload, with_text
    from aioengine.bench.metrics import parse_slo, summarize
    from aioengine.bench.offline import load_hf_tokenizer
    from aioengine.bench.serve import ServeConfig, run_serve
    from aioengine.model.default import bundled_model_path

    slo = parse_slo(args.slo)
    tokenizer = load_hf_tokenizer(args.tokenizer or bundled_model_path())
    workload = build_workload(args, tokenizer)
    if args.endpoint == "chat":
        workload = with_text(workload, tokenizer)
    config = ServeConfig(base_url=args.base_url, endpoint=args.endpoint, model=args.model,
                         api_key=args.api_key, max_concurrency=args.max_concurrency,
                         request_rate=args.request_rate, burstiness=args.burstiness,
                         seed=args.seed, temperature=args.temperature,
                         timeout_s=args.timeout, progress=not args.no_progress)
    results, duration, model = asyncio.run(run_serve(config, workload))
    report = {"mode": "serve", "environment": rep.environment_info(), "model": model,
              "config": run_config(args), "workload": workload.summary(),
              "summary": summarize(results, duration, slo),
              "requests": [r.to_json() for r in results]}
    emit(report, rep.format_serve(report), args.save_json)
    if args.plot:
        rep.plot_serve(args.plot, results, duration,
                       f"{model} via {args.endpoint}: {len(results)} requests")
        print(f"saved {args.plot}", file=sys.stderr)
    return 0 if report["summary"]["failed_requests"] == 0 else 1


def _add_profile_parser(sub: Any) -> None:
    from aioengine.config import add_engine_args

    p = sub.add_parser("profile", help="the engine's per-step timeline on a workload")
    _common_args(p)
    add_engine_args(p)
    p.set_defaults(func=profile_main)


def profile_main(args: argparse.Namespace) -> int:
    from aioengine.bench import report as rep
    from aioengine.bench.datasets import build_workload
    from aioengine.bench.offline import load_hf_tokenizer
    from aioengine.bench.profile import format_profile, run_profile
    from aioengine.config import engine_kwargs
    from aioengine.model.default import bundled_model_path

    model = args.model or bundled_model_path()
    workload = build_workload(args, load_hf_tokenizer(args.tokenizer or model))
    report = {"mode": "profile", "environment": rep.environment_info(), "model": model,
              "config": run_config(args), "workload": workload.summary(),
              **asyncio.run(run_profile(workload, model, engine_kwargs(args)))}
    emit(report, format_profile(report), args.save_json)
    return 0


def _add_latency_parser(sub: Any) -> None:
    from aioengine.bench.latency import LATENCY_DATASETS, LATENCY_ENGINES, parse_latency_engines
    from aioengine.config import add_engine_args

    p = sub.add_parser("latency", help="one request: TTFT, TPOT vs the weight-streaming floor")
    p.add_argument("--dataset", choices=LATENCY_DATASETS, default="random",
                   help="random: --input-len random tokens; text, grounded: one prompt of "
                        "that shipped dataset (chosen by --seed; grounded ones are answered "
                        "largely from the prompt, for --speculative-config ngram)")
    p.add_argument("--input-len", type=int, default=256,
                   help="random-token prompt length (seeded by --seed)")
    p.add_argument("--output-len", type=int, default=128,
                   help="exact output tokens (EOS ignored), at least 2")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per engine first")
    p.add_argument("--engines", type=parse_latency_engines, default=list(LATENCY_ENGINES),
                   help=f"comma-separated, run in order, from {list(LATENCY_ENGINES)}")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for every engine and the bandwidth measurement "
                        "(default: os.cpu_count())")
    p.add_argument("--bandwidth-mib", type=int, default=1024,
                   help="buffer size of the memory bandwidth measurement")
    p.add_argument("--save-json", default=None, metavar="PATH",
                   help="config, environment, floor and per-run numbers")
    add_engine_args(p)
    from aioengine.bench.peers import LATENCY_PEERS, add_peer_args

    add_peer_args(p, LATENCY_PEERS)
    p.set_defaults(func=latency_main)


def latency_main(args: argparse.Namespace) -> int:
    from aioengine.bench import report as rep
    from aioengine.bench.datasets import TEXT_FILES, normal_vocab, random_dataset, text_dataset
    from aioengine.bench.latency import LatencyConfig, format_latency, run_latency
    from aioengine.bench.offline import hf_pad_id, load_hf_tokenizer
    from aioengine.bench.peers import LATENCY_PEERS, latency_peers, with_peers
    from aioengine.config import engine_kwargs
    from aioengine.model.default import bundled_model_path

    args.engines = with_peers(args.engines, args, LATENCY_PEERS)
    if args.output_len < 2 or args.input_len < 1 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit("need --output-len >= 2 (TPOT), --input-len >= 1, --repeats >= 1 "
                         "and --warmup >= 0")
    set_threads(args.threads)
    model = args.model or bundled_model_path()
    tokenizer = load_hf_tokenizer(args.tokenizer or model)
    if args.dataset == "random":
        workload = random_dataset(normal_vocab(tokenizer), 1, args.input_len, args.input_len,
                                  args.output_len, args.seed)
    else:
        workload = text_dataset(tokenizer, 1, args.output_len, args.seed,
                                TEXT_FILES[args.dataset], args.dataset)
    config = LatencyConfig(model=model, prompt=workload.prompts[0], output_len=args.output_len,
                           warmup=args.warmup, repeats=args.repeats, engines=args.engines,
                           bandwidth_bytes=args.bandwidth_mib << 20,
                           engine_kwargs=engine_kwargs(args), pad_token_id=hf_pad_id(tokenizer),
                           peers=latency_peers(args, workload.requests[0].prompt_len))
    report = {"mode": "latency", "environment": rep.environment_info(), "model": model,
              "config": run_config(args), "workload": workload.summary(),
              **run_latency(config)}
    emit(report, format_latency(report), args.save_json)
    return 0


def _add_accuracy_parser(sub: Any) -> None:
    from aioengine.bench.accuracy import add_accuracy_parser

    add_accuracy_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aioengine bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_offline_parser(sub)
    _add_serve_parser(sub)
    _add_profile_parser(sub)
    _add_latency_parser(sub)
    from aioengine.bench.hf_export import add_export_parser

    add_export_parser(sub)
    from aioengine.bench.gguf_bench import add_gguf_parser

    add_gguf_parser(sub)
    _add_accuracy_parser(sub)
    from aioengine.bench.spec import add_spec_parser

    add_spec_parser(sub)
    from aioengine.bench.lora import add_lora_parser

    add_lora_parser(sub)
    from aioengine.bench.structured import add_structured_parser

    add_structured_parser(sub)
    from aioengine.bench.soak import add_soak_parser

    add_soak_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Loading a GGUF draws a progress bar per tensor on stderr; silence tqdm's default
    # before anything imports it (it reads TQDM_* once). Our own bars pass `disable`
    # explicitly, which wins over the environment default.
    os.environ.setdefault("TQDM_DISABLE", "1")
    args = build_parser().parse_args(argv)
    return args.func(args)
