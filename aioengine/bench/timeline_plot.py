"""Pictures of a `bench profile` run: where each request's time went and what each step held.

    requests   one bar per request in arrival order: queued (arrival to first scheduled),
               prefill (to its first token), decode (to its last)
    steps      each step's prompt tokens, decode rows and drafts, stacked, at its start
               time, and its worker time on a second axis
    TTFT, ITL  their distributions (CDFs, p50 and p99 dashed)

`plot_profile` writes the PNG and, beside it, an HTML page that holds the PNG itself and the
profile's table (no file or network reference: it can be mailed or attached as it is).
`plot_compare` draws two saved runs side by side on one time scale, their TTFT and ITL
overlaid (`aioengine bench compare A.json B.json --plot PATH.png`).
"""
from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from aioengine.bench.report import plot_cdf

_COLOURS = {"queued": "#b0b0b0", "prefill": "#e8a33d", "decode": "#3d7be8", "drafts": "#8c5bd6"}


def _request_bars(ax: Any, requests: list[dict], origin: float) -> None:
    rows = sorted(requests, key=lambda r: r["arrival"])
    for y, r in enumerate(rows):
        scheduled = r["scheduled"] if r["scheduled"] is not None else r["arrival"]
        first = r["outputs"][0]
        spans = (("queued", r["arrival"], scheduled), ("prefill", scheduled, first),
                 ("decode", first, r["finish"]))
        for name, a, b in spans:
            ax.barh(y, max(b - a, 0.0), left=a - origin, height=0.8, color=_COLOURS[name],
                    label=name if y == 0 else None)
    ax.set_title("requests: queued, prefill, decode")
    ax.set_xlabel("s since start")
    ax.set_ylabel("request (arrival order)")
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=8)


def _step_composition(ax: Any, steps: list[dict], origin: float) -> None:
    starts = [s["start"] - origin for s in steps]
    work = [s["prepare"] + s["forward"] + s["sample"] + s["propose"] for s in steps]
    widths = [max(w, 1e-4) for w in work]
    drafts = [s["draft_tokens"] for s in steps]
    rows = [s["decode_rows"] for s in steps]
    prompt = [s["num_tokens"] - r - d for s, r, d in zip(steps, rows, drafts)]
    bottom = [0] * len(steps)
    for name, values in (("prefill", prompt), ("decode", rows), ("drafts", drafts)):
        label = {"prefill": "prompt tokens", "decode": "decode rows", "drafts": "drafts"}[name]
        ax.bar(starts, values, width=widths, bottom=bottom, align="edge",
               color=_COLOURS[name], label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_title("steps: what each held (bar width: its worker time)")
    ax.set_xlabel("s since start")
    ax.set_ylabel("tokens")
    twin = ax.twinx()
    twin.plot([a + w / 2 for a, w in zip(starts, widths)], [1e3 * w for w in work], ".",
              color="black", markersize=3, label="worker ms")
    twin.set_ylabel("worker ms")
    ax.legend(loc="upper right", fontsize=8)


def _ttft_ms(report: dict[str, Any]) -> list[float]:
    return [1e3 * (r["outputs"][0] - r["arrival"]) for r in report["requests"]]


def _itl_ms(report: dict[str, Any]) -> list[float]:
    return [1e3 * (b - a) for r in report["requests"]
            for a, b in zip(r["outputs"], r["outputs"][1:])]


def _write_html(path: str, title: str, tables: list[str]) -> str:
    page = Path(path).with_suffix(".html")
    image = base64.b64encode(Path(path).read_bytes()).decode()
    body = "".join(f"<pre>{html.escape(t)}</pre>" for t in tables)
    page.write_text(
        f"<!doctype html><meta charset=utf-8><title>{html.escape(title)}</title>"
        f"<body style='font-family:sans-serif'><h1>{html.escape(title)}</h1>{body}"
        f"<img alt='the run' style='max-width:100%' src='data:image/png;base64,{image}'>"
        "</body>\n")
    return str(page)


def plot_profile(path: str, report: dict[str, Any], table: str) -> str:
    """The run's PNG at `path` and its HTML page beside it (same name, .html); returns the
    HTML's path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot's import
    import matplotlib.pyplot as plt

    origin, requests = report["origin"], report["requests"]
    fig, axes = plt.subplots(2, 2, figsize=(15, 9))
    _request_bars(axes[0, 0], requests, origin)
    _step_composition(axes[0, 1], report["steps"], origin)
    plot_cdf(axes[1, 0], _ttft_ms(report), "TTFT CDF (dashed: p50, p99)")
    plot_cdf(axes[1, 1], _itl_ms(report),
             "ITL CDF, as the caller received tokens (dashed: p50, p99)")
    fig.suptitle(f"aioengine bench profile: {len(requests)} requests, "
                 f"{report['elapsed_s']:.2f} s, {report['environment'].get('cpu_model', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return _write_html(path, "aioengine bench profile", [table])


def _cdf_overlay(ax: Any, series: list[tuple[str, list[float]]], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    for name, values in series:
        xs = sorted(values)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=f"{name}: p50 {xs[len(xs) // 2]:.0f} ms, "
                          f"p99 {xs[min(len(xs) - 1, int(0.99 * len(xs)))]:.0f} ms")
    ax.legend(fontsize=8)


def plot_compare(path: str, runs: list[tuple[str, dict[str, Any]]],
                 tables: list[str]) -> str:
    """Two `bench profile` reports side by side: each run's requests and steps in a column,
    on one time scale; their TTFT and ITL CDFs overlaid. Returns the HTML's path (beside
    the PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(15, 13))
    longest = max(r["elapsed_s"] for _, r in runs)
    for col, (name, report) in enumerate(runs):
        _request_bars(axes[0, col], report["requests"], report["origin"])
        _step_composition(axes[1, col], report["steps"], report["origin"])
        for row in (0, 1):
            axes[row, col].set_xlim(0, longest * 1.02)
            axes[row, col].set_title(f"{name}: {axes[row, col].get_title()}")
    _cdf_overlay(axes[2, 0], [(n, _ttft_ms(r)) for n, r in runs], "TTFT CDF")
    _cdf_overlay(axes[2, 1], [(n, _itl_ms(r)) for n, r in runs],
                 "ITL CDF, as the caller received tokens")
    fig.suptitle("aioengine bench compare: " + " vs ".join(n for n, _ in runs))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return _write_html(path, "aioengine bench compare", tables)
