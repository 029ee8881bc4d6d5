"""The client side of the Ray Serve e2e tests (test_ray_serve.py): which replica answered,
and the streams and probes its failure tests drive through the real `openai` client."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
from server_process import MODEL

REPLICA_HEADER = "x-aioengine-replica"


def replica_of(raw) -> str:
    replica = raw.headers.get(REPLICA_HEADER)
    assert replica, dict(raw.headers)
    return replica


def complete(client: openai.OpenAI, prompt: str, max_tokens: int = 4):
    """A completion and the replica that answered it."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt,
                                                      max_tokens=max_tokens, temperature=0)
    return raw.parse(), replica_of(raw)


def stream_long_answers(client: openai.OpenAI, prefix: str, replica: str, n: int = 2):
    """Starts `n` long streams that affinity puts on `replica`; each future gives
    ("finished", its last finish reason) or ("error", the error class that ended it)."""
    def stream(i: int) -> tuple[str, str | None]:
        try:
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=f"{prefix} Story {i}:", max_tokens=400, temperature=0,
                stream=True)
            assert replica_of(raw) == replica
            reasons = [c.choices[0].finish_reason for c in raw.parse() if c.choices]
            return "finished", reasons[-1]
        except openai.APIError as e:
            return "error", type(e).__name__

    pool = ThreadPoolExecutor(n)
    futures = [pool.submit(stream, i) for i in range(n)]
    pool.shutdown(wait=False)
    time.sleep(1.0)  # they are decoding
    return futures


def assert_failed_cleanly(futures) -> None:
    """Each in-flight stream ended, within a bounded time, with an error event or error
    finish (never a hang, never a normal end)."""
    ended = [f.result(timeout=60) for f in futures]
    assert all(outcome in (("finished", "error"), ("finished", "abort")) or
               outcome[0] == "error" for outcome in ended), ended


def assert_served_elsewhere_then_replaced(client: openai.OpenAI, gone: str,
                                          prefix: str) -> None:
    """New requests (the dead replica's prefix too) go to the other replica; then Ray
    brings up a replacement that serves."""
    served_by = {complete(client, p)[1] for p in (prefix + " After.", "Hello", "Another")}
    assert gone not in served_by and len(served_by) == 1
    survivor = served_by.pop()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        with ThreadPoolExecutor(4) as pool:
            seen = set(pool.map(lambda i: complete(client, f"Probe {i} {time.time()}")[1],
                                range(4)))
        if seen - {gone, survivor}:
            return
        time.sleep(1.0)
    raise AssertionError("Ray did not bring the replica back")
