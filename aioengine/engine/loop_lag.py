"""The event loop's health as a number: how late a timer set on the loop fires.

The engine shares its asyncio loop with the server and, embedded, with the application's own
coroutines; anything that holds the loop (a long synchronous callback, the engine's own
output processing, an app's blocking call) delays every request's tokens. A watcher sleeps
LAG_INTERVAL_S at a time and observes how much later than due it woke: zero-ish on a healthy
loop, the length of the stall otherwise (`aioengine:event_loop_lag_seconds`). Ten wake-ups a
second cost a few microseconds each.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

LAG_INTERVAL_S = 0.1


async def watch_loop_lag(observe: Callable[[float], None],
                         interval: float = LAG_INTERVAL_S) -> None:
    """Until cancelled: every `interval` seconds, observe(seconds the wake-up came late)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval
        await asyncio.sleep(interval)
        observe(max(0.0, loop.time() - due))
