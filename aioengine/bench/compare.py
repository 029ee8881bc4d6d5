"""`aioengine bench compare A.json B.json --plot PATH.png`: two saved `bench profile` runs
(`--save-json`) drawn side by side (bench/timeline_plot.py), with a line per run of what
each took, and the ratio."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_compare_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="two saved `bench profile` runs side by side")
    p.add_argument("runs", nargs=2, metavar="RUN.json",
                   help="reports written by `aioengine bench profile --save-json`")
    p.add_argument("--plot", required=True, metavar="PATH.png",
                   help="the picture (and PATH.html beside it)")
    p.set_defaults(func=compare_main)


def _load(path: str) -> dict[str, Any]:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {path}: {e}") from None
    if not (isinstance(report, dict) and report.get("mode") == "profile"
            and "requests" in report):
        raise SystemExit(f"error: {path} is not a `bench profile --save-json` report "
                         "(of this version: it needs each request's times)")
    return report


def compare_main(args: argparse.Namespace) -> int:
    from aioengine.bench.profile import format_profile
    import aioengine.bench.timeline_plot as tplot

    runs = [(Path(p).stem, _load(p)) for p in args.runs]
    if runs[0][0] == runs[1][0]:  # the same file name in two folders
        runs = [(str(Path(p).with_suffix("")), r) for p, (_, r) in zip(args.runs, runs)]
    lines = [f"{name}: {r['elapsed_s']:.2f} s, {len(r['requests'])} requests, "
             f"{len(r['steps'])} steps" for name, r in runs]
    lines.append(f"{runs[1][0]} / {runs[0][0]}: "
                 f"{runs[1][1]['elapsed_s'] / runs[0][1]['elapsed_s']:.3f}x the time")
    print("\n".join(lines))
    page = tplot.plot_compare(args.plot, runs,
                              ["\n".join(lines)] + [f"{n}\n{format_profile(r)}" for n, r in runs])
    print(f"saved {args.plot} and {page}", file=sys.stderr)
    return 0
