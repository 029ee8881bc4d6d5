"""What the benchmark prints and saves: tables, the JSON record, and the PNG."""
from __future__ import annotations

import os
import platform
from typing import Any

import orjson

from aioengine import cpu_info
from aioengine.bench.metrics import RequestResult, throughput_over_time
from aioengine.metrics import format_spec_decode

OUR_ENGINE = "aioengine"
_LATENCIES = (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
              ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"))


def environment_info() -> dict[str, Any]:
    """What the numbers depend on; recorded with every result."""
    import torch

    return {
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "aiohttp": _version("aiohttp"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu_model": cpu_info.cpu_model(),
        "cpu_flags": cpu_info.relevant_flags(),
    }


def cpu_line(env: dict[str, Any]) -> str:
    """"CPU: model (the flags our choices depend on)", for every report's header."""
    flags = " ".join(env.get("cpu_flags") or []) or "no relevant flags"
    return f"CPU: {env.get('cpu_model')} ({flags})"


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _workload_line(wl: dict[str, Any]) -> str:
    kind = {"random": "random-token", "shared-prefix": "shared-prefix random-token",
            "text": "English text", "grounded": "input-grounded text and code"
            }.get(wl["dataset"], wl["dataset"])
    line = (f"workload: {wl['num_prompts']} {kind} prompts of {wl['prompt_len_min']}-"
            f"{wl['prompt_len_max']} tokens ({wl['num_prompt_tokens']} in all), "
            f"{wl['output_len']} output tokens each, seed {wl['seed']}")
    if wl["dataset"] == "shared-prefix":
        line += (f"; {wl['num_prefixes']} prefixes of {wl['prefix_len']} + "
                 f"{wl['suffix_len']}-token suffixes")
    return line


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def _engine_stats_cells(stats: dict[str, Any] | None) -> str:
    """Hit rate, preemptions and KV waste at peak: our engines only ("-" for peers)."""
    if stats is None:
        return f" {'-':>8} {'-':>7} {'-':>8}"
    return (f" {_percent(stats['prefix_cache_hit_rate']):>8} {stats['num_preemptions']:>7} "
            f"{_percent(stats['kv_waste_at_peak']):>8}")


def format_offline(report: dict[str, Any]) -> str:
    env = report["environment"]
    names = [*report["results"], *report.get("skipped", {})]
    w = max([10, *(len(n) for n in names)])
    lines = [
        f"torch {env['torch']}, transformers {env['transformers']}, "
        f"{env['torch_threads']} torch threads, {env['cpu_count']} CPUs"
        + (f", {env['cuda']}" if env["cuda"] else ""),
        cpu_line(env),
        f"model {report['model']}",
        _workload_line(report["workload"]),
        "",
        f"{'engine':<{w}} {'requests':>8} {'prompt tok':>10} {'output tok':>10} "
        f"{'elapsed s':>9} {'output tok/s':>12} {'total tok/s':>11} "
        f"{'hit rate':>8} {'preempt':>7} {'KV waste':>8}",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"{name:<{w}} {r['num_requests']:>8} {r['num_prompt_tokens']:>10} "
            f"{r['num_output_tokens']:>10} {r['elapsed_s']:>9.2f} "
            f"{r['output_tok_per_s']:>12.1f} {r['total_tok_per_s']:>11.1f}"
            + _engine_stats_cells(r.get("engine_stats")))
    for name, reason in report.get("skipped", {}).items():
        lines.append(f"{name:<{w}} skipped: {reason}")
    for name, ratio in report["ratios"].items():
        lines.append(f"{OUR_ENGINE} / {name}: output x{ratio['output']:.2f}, "
                     f"total x{ratio['total']:.2f}")
    for name, a in report["agreement"].items():
        line = f"greedy outputs equal to {name}: {a['num_equal']}/{a['num_requests']}"
        if a["first_diffs"]:
            line += f" (differing ones diverge at token {a['mean_first_diff']:.1f} on average)"
        lines.append(line)
    if any(r.get("engine_stats") for r in report["results"].values()):
        lines += ["hit rate: prefix-cache hits / prompt tokens looked up, in the timed run;",
                  "KV waste: empty slots / slots of the KV blocks in use, at the step with the "
                  "most blocks in use"]
    for name, r in report["results"].items():
        stats = r.get("engine_stats")
        if stats:
            hits = ("prefix caching off" if stats["prefix_cache_hit_rate"] is None else
                    f"{stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} prompt "
                    f"tokens hit the prefix cache")
            lines.append(f"{name}: peak {stats['kv_peak_blocks']} of {stats['num_kv_blocks']} "
                         f"KV blocks in use; {hits}")
            if stats.get("spec_decode") is not None:
                lines.append(f"{name}: speculative decoding: "
                             f"{format_spec_decode(stats['spec_decode'])}")
            w = stats.get("weights")
            if w:
                lines.append(f"{name}: weights {w['storage']} (activations {w['activations']}, "
                             f"KV {w['kv_cache_dtype']}, C kernels {w['cpu_kernels']}): "
                             f"{w['resident_bytes'] / 2**20:.0f} MiB resident, "
                             f"{w['resident_over_own']:.2f}x their own bytes")
    return "\n".join(lines)


def format_serve(report: dict[str, Any]) -> str:
    """vLLM's `benchmark_serving` layout, so results read side by side with vLLM's."""
    s, cfg = report["summary"], report["config"]
    rate = cfg["request_rate"]
    width = 50

    def row(label: str, value: Any, fmt: str = "") -> str:
        text = format(value, fmt) if fmt else str(value)
        return f"{label + ':':<40}{text:>10}"

    lines = [_workload_line(report["workload"]),
             f"server {cfg['base_url']} ({cfg['endpoint']}), model {report['model']}, "
             f"max concurrency {cfg['max_concurrency'] or 'unbounded'}, request rate "
             f"{'inf' if rate == float('inf') else rate}"
             + (f" (burstiness {cfg['burstiness']})" if rate != float("inf") else ""),
             "{s:=^{n}}".format(s=" Serving Benchmark Result ", n=width),
             row("Successful requests", s["successful_requests"]),
             row("Failed requests", s["failed_requests"]),
             row("Benchmark duration (s)", s["duration_s"], ".2f"),
             row("Total input tokens", s["total_input_tokens"]),
             row("Total generated tokens", s["total_output_tokens"]),
             row("Prefix cache hit rate (%)", 100 * s.get("prefix_cache_hit_rate", 0.0),
                 ".1f"),
             row("Request throughput (req/s)", s["request_throughput"], ".2f"),
             row("Output token throughput (tok/s)", s["output_throughput"], ".2f"),
             row("Total token throughput (tok/s)", s["total_token_throughput"], ".2f")]
    if "request_goodput" in s:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slo_ms"].items())
        lines += [row("Request goodput (req/s)", s["request_goodput"], ".2f"),
                  f"  ({s['goodput_requests']} requests met {slo})"]
    for key, title in _LATENCIES:
        st = s[key]
        lines.append("{s:-^{n}}".format(s=f" {title} ", n=width))
        lines.append(row(f"Mean {key.upper()} (ms)", st["mean_ms"], ".2f"))
        for p in ("p50", "p90", "p99"):
            lines.append(row(f"{p.upper()} {key.upper()} (ms)", st[f"{p}_ms"], ".2f"))
    lines.append("=" * width)
    return "\n".join(lines)


def save_json(path: str, report: dict[str, Any]) -> None:
    """orjson writes inf/NaN as null, so the file is always valid JSON; int keys (the
    agreement's request index -> first differing token) become strings."""
    with open(path, "wb") as f:
        f.write(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY
                             | orjson.OPT_NON_STR_KEYS))
        f.write(b"\n")


def plot_cdf(ax: Any, values_ms: list[float], title: str) -> None:
    import numpy as np

    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = np.sort(np.asarray(values_ms))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
    for p in (50, 99):
        ax.axvline(float(np.percentile(xs, p)), ls="--", lw=0.8, color="grey")


def plot_serve(path: str, results: list[RequestResult], duration_s: float, title: str) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, e2e) and output throughput over time."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot's import
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [([r.ttft_s for r in ok], "TTFT"),
              ([t for t in (r.tpot_s for r in ok) if t is not None], "TPOT"),
              ([x for r in ok for x in r.itls_s], "ITL"),
              ([r.e2e_s for r in ok], "end-to-end latency")]
    for ax, (values, name) in zip(axes.flat, panels):
        plot_cdf(ax, [v * 1000.0 for v in values], f"{name} CDF (dashed: p50, p99)")
    centres, tps = throughput_over_time(results, duration_s)
    ax = axes.flat[4]
    ax.plot(centres, tps)
    ax.set_title("output throughput over time")
    ax.set_xlabel("s since start")
    ax.set_ylabel("tok/s")
    ax.grid(alpha=0.3)
    ax = axes.flat[5]
    times = sorted({0.0, duration_s, *(r.start_s for r in ok), *(r.start_s + r.e2e_s for r in ok)})
    ax.step(times, [sum(r.start_s <= t < r.start_s + r.e2e_s for r in ok) for t in times],
            where="post")
    ax.set_title("requests in flight")
    ax.set_xlabel("s since start")
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_offline(path: str, report: dict[str, Any]) -> None:
    """Bars of output and total tok/s per engine (offline runs have no per-request timing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["results"])
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = range(len(names))
    for offset, key, label in ((-0.2, "output_tok_per_s", "output tok/s"),
                               (0.2, "total_tok_per_s", "total tok/s")):
        ax.bar([x + offset for x in xs], [report["results"][n][key] for n in names],
               width=0.4, label=label)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("tokens/s")
    ax.set_title(_workload_line(report["workload"]), fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
