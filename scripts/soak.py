"""A soak test: a thin wrapper around `aioengine.bench.soak` (same as `aioengine bench soak`).

    python scripts/soak.py --duration 20m                       # starts its own server
    python scripts/soak.py --duration 2m --server-args "--num-kv-blocks 128"
    python scripts/soak.py --base-url http://127.0.0.1:8000 --server-pid PID --kv-blocks N

See `python scripts/soak.py --help`. Exit status 1 on any 5xx, unexpected outcome or KV
blocks still held after the traffic.
"""
from __future__ import annotations

import os
import sys

# Run as a file, the repository root is not on sys.path; add it so the checkout is
# soaked even without `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aioengine.bench.soak import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
