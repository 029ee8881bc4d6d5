"""The soak test's traffic (aioengine/bench/soak.py): a seeded mix of request kinds, each
sent as raw HTTP with aiohttp (so bodies can be malformed and streams dropped exactly where
we choose) and each answer checked.

Outcomes: ok; expected_4xx (a malformed body answered with its 4xx); unexpected_4xx; 5xx;
conn_error; timeout; bad_output (a 200 whose body is wrong or does not parse).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import jsonschema
import orjson

OUTCOMES = ("ok", "expected_4xx", "unexpected_4xx", "5xx", "conn_error", "timeout",
            "bad_output")
BAD_OUTCOMES = frozenset(OUTCOMES[2:])
Verdict = tuple[str, "int | None", str]  # (outcome, HTTP status, why)

QUESTIONS = ("Tell me about Paris.", "Write a haiku about rain.", "What is 17 times 3?",
             "Name three colors.", "Explain what a CPU does.", "Say hello in French.",
             "Describe a dog in one sentence.", "List the planets of the solar system.")
PROMPTS = ("The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The three laws of motion are", "My favourite recipe is")
# One token each for the bundled tokenizer, so a prompt of N words is ~N tokens.
WORDS = ("apple river stone cloud music garden window purple engine silver forest candle "
         "ocean paper thunder velvet").split()
CAT_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "colors": {"type": "array", "items": {"enum": ["black", "white", "orange"]},
               "maxItems": 2}},
    "required": ["name", "age", "colors"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                       "required": ["zone"]}}}]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TOOL_ASKS = ("What is the weather in Paris?", "What time is it in Tokyo?",
             "Is it raining in London?")


@dataclass
class Outcome:
    kind: str
    outcome: str
    status: int | None
    started_s: float  # since the traffic began
    latency_s: float
    detail: str = ""
    request: str = ""  # an excerpt of the body, kept for the unexpected ones

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Traffic:
    session: aiohttp.ClientSession
    url: str
    model: str
    headers: dict[str, str]
    timeout_s: float
    long_prompt_tokens: int
    long_burst: int
    t0: float
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # ends the traffic early


def _excerpt(data: Any, limit: int = 2000) -> str:
    text = data.decode(errors="replace") if isinstance(data, bytes) else (
        data if isinstance(data, str) else orjson.dumps(data).decode())
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _status_verdict(status: int, raw: bytes) -> Verdict:
    """A non-200 answer to a request that should have succeeded."""
    return ("5xx" if status >= 500 else "unexpected_4xx", status, _excerpt(raw))


async def _timed(t: Traffic, kind: str, body: Any, work: Awaitable[Verdict]) -> Outcome:
    start = time.monotonic()
    try:
        outcome, status, detail = await asyncio.wait_for(work, t.timeout_s)
    except asyncio.TimeoutError:
        outcome, status, detail = "timeout", None, f"no answer in {t.timeout_s:g} s"
    except (aiohttp.ClientError, ConnectionError) as e:
        outcome, status, detail = "conn_error", None, f"{type(e).__name__}: {e}"
    return Outcome(kind, outcome, status, round(start - t.t0, 3),
                   round(time.monotonic() - start, 3), detail,
                   _excerpt(body, 600) if outcome in BAD_OUTCOMES else "")


async def _exchange(t: Traffic, path: str, body: Any,
                    check: Callable[[dict], str | None]) -> Verdict:
    """POSTs `body`; `check(answer)` says what is wrong with a 200's JSON, or None."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with t.session.post(t.url + path, data=data, headers=t.headers) as r:
        status, raw = r.status, await r.read()
    if status != 200:
        return _status_verdict(status, raw)
    try:
        why = check(orjson.loads(raw))
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
    return ("ok", 200, "") if why is None else ("bad_output", 200, f"{why}: {_excerpt(raw)}")


