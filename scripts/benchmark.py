"""Benchmarks: a thin wrapper around `aioengine.bench` (same as `aioengine bench ...`).

    python scripts/benchmark.py offline [--engines aioengine,hf,hf-cb] [flags]
    python scripts/benchmark.py serve --base-url http://127.0.0.1:8000 [flags]
    python scripts/benchmark.py latency [--engines aioengine,hf] [flags]

See `python scripts/benchmark.py {offline,serve,profile,latency} --help` and docs/benchmarks.md.
"""
from __future__ import annotations

import os
import sys

# Run as a file, the repository root is not on sys.path; add it so the checkout is
# benchmarked even without `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aioengine.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
