"""Cost of stop strings: time per output token (TPOT) on the real engine, and the event
loop's longest stall, with no stop strings and with hostile stop lists.

Cases (each a request of --output-len tokens, greedy, EOS ignored, on the bundled model
unless --model; --n samples where the case says so):
  none        no stop strings
  random1k    1,000 random 12-character stop strings (lowercase + digits: never match)
  quadratic   1,000 stop strings of 2,100 characters, each a prefix of the greedy output
              (cut at a different length) followed by junk: the hold-back must consider
              every one of them against a long suffix of the text, every step
  random100k  100,000 random stop strings, n=8 samples (the Python API has no limit on
              the number; the server's --max-stop-strings does)

Cases run interleaved (A B C A B C ...) --repeats times; the table gives the median TPOT,
its ratio to `none`, the time add_request took (building the matcher), and the longest
and 99th-percentile lateness of a 5 ms asyncio ticker while the request ran (what a
/health poll would have waited).

    .venv/bin/python scripts/stop_strings_bench.py --cases none,random1k --repeats 5
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import string
import time

from aioengine import AsyncEngine, SamplingParams

PROMPT = "Write a long story about a lighthouse keeper and the sea."
_TICK_S = 0.005


def random_stops(count: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = string.ascii_lowercase + string.digits
    return ["".join(rng.choices(alphabet, k=length)) for _ in range(count)]


def quadratic_stops(output: str, count: int, length: int, seed: int) -> list[str]:
    """`count` strings of `length` chars: output[:m] + junk, m spread over the output (the
    longest is all of it, so the whole text stays held back until the end)."""
    rng = random.Random(seed)
    stops = []
    for i in range(count):
        m = (i + 1) * len(output) // count
        junk = "".join(rng.choices("#~|^", k=max(1, length - m)))
        stops.append((output[:m] + junk)[:max(length, m + 1)])
    return stops


async def lag_probe(lags: list[float], stop: asyncio.Event) -> None:
    """How late each 5 ms sleep wakes up: the event loop's stalls."""
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(_TICK_S)
        lags.append(time.perf_counter() - start - _TICK_S)


async def run_once(engine: AsyncEngine, stops: list[str], n: int, output_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, n=n,
                            stop=stops or None)
    prepared = await engine.prepare(PROMPT, params)
    lags: list[float] = []
    done = asyncio.Event()
    probe = asyncio.create_task(lag_probe(lags, done))
    await asyncio.sleep(2 * _TICK_S)
    start = time.perf_counter()
    token_times: dict[int, list[float]] = {}
    add_s = None
    async for out in engine.generate(prepared):
        now = time.perf_counter()
        if add_s is None:
            add_s = now - start
        for c in out.outputs:
            token_times.setdefault(c.index, []).extend([now] * max(1, len(c.token_ids)))
    done.set()
    await probe
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times.values() if len(t) > 1]
    lags.sort()
    return {"tpot_ms": 1e3 * statistics.mean(tpots), "total_s": time.perf_counter() - start,
            "lag_max_ms": 1e3 * lags[-1],
            "lag_p99_ms": 1e3 * lags[min(len(lags) - 1, int(0.99 * len(lags)))]}


async def add_request_ms(engine: AsyncEngine, stops: list[str], n: int) -> float:
    """Time of the synchronous part of queueing the request (detokenizers built there)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, n=n,
                            stop=stops or None)
    prepared = await engine.prepare(PROMPT, params)
    start = time.perf_counter()
    request_id, _ = engine._add_request(prepared)
    elapsed = time.perf_counter() - start
    engine._abort(request_id)
    engine._forget(request_id)
    return 1e3 * elapsed


async def greedy_output(engine: AsyncEngine, output_len: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    text = ""
    async for out in engine.generate(PROMPT, params):
        text = out.outputs[0].cumulative_text if out.outputs else text
    return text


async def main_async(args: argparse.Namespace) -> dict[str, list[dict]]:
    engine = await AsyncEngine.create(args.model, dtype=args.dtype)
    try:
        output = await greedy_output(engine, args.output_len)
        cases = {"none": ([], 1), "random1k": (random_stops(1000, 12, 1), 1),
                 "quadratic": (quadratic_stops(output, 1000, 2100, 2), 1),
                 "random100k": (random_stops(100_000, 12, 3), 8)}
        chosen = {name: cases[name] for name in args.cases}
        results: dict[str, list[dict]] = {name: [] for name in chosen}
        for rep in range(args.repeats):
            for name, (stops, n) in chosen.items():
                row = await run_once(engine, stops, n, args.output_len)
                row["add_ms"] = await add_request_ms(engine, stops, n)
                results[name].append(row)
                print(f"  rep {rep} {name:10s} TPOT {row['tpot_ms']:7.2f} ms  "
                      f"lag max {row['lag_max_ms']:8.1f} ms", flush=True)
    finally:
        await engine.shutdown()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cases", type=lambda s: s.split(","), default=["none", "random1k"],
                    help="comma-separated: none,random1k,quadratic,random100k")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    results = asyncio.run(main_async(args))
    base = statistics.median(r["tpot_ms"] for r in results.get("none", [])) \
        if "none" in results else None
    print(f"\n{'case':11s} {'TPOT ms':>8s} {'x none':>7s} {'add ms':>8s} "
          f"{'lag p99 ms':>10s} {'lag max ms':>10s}  (median of {args.repeats}; "
          f"lag: max over repeats)")
    for name, rows in results.items():
        tpot = statistics.median(r["tpot_ms"] for r in rows)
        ratio = f"{tpot / base:7.3f}" if base else "      -"
        print(f"{name:11s} {tpot:8.2f} {ratio} {statistics.median(r['add_ms'] for r in rows):8.1f} "
              f"{max(r['lag_p99_ms'] for r in rows):10.1f} {max(r['lag_max_ms'] for r in rows):10.1f}")


if __name__ == "__main__":
    main()