def _choices_check(n: int, max_tokens: int, chat: bool) -> Callable[[dict], str | None]:
    def check(out: dict) -> str | None:
        choices = out["choices"]
        if sorted(c["index"] for c in choices) != list(range(n)):
            return f"choice indexes {[c['index'] for c in choices]} for n={n}"
        for c in choices:
            text = c["message"]["content"] if chat else c["text"]
            if not isinstance(text, str) or c["finish_reason"] not in ("stop", "length"):
                return f"choice {c['index']}: text {text!r}, finish {c['finish_reason']!r}"
        if out["usage"]["completion_tokens"] > n * max_tokens:
            return f"{out['usage']['completion_tokens']} tokens > {n} x {max_tokens}"
        return None
    return check


def _chat(t: Traffic, content: str, **fields: Any) -> dict[str, Any]:
    return {"model": t.model, "messages": [{"role": "user", "content": content}], **fields}


# ---- the kinds -------------------------------------------------------------------------------

async def _completion(t: Traffic, rng: random.Random) -> list[Outcome]:
    max_tokens = rng.randint(8, 64)
    body = {"model": t.model, "prompt": rng.choice(PROMPTS), "max_tokens": max_tokens,
            "temperature": rng.choice((0.0, 0.8))}
    check = _choices_check(1, max_tokens, chat=False)
    return [await _timed(t, "completion", body, _exchange(t, "/v1/completions", body, check))]


async def _chat_n(t: Traffic, rng: random.Random) -> list[Outcome]:
    n, max_tokens = rng.randint(2, 4), rng.randint(16, 48)
    body = _chat(t, rng.choice(QUESTIONS), n=n, temperature=1.0, max_tokens=max_tokens)
    check = _choices_check(n, max_tokens, chat=True)
    return [await _timed(t, "chat_n", body, _exchange(t, "/v1/chat/completions", body, check))]


