"""`offline` mode: one workload, all requests submitted at once, through each engine in turn.

Engines: `aioengine` (`LLM.generate`), `aioengine-no-prefix-caching` (the same with
`enable_prefix_caching=False`, the A/B of prefix caching), `hf` (transformers `generate` in
static batches with left padding) and `hf-cb` (transformers' own continuous batching,
`generate_batch`), all on the same float32 weights and the same torch thread count;
`onednn`, the workload's GEMMs alone on torch's bf16 linear, the matmul-bound ceiling beside
them (gemm_ceiling.py).
Warm-up is excluded. Our engines also report, for the timed run only, the prefix-cache hit
rate, the preemptions and the KV waste at the peak, and with `--speculative-config` the
drafts, accepted tokens and mean acceptance length (see `engine_stats`). `vllm` (vLLM's
CPU build, in its own venv: `--vllm-python`) runs the same workload in a child process
(peers.py).
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Callable

import torch

from aioengine.bench.common import add_workload_args, emit, run_config, set_threads
from aioengine.bench.datasets import Workload, build_workload
from aioengine.bench.gemm_ceiling import ONEDNN
from aioengine.bench.results import OUR_ENGINE, EngineResult, compare_outputs, make_result

NO_PREFIX_CACHING = "aioengine-no-prefix-caching"
# Engines that are ours: they report engine stats, and a failure is a bug, never a skip.
OUR_ENGINES = (OUR_ENGINE, NO_PREFIX_CACHING)


# ---- engines -------------------------------------------------------------------------


def engine_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What our engine did during one run, from the engine's `stats()` around it (the KV
    peak reset at its start): prefix-cache lookups and hits (tokens; hit rate None when
    caching is off), preemptions, and the step with the most KV blocks in use, with the
    share of their slots that held no token; `spec_decode`: speculative decoding's
    `spec_decode_delta` (None when it is off)."""
    from aioengine.metrics import spec_decode_delta

    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
            "kv_peak_blocks": after["kv_peak_blocks"], "num_kv_blocks": after["num_blocks"],
            "kv_waste_at_peak": after["kv_waste_at_peak"],
            "spec_decode": spec_decode_delta(before, after)}


def run_aioengine(workload: Workload, model: str, kwargs: dict[str, Any],
                  name: str = OUR_ENGINE) -> EngineResult:
    """Our engine: every prompt submitted at once through `LLM.generate`."""
    from aioengine import LLM, SamplingParams

    threads = torch.get_num_threads()
    llm = LLM(model, **kwargs)
    # The engine may size torch's thread pool on load; the benchmark's setting wins so
    # every engine runs with the same threads.
    torch.set_num_threads(threads)
    warmup = [p[:16] for p in workload.prompts[:2]]
    llm.generate(warmup, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    # The timed run starts from a cold prefix cache (the warm-up cached the prompts' heads).
    llm.reset_prefix_cache()
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in workload.requests]
    llm.reset_kv_peak_stats()
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - start
    result = make_result(name, workload, [list(o.outputs[0].token_ids) for o in outs],
                         elapsed)
    result.engine_stats = engine_stats(before, llm.stats())
    result.engine_stats["weights"] = weight_memory(llm)
    return result


def weight_memory(engine: Any) -> dict[str, Any]:
    """The weights' storage and resident bytes (packed copies included) against their own
    bytes (the projections, embedding and norms in their storage format, once each)."""
    info = engine.dtype_info()
    model = engine.model
    packed = sum(lin.packed.numel() * lin.packed.element_size()
                 for lin in model.linears() if lin.packed is not None)
    resident = info["weight_bytes"]
    return {"storage": info["weights"], "activations": info["activations"],
            "kv_cache_dtype": info["kv_cache_dtype"], "resident_bytes": resident,
            "own_bytes": resident - packed, "resident_over_own": resident / (resident - packed),
            "cpu_kernels": info["cpu"]["kernels"]}


def _hf_location(model: str) -> dict[str, str]:
    """`from_pretrained` arguments for a .gguf file or a Hugging Face directory."""
    if os.path.isfile(model):
        return {"pretrained_model_name_or_path": os.path.dirname(model),
                "gguf_file": os.path.basename(model)}
    return {"pretrained_model_name_or_path": model}


def load_hf_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(**_hf_location(model))


