"""`latency` mode: one request at a time, measured against the weight-streaming floor.

At batch 1 each decode step is a chain of matrix-vector products: the forward reads every
weight matrix once per token and does little arithmetic per byte, so on a CPU the time per
output token cannot drop below the time to stream the weights from memory:

    floor_ms = weight bytes read per token / memory read bandwidth

- Weight bytes (`floor.weight_bytes_per_token`): every parameter of the model as our engine
  holds it (its dtype: float32 on CPU, a GGUF dequantized on load). A tied embedding / LM
  head counts once, in full: the LM head reads all of it every token. An untied embedding
  counts one row: the lookup reads only that. The KV cache reads are not in the floor
  (at these lengths they are a few percent of the weights).
- Bandwidth (`floor.BandwidthProbe`): the median of several `.sum()` over a buffer of
  `--bandwidth-mib` (1 GiB by default, far larger than the caches), on the same torch
  thread count as the engines, in a child process that keeps the buffer between
  measurements, before and after every timed run (one measurement between two runs serves
  both). Each run's TPOT / floor uses the higher of the two: these machines drift by
  20-30% over minutes, and a floor from one moment against a TPOT from another measured
  the drift (one bandwidth at the start gave 1.25-1.72x for the same code); and for
  seconds to minutes at a time their sequential reads run ~1.8x faster, so a run during
  which such a phase starts or ends is held to the faster one. The report's floor is the
  median of the runs' bandwidths.

Engines, on the same weights and thread count, each after `--warmup` untimed runs:

- `aioengine`: the request streams through `AsyncEngine`; each token's arrival time is
  when the caller receives it. TTFT = first arrival - submit, TPOT = (e2e - TTFT) / (n - 1),
  ITL = the gaps between arrivals. The prefix cache is reset before every run, so each one
  pays the whole prefill. With `--speculative-config` (tokens accepted in one step arrive
  together), each run and the timed runs together also report the drafts verified, the
  draft tokens accepted and the mean acceptance length (`aioengine.metrics.
  spec_decode_delta`); `--dataset grounded` gives a prompt whose answer copies from it.
- `hf`: transformers `generate`, greedy, batch 1, with a streamer that timestamps each
  token as `generate` hands it over (the first `put` is the prompt and is skipped); the
  same TTFT / TPOT / ITL follow. A streamer times the very run it measures, where the
  difference of two runs (`max_new_tokens` N and 1) would subtract two noisy totals.

- `vllm`, `llamacpp`: peers in their own venvs (`--vllm-python`, `--llamacpp-python`), timed
  the same way in a child process, which waits for the parent's bandwidth measurement
  before each run (peers.py).

Reported per engine: the MEDIAN over `--repeats` runs (robust on a shared machine) and, in
brackets, the best (the least disturbed run); the JSON keeps every run.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from aioengine.bench.common import emit, run_config, set_threads
from aioengine.bench.datasets import TEXT_FILES, normal_vocab, random_dataset, text_dataset
from aioengine.bench.floor import BANDWIDTH_REPEATS, BandwidthProbe, weight_bytes_per_token
from aioengine.bench.report import cpu_line, environment_info
from aioengine.bench.results import OUR_ENGINE, EngineLatency, checked_run
from aioengine.metrics import format_spec_decode, spec_decode_delta
from aioengine.spec_decode.config import speculative_config_dict

LATENCY_ENGINES = (OUR_ENGINE, "hf")
# `--dataset`: random tokens (`--input-len`), or one prompt of a shipped text dataset.
LATENCY_DATASETS = ("random", "text", "grounded")
TARGET_TPOT_OVER_FLOOR = 1.4  # the target for our TPOT


async def _aioengine_runs(model: str | None, kwargs: dict[str, Any], prompt: list[int],
                          output_len: int, warmup: int, repeats: int,
                          bandwidth_bytes: int) -> EngineLatency:
    from aioengine import AsyncEngine, SamplingParams

    threads = torch.get_num_threads()
    engine = await AsyncEngine.create(model, **kwargs)
    torch.set_num_threads(threads)  # the benchmark's thread count wins, as in `offline`
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    runs, outputs = [], []
    probe = BandwidthProbe(bandwidth_bytes)
    first = before = engine.stats()
    try:
        for i in range(warmup + repeats):
            if not engine.reset_prefix_cache():
                raise RuntimeError("aioengine: KV blocks still in use between runs")
            if i >= warmup:
                probe.before_run()
                before = engine.stats()
                if i == warmup:
                    first = before
            times: list[float] = []
            ids: list[int] = []
            start = time.perf_counter()
            async for out in engine.generate(prompt, params):
                now = time.perf_counter() - start
                # Tokens that reach the caller together share an arrival time.
                new = [t for c in out.outputs for t in c.token_ids]
                times += [now] * len(new)
                ids += new
            if i >= warmup:
                run = checked_run(OUR_ENGINE, times, output_len, probe.after_run())
                run.spec_decode = spec_decode_delta(before, engine.stats())
                runs.append(run)
                outputs.append(ids)
        weight_bytes = weight_bytes_per_token(engine.model)
        spec_decode = spec_decode_delta(first, engine.stats())
    finally:
        probe.close()
        await engine.shutdown()
    return EngineLatency(OUR_ENGINE, runs, threads, weight_bytes, outputs,
                         spec_decode=spec_decode)


def run_aioengine(model: str | None, kwargs: dict[str, Any], prompt: list[int],
                  output_len: int, warmup: int, repeats: int,
                  bandwidth_bytes: int) -> EngineLatency:
    return asyncio.run(_aioengine_runs(model, kwargs, prompt, output_len, warmup, repeats,
                                       bandwidth_bytes))


class TokenClock:
    """A transformers streamer (`BaseStreamer`'s put/end, which `generate` duck-types) that
    records when each generated token is handed over."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.token_ids: list[int] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:  # generate() first puts the prompt
            self._seen_prompt = True
            return
        now = time.perf_counter() - self.start
        self.times += [now] * value.numel()  # batch 1: one token per put
        self.token_ids += value.reshape(-1).tolist()

    def end(self) -> None:
        pass


def run_hf(model: str, prompt: list[int], output_len: int, warmup: int, repeats: int,
           pad_id: int, bandwidth_bytes: int) -> EngineLatency:
    """transformers `generate`, greedy, batch 1, timed per token by a streamer."""
    from aioengine.bench.offline import load_hf_model

    hf_model = load_hf_model(model)
    ids = torch.tensor([prompt], dtype=torch.long)
    runs, outputs = [], []
    with BandwidthProbe(bandwidth_bytes) as probe:
        for i in range(warmup + repeats):
            if i >= warmup:
                probe.before_run()
            clock = TokenClock()
            with torch.inference_mode():
                # eos_token_id=None: never stop early (our ignore_eos), as in `offline`.
                hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  do_sample=False, max_new_tokens=output_len,
                                  min_new_tokens=output_len, pad_token_id=pad_id,
                                  eos_token_id=None, temperature=None, top_p=None,
                                  top_k=None, streamer=clock)
            if i >= warmup:
                runs.append(checked_run("hf", clock.times, output_len, probe.after_run()))
                outputs.append(clock.token_ids)
    return EngineLatency("hf", runs, torch.get_num_threads(), outputs=outputs)


