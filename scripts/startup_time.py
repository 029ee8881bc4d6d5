"""Start-up of `aioengine serve` on the bundled model, process start to the first
`/health` 200, and the server's resident memory one second after: a cold start (an empty
AIOENGINE_CACHE_DIR) then --warm starts on the same cache, each its own process.

    .venv/bin/python scripts/startup_time.py --warm 2 [-- extra serve flags]
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def start_once(cache_dir: str, extra: list[str], module: str = "aioengine",
               timeout: float = 300.0) -> tuple[float, float]:
    """(seconds to the first /health 200, RSS MiB one second later) of `python -m module
    serve`."""
    port = _free_port()
    env = dict(os.environ, AIOENGINE_CACHE_DIR=cache_dir)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", module, "serve", "--port", str(port),
                             *extra], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        ready = time.perf_counter() - start
                        time.sleep(1.0)
                        return ready, _rss_mib(proc.pid)
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("no /health 200")
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm", type=int, default=2, help="warm starts after the cold one")
    ap.add_argument("--modules", default="aioengine",
                    help="comma-separated modules run as `python -m MODULE serve`, "
                         "interleaved per warm start (aioengine.cli: without the start-up "
                         "garbage-collector pause of aioengine/__main__.py)")
    ap.add_argument("extra", nargs="*", help="flags for aioengine serve (after --)")
    args = ap.parse_args()
    modules = args.modules.split(",")
    with tempfile.TemporaryDirectory(prefix="aioengine-startup-") as cache_dir:
        for i in range(1 + args.warm):
            for module in modules[:1] if i == 0 else modules:
                ready, rss = start_once(cache_dir, args.extra, module)
                print(f"{'cold' if i == 0 else 'warm'} ({module}): ready in {ready:.2f} s, "
                      f"RSS {rss:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
