"""Helpers every bench mode shares: the workload and output flags, the thread count,
printing/saving a report, and the run's configuration as saved in it."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from aioengine.bench.datasets import add_dataset_args


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The dataset flags and where the report goes, for the modes that run a workload."""
    add_dataset_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--save-json", default=None, metavar="PATH",
                   help="config, environment, summary and per-request numbers")
    g.add_argument("--plot", default=None, metavar="PATH.png")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def set_threads(threads: int | None) -> int:
    """One torch thread count for every engine (default: all CPUs)."""
    import torch

    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    # The engine reads its thread count from here when it loads; keep both in step.
    os.environ["AIOENGINE_CPU_THREADS"] = str(threads)
    return threads


def emit(report: dict[str, Any], text: str, save_json: str | None) -> None:
    """Prints the report's table; saves the whole report as JSON when asked."""
    from aioengine.bench.report import save_json as save

    print(text)
    if save_json:
        save(save_json, report)
        print(f"saved {save_json}", file=sys.stderr)


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    # The API key stays out of saved results.
    return {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