# ---- the whole mode -------------------------------------------------------------------


@dataclass(frozen=True)
class LatencyConfig:
    model: str
    prompt: list[int]
    output_len: int
    warmup: int
    repeats: int
    engines: list[str]
    bandwidth_bytes: int
    engine_kwargs: dict[str, Any]
    pad_token_id: int  # for transformers' generate (batch 1: never used to pad)
    # Peers in their own interpreters: name -> peers.LatencyPeer (python, options).
    peers: dict[str, Any] = field(default_factory=dict)


def run_latency(config: LatencyConfig) -> dict[str, Any]:
    """Each engine in turn, the bandwidth measured around each timed run; returns the
    report's floor, results, ratios and skipped engines."""
    from aioengine.model.loader import load_model

    results: dict[str, EngineLatency] = {}
    skipped: dict[str, str] = {}
    for name in config.engines:
        try:
            if name == OUR_ENGINE:
                results[name] = run_aioengine(config.model, config.engine_kwargs,
                                              config.prompt, config.output_len,
                                              config.warmup, config.repeats,
                                              config.bandwidth_bytes)
            elif name == "hf":
                results[name] = run_hf(config.model, config.prompt, config.output_len,
                                       config.warmup, config.repeats, config.pad_token_id,
                                       config.bandwidth_bytes)
            else:
                from aioengine.bench.peers import run_peer_latency

                results[name] = run_peer_latency(name, config.peers[name], config.model,
                                                 config.prompt, config.output_len,
                                                 config.warmup, config.repeats,
                                                 config.bandwidth_bytes)
        except (RuntimeError, ImportError, ValueError, NotImplementedError) as e:
            if name == OUR_ENGINE:
                raise
            skipped[name] = f"{type(e).__name__}: {e}"
        gc.collect()
    ours = results.get(OUR_ENGINE)
    if ours is not None:
        weight_bytes = ours.weight_bytes
    else:  # only the peer ran: load our model just to count its weights
        from aioengine.config import EngineArgs
        from aioengine.dtypes import parse_dtype

        args = EngineArgs.from_kwargs(model=config.model, **config.engine_kwargs)
        device = args.resolve_device()
        loaded = load_model(config.model, parse_dtype(args.dtype, device), device)
        weight_bytes = weight_bytes_per_token(loaded.model)
    if not results:
        raise RuntimeError("latency: no engine ran")
    bandwidth = statistics.median(run.bandwidth for r in results.values() for run in r.runs)
    floor_ms = weight_bytes / bandwidth * 1e3
    summaries = {name: r.summary(weight_bytes) for name, r in results.items()}
    report: dict[str, Any] = {
        "floor": {"bandwidth_gb_per_s": bandwidth / 1e9,
                  "bandwidth_buffer_bytes": config.bandwidth_bytes,
                  "bandwidth_repeats": BANDWIDTH_REPEATS,
                  "weight_bytes": weight_bytes, "floor_ms": floor_ms},
        "results": summaries, "skipped": skipped, "target_tpot_over_floor":
        TARGET_TPOT_OVER_FLOOR}
    if ours is not None:
        tpot = summaries[OUR_ENGINE]["tpot_ms"]
        report["tpot_over_floor"] = summaries[OUR_ENGINE]["tpot_over_floor"]
        report["speedup_vs"], report["agreement"] = {}, {}
        for name, peer in results.items():
            if name == OUR_ENGINE:
                continue
            peer_tpot = summaries[name]["tpot_ms"]
            report["speedup_vs"][name] = {k: peer_tpot[k] / tpot[k] for k in tpot}
            if ours.outputs and peer.outputs:
                report["agreement"][name] = first_diff(ours.outputs[0], peer.outputs[0])
        if "hf" in report["speedup_vs"]:
            report["speedup_vs_hf"] = report["speedup_vs"]["hf"]
    return report