def load_hf_model(model: str) -> Any:
    """The model through transformers in float32; a GGUF is dequantized on load."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    where = _hf_location(model)
    if "gguf_file" in where and not is_accelerate_available():
        # transformers refuses GGUF files without accelerate; say how to get going.
        raise RuntimeError("transformers needs `accelerate` to load a GGUF file: "
                           "`pip install accelerate`, or pass --engines aioengine")
    return AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), padded on the left so every row's last token is real
    and generated tokens line up in the same columns."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask


def hf_generate(hf_model: Any, prompts: list[list[int]], output_len: int,
                pad_id: int) -> list[list[int]]:
    ids, mask = _left_pad(prompts, pad_id)
    # eos_token_id=None mirrors our `ignore_eos`: never stop early and never suppress EOS.
    # (min_new_tokens alone would mask EOS out of the logits, changing greedy outputs.)
    with torch.inference_mode():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                max_new_tokens=output_len, min_new_tokens=output_len,
                                pad_token_id=pad_id, eos_token_id=None,
                                temperature=None, top_p=None, top_k=None)
    return out[:, ids.shape[1]:].tolist()


def hf_pad_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def run_hf(workload: Workload, model: str, batch_size: int) -> EngineResult:
    """transformers `generate` in static batches of `batch_size`, in workload order."""
    hf_model, pad_id = load_hf_model(model), hf_pad_id(load_hf_tokenizer(model))
    hf_generate(hf_model, [p[:16] for p in workload.prompts[:2]], 4, pad_id)  # warm-up
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch_size):
        outputs += hf_generate(hf_model, workload.prompts[i:i + batch_size],
                               workload.output_len, pad_id)
    elapsed = time.perf_counter() - start
    return make_result("hf", workload, outputs, elapsed)


def hf_cb_config(workload: Workload, max_batch_tokens: int, max_requests: int) -> Any:
    """transformers' continuous batching sized for the workload.

    Left to itself it sizes the KV cache from free memory (psutil on CPU: most of RAM,
    allocated up front, which takes longer than the run); a cache that fits the workload
    exactly is fair and quick. The token budget and batch width match ours.
    """
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    pages = sum(-(-(r.prompt_len + r.output_len) // page) for r in workload.requests)
    return ContinuousBatchingConfig(page_size=page, num_blocks=pages + 8,
                                    max_batch_tokens=max_batch_tokens,
                                    max_requests_per_batch=max_requests)


def run_hf_cb(workload: Workload, model: str, max_batch_tokens: int,
              max_requests: int) -> EngineResult:
    """transformers `generate_batch` (continuous batching, paged cache, sdpa on CPU)."""
    from transformers import GenerationConfig

    hf_model = load_hf_model(model)
    # eos_token_id=-1: transformers' own "disabled" marker; every request runs to max.
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                           max_new_tokens=workload.output_len)
    cb = hf_cb_config(workload, max_batch_tokens, max_requests)
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    level, cb_logger.level = cb_logger.level, logging.ERROR  # persistent-manager warnings
    try:
        # Warm-up builds and keeps the manager (cache allocation, first forward) so the
        # timed call measures generation, as the other engines' timings do.
        hf_model.generate_batch([p[:16] for p in workload.prompts[:2]], gen, cb,
                                persistent_manager=True, max_new_tokens=4)
        start = time.perf_counter()
        outs = hf_model.generate_batch(workload.prompts, gen, cb, persistent_manager=True,
                                       warmup=False)
        elapsed = time.perf_counter() - start
    finally:
        hf_model.destroy_cached_continuous_batching_manager()
        cb_logger.level = level
    results = list(outs.values())
    failed = [r.error for r in results if r.error is not None]
    if failed or len(results) != len(workload.prompts):
        raise RuntimeError(f"hf-cb: {len(results)} results, errors: {failed[:3]}")
    return make_result("hf-cb", workload, [list(r.generated_tokens) for r in results], elapsed)


Runner = Callable[[Workload, str, argparse.Namespace], EngineResult]


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from aioengine.config import engine_kwargs

    return engine_kwargs(args)


RUNNERS: dict[str, Runner] = {
    OUR_ENGINE: lambda w, model, args: run_aioengine(w, model, _engine_kwargs(args)),
    NO_PREFIX_CACHING: lambda w, model, args: run_aioengine(
        w, model, {**_engine_kwargs(args), "enable_prefix_caching": False}, NO_PREFIX_CACHING),
    "hf": lambda w, model, args: run_hf(w, model, args.hf_batch_size),
    "hf-cb": lambda w, model, args: run_hf_cb(w, model, args.max_num_batched_tokens,
                                              args.max_num_seqs),
    "vllm": lambda w, model, args: _run_vllm(w, model, args),
    ONEDNN: lambda w, model, args: _run_onednn(w, model, args),
}


def _run_onednn(workload: Workload, model: str, args: argparse.Namespace) -> EngineResult:
    from aioengine.bench.gemm_ceiling import run_onednn_ceiling

    return run_onednn_ceiling(workload, model, args.max_num_batched_tokens, args.max_num_seqs)


def _run_vllm(workload: Workload, model: str, args: argparse.Namespace) -> EngineResult:
    from aioengine.bench.peers import run_vllm_offline

    return run_vllm_offline(workload, model, args)


def run_offline(args: argparse.Namespace, workload: Workload, model: str,
                progress: bool = True) -> dict[str, Any]:
    """Runs each engine in turn; returns the report (results, ratios, agreement, skips).

    An engine that cannot run here is recorded under "skipped" with the reason, so one
    missing peer does not lose the others' numbers.
    """
    from tqdm import tqdm

    results: dict[str, EngineResult] = {}
    skipped: dict[str, str] = {}
    bar = tqdm(args.engines, desc="engines", unit="engine", disable=not progress)
    for name in bar:
        bar.set_postfix_str(name)
        try:
            results[name] = RUNNERS[name](workload, model, args)
        except (RuntimeError, ImportError, ValueError, NotImplementedError) as e:
            if name in OUR_ENGINES:
                raise
            skipped[name] = f"{type(e).__name__}: {e}"
        gc.collect()  # drop the previous engine's weights before the next one loads
    report: dict[str, Any] = {
        "results": {name: r.summary() for name, r in results.items()},
        "ratios": {}, "agreement": {}, "skipped": skipped}
    # Every other engine is a peer, our own variants too (e.g. without prefix caching).
    ours = results.get(OUR_ENGINE)
    for name, peer in results.items():
        if ours is None or name == OUR_ENGINE:
            continue
        report["ratios"][name] = {"output": ours.output_tps / peer.output_tps,
                                  "total": ours.total_tps / peer.total_tps}
        if not peer.outputs:  # a ceiling (gemm_ceiling), not an engine: nothing to compare
            continue
        agreement = compare_outputs(ours.outputs, peer.outputs)
        report["agreement"][name] = {**asdict(agreement),
                                     "mean_first_diff": agreement.mean_first_diff}
    return report


def parse_engines(spec: str) -> list[str]:
    """`--engines`: a comma-separated list of distinct names from RUNNERS, run in order."""
    engines = [e.strip() for e in spec.split(",") if e.strip()]
    unknown = [e for e in engines if e not in RUNNERS]
    if not engines or unknown or len(set(engines)) != len(engines):
        raise argparse.ArgumentTypeError(
            f"--engines must name distinct engines from {sorted(RUNNERS)}, got {spec!r}")
    return engines


def add_offline_parser(sub: Any) -> None:
    from aioengine.bench.peers import OFFLINE_PEERS, add_peer_args
    from aioengine.config import add_engine_args

    p = sub.add_parser("offline", help="one batch of requests, all at once, vs transformers")
    add_workload_args(p)
    p.add_argument("--hf-batch-size", type=int, default=16,
                   help="static batch size of the transformers `generate` baseline")
    p.add_argument("--engines", type=parse_engines, default=[OUR_ENGINE, "hf", "hf-cb"],
                   help=f"comma-separated, run in order, from {sorted(RUNNERS)}")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for every engine (default: os.cpu_count())")
    # The engine flags (vLLM names) are the CLI's (aioengine.config); their --seed
    # seeds both the workload and the engine, and --model names the weights for all.
    add_engine_args(p)
    add_peer_args(p, OFFLINE_PEERS)
    p.set_defaults(func=offline_main)


def offline_main(args: argparse.Namespace) -> int:
    import aioengine.bench.report as rep
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
