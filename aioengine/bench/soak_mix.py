"""The soak's seeded mix (aioengine/bench/soak.py): every kind of request, the long and
context-length prompts (here), the short ones (soak_traffic.py) and the slow clients
(soak_clients.py), sent by `concurrency` workers until the deadline.

- long: `long_burst` prompts of `long_prompt_tokens` at once, more KV blocks together than
  the cache has, so the scheduler must preempt.
- near_context: one prompt of `near_context_tokens`, near the served context (and the KV
  cache), while the short requests run; it must complete.
- over_context: a prompt a little over the context (completion or chat), which must get a
  400 that says so (never a 500, never a stall).

A slow client does not hold up its worker: it runs in the background (at most
`concurrency` at once; beyond that the worker waits for it), and none starts that would
outlast the traffic. Besides the workers' draws, one more is started every
`slow_client_interval_s`, so that a busy server (whose workers take few turns) still sees
a steady stream of them.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable
from typing import Any

from aioengine.bench.soak_clients import needed_s, slow_body, slow_head, slow_reader
from aioengine.bench.soak_hostile import hostile
from aioengine.bench.soak_traffic import (SHORT_KINDS, WORDS, Kind, Outcome, Traffic,
                                          choices_check, expect_error, exchange, stream_kind,
                                          timed)


def _words(rng: random.Random, n: int) -> str:
    # Random words: no two prompts share a prefix, so the prefix cache cannot make room.
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _long_one(t: Traffic, rng: random.Random) -> Outcome:
    max_tokens = rng.randint(16, 48)
    body = {"model": t.model, "prompt": _words(rng, t.long_prompt_tokens),
            "max_tokens": max_tokens, "temperature": 0.0}
    check = choices_check(1, max_tokens, chat=False)
    with t.running("long"):
        return await timed(t, "long", body, exchange(t, "/v1/completions", body, check))


async def _long(t: Traffic, rng: random.Random) -> list[Outcome]:
    """`long_burst` long prompts at once (one worker's turn): together they need more KV
    blocks than the cache has, so the scheduler must preempt."""
    seeds = [rng.randint(0, 1 << 30) for _ in range(t.long_burst)]
    return list(await asyncio.gather(*(_long_one(t, random.Random(s)) for s in seeds)))


async def _near_context(t: Traffic, rng: random.Random) -> list[Outcome]:
    n, max_tokens = t.near_context_tokens, 16
    body = {"model": t.model, "prompt": _words(rng, n), "max_tokens": max_tokens,
            "temperature": 0.0}
    choices = choices_check(1, max_tokens, chat=False)

    def check(out: dict[str, Any]) -> str | None:
        prompt_tokens = out["usage"]["prompt_tokens"]
        if prompt_tokens < 0.95 * n:
            return f"{prompt_tokens} prompt tokens for {n} words"
        return choices(out)

    with t.running("near_context"):
        outcome = await timed(t, "near_context", body,
                              exchange(t, "/v1/completions", body, check))
    outcome.label = "completed" if outcome.outcome == "ok" else outcome.outcome
    return [outcome]


async def _over_context(t: Traffic, rng: random.Random) -> list[Outcome]:
    prompt = _words(rng, t.max_model_len + rng.randint(1, 256))
    if rng.random() < 0.5:
        path = "/v1/completions"
        body: dict[str, Any] = {"model": t.model, "prompt": prompt, "max_tokens": 16}
    else:
        path = "/v1/chat/completions"
        body = {"model": t.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 16}
    outcome = await timed(t, "over_context", body,
                          expect_error(t, path, body, 400, must_say="context"))
    outcome.label = str(outcome.status or outcome.outcome)
    return [outcome]


# name: (weight in the mix, sender). Worker i's first turns are kinds i, i + concurrency,
# ..., so that even a short soak covers the mix: the ones that take no time (a slow client
# runs in the background, over_context and malformed are answered at once) come first, so
# that a worker's second planned kind starts at once too.
KINDS: dict[str, tuple[int, Kind]] = {
    "slow_head": (1, slow_head), "slow_body": (1, slow_body), "slow_reader": (1, slow_reader),
    "over_context": (1, _over_context), "malformed": SHORT_KINDS["malformed"],
    "hostile": (1, hostile),
    "long": (1, _long), **{k: v for k, v in SHORT_KINDS.items() if k != "malformed"},
    "near_context": (1, _near_context)}
BACKGROUND = frozenset({"slow_head", "slow_body", "slow_reader"})


class _Mix:
    """What the workers share: the kinds, the results and the slow clients running."""

    def __init__(self, t: Traffic, kinds: list[str], concurrency: int, deadline: float) -> None:
        self.t, self.kinds, self.deadline = t, kinds, deadline
        self.results: list[Outcome] = []
        self.background: set[asyncio.Task] = set()
        self.max_background = concurrency

    def fits(self, kind: str) -> bool:
        """Whether `kind` may start now: a slow client only if it ends before the deadline."""
        return kind not in BACKGROUND or (
            time.monotonic() + needed_s(self.t, kind) < self.deadline)

    async def _collect(self, work: Awaitable[list[Outcome]]) -> None:
        self.results.extend(await work)

    async def turn(self, kind: str, rng: random.Random) -> list[Outcome]:
        send = KINDS[kind][1]
        if kind in BACKGROUND and len(self.background) < self.max_background:
            task = asyncio.create_task(self._collect(send(self.t, random.Random(rng.random()))))
            self.background.add(task)
            task.add_done_callback(self.background.discard)
            return []
        return await send(self.t, rng)

    async def spawner(self, interval_s: float, rng: random.Random) -> None:
        """A slow client (of those in the mix) every `interval_s`, in the background."""
        slow = [k for k in self.kinds if k in BACKGROUND]
        while slow and interval_s > 0 and not self.t.stop.is_set():
            await asyncio.sleep(interval_s)
            fitting = [k for k in slow if self.fits(k)]
            if not fitting:
                return
            if len(self.background) < self.max_background:
                await self.turn(rng.choice(fitting), rng)

    async def worker(self, first: list[str], rng: random.Random) -> None:
        planned = list(first)
        while time.monotonic() < self.deadline and not self.t.stop.is_set():
            fitting = [k for k in self.kinds if self.fits(k)]
            if not fitting:
                return
            kind = planned.pop(0) if planned else rng.choices(
                fitting, [KINDS[k][0] for k in fitting])[0]
            if not self.fits(kind):
                continue
            outcomes = await self.turn(kind, rng)
            self.results.extend(outcomes)
            if any(o.outcome in ("conn_error", "5xx") for o in outcomes):
                await asyncio.sleep(1.0)  # a failing server is not hammered (nor the report)


async def ttft_alone(t: Traffic, n: int, seed: int) -> list[Outcome]:
    """`n` short streams one after the other on the idle server, before the traffic: the
    TTFT the report compares the others' with."""
    rng = random.Random(seed)
    return [o for _ in range(n) for o in await stream_kind(t, rng, "alone", None, 16)]


async def run_workers(t: Traffic, kinds: list[str], concurrency: int, seed: int,
                      deadline: float, slow_client_interval_s: float = 0.0) -> list[Outcome]:
    """`concurrency` workers (and the slow-client spawner) until `deadline` (monotonic);
    requests in flight then finish, and so do the slow clients."""
    mix = _Mix(t, kinds, concurrency, deadline)
    spawner = asyncio.create_task(mix.spawner(slow_client_interval_s,
                                              random.Random(seed * 1000 - 1)))
    await asyncio.gather(*(mix.worker(kinds[i::concurrency], random.Random(seed * 1000 + i))
                           for i in range(concurrency)))
    await spawner
    while mix.background:
        await asyncio.gather(*list(mix.background))
    return sorted(mix.results, key=lambda r: r.started_s)