def spec_config_label(cfg: dict[str, Any]) -> str:
    """`--speculative-config` in brief: "ngram, 4 tokens" (the whole dict is in the JSON)."""
    spec = speculative_config_dict(cfg.get("speculative_config")) or {}
    return f"{spec.get('method')}, {spec.get('num_speculative_tokens')} tokens"


def first_diff(ours: list[int], peer: list[int]) -> int | None:
    """Where two greedy outputs first differ (None: equal)."""
    if ours == peer:
        return None
    return next((i for i, (a, b) in enumerate(zip(ours, peer)) if a != b),
                min(len(ours), len(peer)))


def parse_latency_engines(spec: str) -> list[str]:
    """`--engines` for latency: distinct names from LATENCY_ENGINES, run in order."""
    from aioengine.bench.peers import LATENCY_PEERS

    engines = [e.strip() for e in spec.split(",") if e.strip()]
    known = (*LATENCY_ENGINES, *LATENCY_PEERS)
    if (not engines or any(e not in known for e in engines)
            or len(set(engines)) != len(engines)):
        raise argparse.ArgumentTypeError(
            f"--engines must name distinct engines from {list(known)}, got {spec!r}")
    return engines


def format_latency(report: dict[str, Any]) -> str:
    env, cfg, floor = report["environment"], report["config"], report["floor"]

    def cell(stat: dict[str, float]) -> str:
        return f"{stat['median']:.2f} ({stat['best']:.2f})"

    if cfg.get("dataset", "random") == "random":
        prompt = f"{cfg['input_len']}-token random-token prompt"
    else:
        prompt = (f"{report['workload']['prompt_len_min']}-token prompt from the "
                  f"{cfg['dataset']} dataset")
    lines = [
        f"torch {env['torch']}, transformers {env['transformers']}, "
        f"{env['torch_threads']} torch threads, {env['cpu_count']} CPUs"
        + (f", {env['cuda']}" if env["cuda"] else ""),
        cpu_line(env),
        f"model {report['model']}",
        f"one request: {prompt} (seed {cfg['seed']}), "
        f"{cfg['output_len']} output tokens; median (best) of {cfg['repeats']} runs after "
        f"{cfg['warmup']} warm-up",
        "",
        f"{'memory read bandwidth':<26}{floor['bandwidth_gb_per_s']:>10.2f} GB/s "
        f"(median over the timed runs; each the higher of before and after it, a median of "
        f"{floor['bandwidth_repeats']} sums over "
        f"{floor['bandwidth_buffer_bytes'] / 2**20:.0f} MiB)",
        f"{'weights read per token':<26}{floor['weight_bytes'] / 1e6:>10.1f} MB",
        f"{'weight-streaming floor':<26}{floor['floor_ms']:>10.2f} ms/token",
        "",
        f"{'engine':<10} {'TTFT ms':>17} {'TPOT ms':>17} {'ITL p50 ms':>17} "
        f"{'e2e ms':>19} {'TPOT / floor':>14}",
    ]
    for name, r in report["results"].items():
        ratio = r["tpot_over_floor"]  # each run against its own bandwidth
        lines.append(f"{name:<10} {cell(r['ttft_ms']):>17} {cell(r['tpot_ms']):>17} "
                     f"{cell(r['itl_median_ms']):>17} {cell(r['e2e_ms']):>19} "
                     f"{ratio['median']:>6.2f} ({ratio['best']:.2f})")
    for name, reason in report.get("skipped", {}).items():
        lines.append(f"{name:<10} skipped: {reason}")
    spec = report["results"].get(OUR_ENGINE, {}).get("spec_decode")
    if spec is not None:
        lines.append(f"{OUR_ENGINE} speculative decoding ({spec_config_label(cfg)}), timed "
                     f"runs: {format_spec_decode(spec)}")
    speedups = report.get("speedup_vs") or (
        {"hf": report["speedup_vs_hf"]} if "speedup_vs_hf" in report else {})
    for name, s in speedups.items():
        lines.append(f"{OUR_ENGINE} speed-up vs {name} ({name} TPOT / our TPOT): "
                     f"x{s['median']:.2f} (best runs x{s['best']:.2f})")
    for name, diff in report.get("agreement", {}).items():
        lines.append(f"greedy output of {name} vs ours: " +
                     ("equal" if diff is None else f"first differs at token {diff}"))
    if any("peer_info" in r for r in report["results"].values()):
        lines.append("TPOT / floor: against our weights' bytes; a peer that holds fewer "
                     "(llamacpp's quantized GGUF, vllm in a narrower dtype) can go below 1")
    if "tpot_over_floor" in report:
        ratio, target = report["tpot_over_floor"]["median"], report["target_tpot_over_floor"]
        verdict = "met" if ratio <= target else "not met"
        lines.append(f"target: {OUR_ENGINE} TPOT <= {target} x floor: {verdict} "
                     f"(median x{ratio:.2f})")
    return "\n".join(lines)


def add_latency_parser(sub: Any) -> None:
    from aioengine.bench.peers import LATENCY_PEERS, add_peer_args
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
    add_peer_args(p, LATENCY_PEERS)
    p.set_defaults(func=latency_main)


def latency_main(args: argparse.Namespace) -> int:
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
    report = {"mode": "latency", "environment": environment_info(), "model": model,
              "config": run_config(args), "workload": workload.summary(),
              **run_latency(config)}
    emit(report, format_latency(report), args.save_json)
    return 0