def _structured_check(out: dict) -> str | None:
    choice = out["choices"][0]
    try:
        jsonschema.validate(json.loads(choice["message"]["content"]), CAT_SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return f"finish {choice['finish_reason']}, not the schema: {str(e)[:200]}"
    return None


async def _structured(t: Traffic, rng: random.Random) -> list[Outcome]:
    body = _chat(t, "Describe a cat as JSON.", temperature=rng.choice((0.0, 1.0)),
                 max_tokens=120, seed=rng.randint(0, 1 << 30),
                 response_format={"type": "json_schema", "json_schema": {
                     "name": "cat", "schema": CAT_SCHEMA, "strict": True}})
    work = _exchange(t, "/v1/chat/completions", body, _structured_check)
    return [await _timed(t, "structured", body, work)]


def _tools_check(parallel: bool) -> Callable[[dict], str | None]:
    def check(out: dict) -> str | None:
        choice = out["choices"][0]
        calls, finish = choice["message"].get("tool_calls") or [], choice["finish_reason"]
        # With parallel calls the model may go on calling until max_tokens; then the last
        # call is cut off, and only that one may fail to parse.
        complete = calls[:-1] if parallel and finish == "length" else calls
        if not calls or finish not in ("tool_calls", "length" if parallel else "tool_calls"):
            return f"finish {finish} with {len(calls)} calls"
        if not parallel and len(calls) != 1:
            return f"{len(calls)} calls with parallel_tool_calls false"
        for call in complete:
            name = call["function"]["name"]
            if name not in TOOL_SCHEMAS:
                return f"unknown function {name!r}"
            try:
                jsonschema.validate(json.loads(call["function"]["arguments"]),
                                    TOOL_SCHEMAS[name])
            except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                return f"arguments of {name}: {str(e)[:200]}"
        return None
    return check


async def _tools(t: Traffic, rng: random.Random) -> list[Outcome]:
    parallel = rng.random() < 1 / 3
    body = _chat(t, rng.choice(TOOL_ASKS), tools=TOOLS, tool_choice="required",
                 parallel_tool_calls=parallel, max_tokens=150,
                 temperature=rng.choice((0.0, 1.0)))
    work = _exchange(t, "/v1/chat/completions", body, _tools_check(parallel))
    return [await _timed(t, "tools", body, work)]


def _malformed_bodies(model: str) -> list[tuple[str, Any, int]]:
    """(path, body, the status it must get)."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    comp = {"model": model, "prompt": "Hi", "max_tokens": 4}
    return [("/v1/chat/completions", b"{not json", 400),
            ("/v1/completions", b"", 400),
            ("/v1/completions", b"[1, 2]", 400),
            ("/v1/completions", b'\xff\xfe{"model"', 400),  # not UTF-8
            ("/v1/completions", b"[" * 2000, 400),  # past the JSON parser's depth limit
            ("/v1/completions", {**comp, "max_tokens": -5}, 400),
            ("/v1/completions", {**comp, "max_tokens": "many"}, 400),
            ("/v1/completions", {**comp, "temperature": "hot"}, 400),
            ("/v1/completions", {**comp, "max_tokens": 10 ** 6}, 400),
            ("/v1/completions", {**comp, "prompt": [1, 10 ** 7]}, 400),
            ("/v1/completions", {**comp, "model": "no-such-model"}, 404),
            ("/v1/completions", {**comp, "stop": 5}, 400),
            ("/v1/completions", {**comp, "stream": "yes"}, 400),
            ("/v1/chat/completions", {**chat, "messages": "hi"}, 400),
            ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": 5}]},
             400),
            ("/v1/chat/completions", {**chat, "tool_choice": "required"}, 400),  # no tools
            ("/v1/chat/completions", {**chat, "n": 0}, 400),
            ("/v1/chat/completions", {**chat, "stream": True, "top_p": 1.5}, 400),
            ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema",
             "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, 400),
            ("/v1/chat/completions", {**chat, "tools": [{"type": "function",
             "function": {"name": "f", "parameters": {"type": "array"}}}]}, 400)]


async def _malformed_exchange(t: Traffic, path: str, body: Any, expected: int) -> Verdict:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with t.session.post(t.url + path, data=data, headers=t.headers) as r:
        status, raw = r.status, await r.read()
    if status == expected:
        try:
            ok = isinstance(orjson.loads(raw)["error"]["message"], str)
        except (orjson.JSONDecodeError, KeyError, TypeError):
            ok = False
        return ("expected_4xx", status, "") if ok else (
            "bad_output", status, f"not an OpenAI error body: {_excerpt(raw)}")
    if status == 200:
        return ("bad_output", status, f"accepted (wanted {expected}): {_excerpt(raw)}")
    return ("5xx" if status >= 500 else "unexpected_4xx", status,
            f"wanted {expected}: {_excerpt(raw)}")


async def _malformed(t: Traffic, rng: random.Random) -> list[Outcome]:
    path, body, expected = rng.choice(_malformed_bodies(t.model))
    work = _malformed_exchange(t, path, body, expected)
    return [await _timed(t, "malformed", body, work)]


async def _read_stream(t: Traffic, path: str, body: dict, cancel_after: int | None) -> Verdict:
    """Reads the SSE stream to [DONE], or drops the connection after `cancel_after` chunks."""
    async with t.session.post(t.url + path, data=orjson.dumps(body), headers=t.headers) as r:
        if r.status != 200:
            return _status_verdict(r.status, await r.read())
        chunks, finish, done = 0, None, False
        if cancel_after == 0:
            r.close()  # right after the headers: the request may not have run at all yet
            return ("ok", 200, "cancelled after 0 chunks")
        async for line in r.content:
            data = line.strip().removeprefix(b"data:").strip()
            if not line.startswith(b"data:"):
                continue
            if data == b"[DONE]":
                done = True
                break
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                return ("bad_output", 200, f"chunk {chunks + 1} is not JSON: {_excerpt(data)}")
            if "error" in chunk:
                return ("bad_output", 200, f"error event after {chunks} chunks: "
                        f"{_excerpt(data)}")
            chunks += 1
            finish = finish or next((c["finish_reason"] for c in chunk.get("choices", [])
                                     if c.get("finish_reason")), None)
            if cancel_after is not None and chunks >= cancel_after:
                r.close()  # closes the socket: the server sees a disconnect mid-stream
                return ("ok", 200, f"cancelled after {chunks} chunks")
    if not done or finish is None:
        return ("bad_output", 200, f"{chunks} chunks, finish {finish!r}, [DONE] {done}")
    return ("ok", 200, "")


async def _stream_kind(t: Traffic, rng: random.Random, kind: str,
                       cancel_after: int | None, max_tokens: int) -> list[Outcome]:
    if rng.random() < 0.7:
        path = "/v1/chat/completions"
        body = _chat(t, rng.choice(QUESTIONS), max_tokens=max_tokens, stream=True)
    else:
        path = "/v1/completions"
        body = {"model": t.model, "prompt": rng.choice(PROMPTS), "max_tokens": max_tokens,
                "stream": True}
    body["temperature"] = rng.choice((0.0, 0.7))
    if rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return [await _timed(t, kind, body, _read_stream(t, path, body, cancel_after))]


async def _stream(t: Traffic, rng: random.Random) -> list[Outcome]:
    return await _stream_kind(t, rng, "stream", None, rng.randint(16, 96))


async def _cancel(t: Traffic, rng: random.Random) -> list[Outcome]:
    # Long enough that the drop really lands mid-generation.
    return await _stream_kind(t, rng, "cancel", rng.randint(0, 6), 200)


async def _long_one(t: Traffic, rng: random.Random) -> Outcome:
    # Random words: no two prompts share a prefix, so the prefix cache cannot make room.
    prompt = " ".join(rng.choice(WORDS) for _ in range(t.long_prompt_tokens))
    max_tokens = rng.randint(16, 48)
    body = {"model": t.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    check = _choices_check(1, max_tokens, chat=False)
    return await _timed(t, "long", body, _exchange(t, "/v1/completions", body, check))


async def _long(t: Traffic, rng: random.Random) -> list[Outcome]:
    """`long_burst` long prompts at once (one worker's turn): together they need more KV
    blocks than the cache has, so the scheduler must preempt."""
    seeds = [rng.randint(0, 1 << 30) for _ in range(t.long_burst)]
    return list(await asyncio.gather(*(_long_one(t, random.Random(s)) for s in seeds)))


Kind = Callable[[Traffic, random.Random], Awaitable[list[Outcome]]]
# name: (weight in the mix, sender)
KINDS: dict[str, tuple[int, Kind]] = {
    "long": (1, _long), "stream": (3, _stream), "cancel": (2, _cancel),
    "malformed": (2, _malformed), "tools": (1, _tools), "structured": (1, _structured),
    "completion": (2, _completion), "chat_n": (1, _chat_n)}


async def _worker(t: Traffic, kinds: list[str], first: int, rng: random.Random,
                  deadline: float, results: list[Outcome]) -> None:
    weights = [KINDS[k][0] for k in kinds]
    # Worker i starts with the i-th kind, so that even a short soak covers the mix (with
    # enough workers) and the warm-up sees every code path.
    kind = kinds[first % len(kinds)]
    while time.monotonic() < deadline and not t.stop.is_set():
        outcomes = await KINDS[kind][1](t, rng)
        results.extend(outcomes)
        if any(o.outcome in ("conn_error", "5xx") for o in outcomes):
            await asyncio.sleep(1.0)  # a failing server is not hammered (nor the report)
        kind = rng.choices(kinds, weights)[0]


async def run_workers(t: Traffic, kinds: list[str], concurrency: int, seed: int,
                      deadline: float) -> list[Outcome]:
    """`concurrency` workers until `deadline` (monotonic); requests in flight then finish."""
    results: list[Outcome] = []
    await asyncio.gather(*(_worker(t, kinds, i, random.Random(seed * 1000 + i), deadline,
                                   results) for i in range(concurrency)))
    return sorted(results, key=lambda r: r.started_s)
