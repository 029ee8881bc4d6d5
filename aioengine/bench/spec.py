"""`spec` mode: speculative-decoding configurations against no speculation, one request at a
time, on the draft-head trainer's held-out chat prompts (never trained on) or, with `--prompts
grounded`, the input-grounded ones (where n-gram lookup has something to copy), or with
`--prompts extraction|sql|code-edit|agent-replay` an agent-shaped set (bench/agentic.py;
agent-replay: multi-turn tool-using conversations), warmed up on `--warmup` other prompts of
the same set (suffix decoding's global tree learns from them).

Every configuration is its own AsyncEngine, all loaded at once, and each prompt runs
through all of them back to back (the order rotated per prompt), so machine drift over
the run reaches every configuration alike. Greedy, natural EOS, `--output-len` at most: the
outputs must be identical across configurations (verification is exact), which also
gives every configuration the same tokens to time. Reported per configuration: TPOT over
all prompts ((sum of e2e - TTFT) / (sum of tokens - 1)), its speedup over `off`, TTFT, the
mean acceptance length (tokens per verification, vLLM's count) and the acceptance rate
per draft position, and whether every output equalled `off`'s.

    --specs off,ngram,eagle3:2,eagle3:4     off | ngram (k=3, lookup 2..5) | ngramK |
                                            suffix[K] (suffix decoding, k = K or 8) |
                                            suffix:K:P (k = K, min_token_prob P) |
                                            eagle3[:K] (the shipped head, or --draft-model) |
                                            eagle3tree:D:K:N (tree: depth, top_k, nodes)
                                            ...@DIR: an eagle entry with the head in DIR,
                                            so two heads run interleaved in one run
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from aioengine.bench.agentic import AGENTIC_SETS, TIMED_SEED, WARMUP_SEED, chat_set
from aioengine.metrics import spec_decode_delta

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5}
DEFAULT_SPECS = "off,ngram,eagle3:2,eagle3:3,eagle3:4,eagle3:5,eagle3:6"


def parse_spec(name: str, draft_model: str | None) -> dict[str, Any] | None:
    """A --specs entry -> its speculative_config (None for off). An EAGLE entry may name its
    own head, `eagle3:2@DIR`, over `draft_model`."""
    base, at, head = name.partition("@")
    if at:
        spec = parse_spec(base, head) if head else None
        if spec is None or spec["method"] not in ("eagle", "eagle3"):
            raise argparse.ArgumentTypeError(
                f"--specs {name!r}: @DIR names a draft head: eagle[3][tree][:...]@DIR")
        return spec
    if name == "off":
        return None
    if name == "auto":  # suffix, n-gram and the head (--draft-model, else the shipped one)
        return {"method": "auto", **({"model": draft_model} if draft_model else {})}
    if name.startswith("ngram"):
        k = int(name[5:] or NGRAM["num_speculative_tokens"])
        return {**NGRAM, "num_speculative_tokens": k}
    if name.startswith("suffix:"):  # suffix:K:P, k = K and min_token_prob P
        try:
            k_text, p_text = name[len("suffix:"):].split(":")
            return {"method": "suffix", "num_speculative_tokens": int(k_text),
                    "suffix_decoding_min_token_prob": float(p_text)}
        except ValueError:
            raise argparse.ArgumentTypeError(f"--specs {name!r}: suffix:K:MIN_TOKEN_PROB")
    if name.startswith("suffix"):  # suffix decoding, vLLM's defaults; suffixK: k = K
        return {"method": "suffix", **({"num_speculative_tokens": int(name[6:])}
                                       if name[6:] else {})}
    method, _, k = name.partition(":")
    if method.endswith("tree"):  # eagle3tree:D:K:N, a tree of depth D, top_k K, N nodes
        try:
            depth, top_k, num_nodes = (int(x) for x in k.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--specs {name!r}: {method}:DEPTH:TOP_K:NODES")
        spec = parse_spec(method[:-len("tree")], draft_model)
        assert spec is not None
        return {**spec, "tree": {"depth": depth, "top_k": top_k, "num_nodes": num_nodes}}
    if method not in ("eagle", "eagle3"):
        raise argparse.ArgumentTypeError(f"unknown --specs entry {name!r}")
    spec: dict[str, Any] = {"method": method}
    if k:
        spec["num_speculative_tokens"] = int(k)
    if draft_model:
        spec["model"] = draft_model
    return spec


def add_spec_parser(sub: Any) -> None:
    from aioengine.config import add_engine_args

    p = sub.add_parser("spec", help="speculative decoding vs none: single-stream TPOT and "
                       "acceptance on held-out chat prompts")
    p.add_argument("--specs", default=DEFAULT_SPECS,
                   help=f"comma-separated configurations (default {DEFAULT_SPECS}): off, "
                        "ngram (k=3, lookup 2..5), ngramK, suffix[K] (suffix decoding, "
                        "k = K or 8), suffix:K:P (min_token_prob P), auto (per request the "
                        "best of suffix, n-gram and the head), eagle3[:K] (K draft tokens; "
                        "without K the head's n_predict), eagle3tree:D:K:N (EAGLE-2 tree "
                        "drafting: depth D, top_k K, N nodes); an eagle entry ending in @DIR "
                        "uses the head in DIR (two heads compared in one interleaved run)")
    p.add_argument("--draft-model", default=None,
                   help="the EAGLE head's directory (default: the one shipped for the model)")
    p.add_argument("--prompts", choices=("held-out", "grounded") + AGENTIC_SETS,
                   default="held-out",
                   help="the draft-head trainer's held-out chat prompts, the input-grounded "
                        "ones (bench data/grounded.jsonl: answers that copy the prompt, where "
                        "n-gram lookup finds drafts), or an agent-shaped set (bench/agentic.py: "
                        "one request shape repeated with small changes; agent-replay: "
                        "multi-turn tool-using conversations cut before an assistant turn; "
                        "--warmup prompts of the same set, other instances, run first)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="the first N prompts (default: all)")
    p.add_argument("--output-len", type=int, default=128, help="greedy tokens at most")
    p.add_argument("--warmup", type=int, default=1, help="untimed prompts per engine first")
    p.add_argument("--save-json", default=None, metavar="PATH",
                   help="config, environment, summary and per-prompt numbers")
    add_engine_args(p)
    p.set_defaults(func=spec_main, num_kv_blocks=512)


async def _one(engine, prompt: list[dict], max_tokens: int) -> dict[str, Any]:
    from aioengine.sampling_params import SamplingParams

    before = engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    times: list[float] = []
    token_ids: list[int] = []
    async for out in engine.generate(prompt, params):
        now = time.perf_counter() - start
        for c in out.outputs:  # n = 1: tokens accepted in one step arrive together
            times.extend([now] * len(c.token_ids))
            token_ids.extend(c.token_ids)
    delta = spec_decode_delta(before, engine.stats())
    return {"token_ids": token_ids, "ttft_s": times[0], "e2e_s": times[-1],
            "num_tokens": len(times), "spec_decode": delta}


def _as_chat(prompt: str | list[dict]) -> list[dict]:
    """A prompt text as one user message; a chat (agent-replay's turns) as it is."""
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


async def run_spec(model: str | None, specs: dict[str, dict | None],
                   prompts: list[str] | list[list[dict]], output_len: int, warmup: int,
                   engine_kwargs: dict[str, Any],
                   warm_prompts: list[str] | list[list[dict]] | None = None) -> dict[str, Any]:
    """`prompts`, `warm_prompts`: user messages, or chats (message lists); `warm_prompts`:
    the untimed prompts each engine runs first (default: the first `warmup` of the
    trainer's chat prompts)."""
    from aioengine import AsyncEngine
    from aioengine.spec_decode.train.prompts import split_prompts

    engines = {}
    for name, spec in specs.items():
        engines[name] = await AsyncEngine.create(model, **{**engine_kwargs,
                                                           "speculative_config": spec})
    chats = [_as_chat(p) for p in prompts]
    try:
        if warm_prompts is None:
            warm_prompts = split_prompts()[0][:warmup]
        warm = [_as_chat(p) for p in warm_prompts]
        for engine in engines.values():
            for chat in warm:
                await _one(engine, chat, output_len)
            engine.timeline.enabled = True  # the timed runs' steps only
            engine.timeline.records.clear()
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        names = list(engines)
        for i, chat in enumerate(chats):
            for name in names[i % len(names):] + names[:i % len(names)]:
                runs[name].append(await _one(engines[name], chat, output_len))
        resolved = {name: (e.speculative_config.num_speculative_tokens
                           if e.speculative_config else 0) for name, e in engines.items()}
        phases = {name: decode_phases(e.timeline.records) for name, e in engines.items()}
    finally:
        for engine in engines.values():
            await engine.shutdown()
    return {"runs": runs, "num_speculative_tokens": resolved, "decode_step_ms": phases}


def decode_phases(records) -> dict[str, float]:
    """Mean worker time (ms) of a decode step, per phase: the forward (k + 1 rows when it
    verifies drafts), sampling / verification, and the proposer."""
    steps = [r for r in records if r.kind == "decode"]
    out = {"num_steps": len(steps)}
    for phase in ("prepare", "forward", "sample", "propose"):
        out[phase] = 1e3 * sum(getattr(r, phase) for r in steps) / max(len(steps), 1)
    return out


def summarize(runs: dict[str, list[dict]], baseline: str = "off") -> dict[str, Any]:
    out = {}
    base_tokens = [r["token_ids"] for r in runs.get(baseline, [])]
    for name, rs in runs.items():
        decode_s = sum(r["e2e_s"] - r["ttft_s"] for r in rs)
        steps = sum(r["num_tokens"] - 1 for r in rs)
        counters: dict[str, Any] = {}
        for r in rs:
            for key, value in (r["spec_decode"] or {}).items():
                if isinstance(value, (int, float)) and key.startswith("num_"):
                    counters[key] = counters.get(key, 0) + value
                elif key == "num_accepted_tokens_per_pos":
                    acc = counters.setdefault(key, [0] * len(value))
                    counters[key] = [a + v for a, v in zip(acc, value)]
        drafts = counters.get("num_drafts", 0)
        out[name] = {
            "tpot_ms": 1e3 * decode_s / max(steps, 1),
            "ttft_ms_median": 1e3 * statistics.median(r["ttft_s"] for r in rs),
            "num_tokens": sum(r["num_tokens"] for r in rs),
            "mean_acceptance_length": (1 + counters["num_accepted_tokens"] / drafts
                                       if drafts else None),
            "per_position_acceptance_rate": ([n / drafts for n in
                                              counters["num_accepted_tokens_per_pos"]]
                                             if drafts else None),
            "greedy_equal_to_off": ([r["token_ids"] for r in rs] == base_tokens
                                    if base_tokens else None),
        }
    if baseline in out:
        for s in out.values():
            s["speedup_vs_off"] = out[baseline]["tpot_ms"] / s["tpot_ms"]
    return out


def format_spec(report: dict[str, Any]) -> str:
    from aioengine.bench.report import cpu_line

    width = max(12, *(len(name) for name in report["summary"]))
    lines = [cpu_line(report["environment"]),
             f"{report['num_prompts']} {report.get('prompts', 'held-out')} prompts, "
             f"greedy, <= "
             f"{report['output_len']} tokens, one request at a time",
             f"{'config':<{width}} {'k':>2} {'TPOT ms':>8} {'speedup':>8} {'TTFT ms':>8} "
             f"{'accept len':>10}  per-position acceptance  equal"]
    for name, s in report["summary"].items():
        acc = s["mean_acceptance_length"]
        per = s["per_position_acceptance_rate"]
        lines.append(
            f"{name:<{width}} {report['num_speculative_tokens'][name]:>2} {s['tpot_ms']:>8.2f} "
            f"{s.get('speedup_vs_off', float('nan')):>7.2f}x {s['ttft_ms_median']:>8.1f} "
            f"{acc if acc is None else round(acc, 2)!s:>10}  "
            f"{' '.join(f'{p:.2f}' for p in per) if per else '-':<23}  "
            f"{s['greedy_equal_to_off']}")
    lines.append("mean decode step (ms): prepare / forward / sample / propose")
    for name, p in report["decode_step_ms"].items():
        lines.append(f"{name:<{width}} {p['prepare']:.2f} / {p['forward']:.2f} / "
                     f"{p['sample']:.2f} / {p['propose']:.2f}  ({p['num_steps']} steps)")
    return "\n".join(lines)


def _prompt_texts(source: str) -> list[str]:
    from aioengine.bench.datasets import GROUNDED_FILE, load_prompt_texts
    from aioengine.spec_decode.train.prompts import split_prompts

    return load_prompt_texts(GROUNDED_FILE) if source == "grounded" else split_prompts()[1]


@contextlib.contextmanager
def _kv_prefault() -> Iterator[str]:
    """AIOENGINE_CPU_KV_PREFAULT=1 unless the caller set it, for the engines of this run
    only (an in-process caller's later engines keep their own setting): a step that first
    reaches fresh KV pages can stall ~100 ms in a VM (envs.py), in whichever configuration
    happens to get there first. Yields the value in force."""
    key = "AIOENGINE_CPU_KV_PREFAULT"
    before = os.environ.get(key)
    os.environ[key] = before if before is not None else "1"
    try:
        yield os.environ[key]
    finally:
        if before is None:
            os.environ.pop(key, None)


def spec_main(args: argparse.Namespace) -> int:
    from aioengine.bench.common import emit, run_config, set_threads
    from aioengine.bench.report import environment_info
    from aioengine.config import engine_kwargs

    try:
        specs = {name: parse_spec(name, args.draft_model) for name in args.specs.split(",")}
    except argparse.ArgumentTypeError as e:  # a usage error, not a traceback
        print(f"aioengine bench spec: error: {e}", file=sys.stderr)
        return 2
    set_threads(None)
    warm_prompts: list[list[dict]] | None = None
    prompts: list[str] | list[list[dict]]
    if args.prompts in AGENTIC_SETS:
        prompts = chat_set(args.prompts, args.num_prompts or 20, TIMED_SEED)
        warm_prompts = chat_set(args.prompts, args.warmup, WARMUP_SEED)
    else:
        prompts = _prompt_texts(args.prompts)[:args.num_prompts]
    with _kv_prefault() as prefault:
        result = asyncio.run(run_spec(args.model, specs, prompts, args.output_len, args.warmup,
                                      engine_kwargs(args), warm_prompts))
    report = {"mode": "spec", "environment": environment_info(), "model": args.model,
              "config": run_config(args), "prompts": args.prompts,
              "kv_prefault": prefault,
              "num_prompts": len(prompts),
              "output_len": args.output_len,
              "num_speculative_tokens": result["num_speculative_tokens"],
              "summary": summarize(result["runs"]),
              "decode_step_ms": result["decode_step_ms"],
              "runs": {n: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs]
                       for n, rs in result["runs"].items()}}
    emit(report, format_spec(report), args.save_json)
    return 0
