"""The soak test's traffic (aioengine/bench/soak.py): the request kinds sent with aiohttp
(so bodies can be malformed and streams dropped exactly where we choose), each answer
checked. The slow clients are in soak_clients.py; the long and context-length prompts, and
the seeded mix that sends every kind, in soak_mix.py.

Outcomes: ok; expected_4xx (a malformed body answered with its 4xx); unexpected_4xx; 5xx;
conn_error; timeout; bad_output (a 200 whose body is wrong or does not parse); held_open (a
stalled connection the server did not close in time). An Outcome's `label` names how a
slow-client or context-length case ended ("closed_by_server", "408_closed", "400", ...);
a short stream's `ttft_s` and `overlaps` (the long prompts and slow readers in flight
between its start and its first token) feed the report's TTFT comparison.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import jsonschema
import orjson

OUTCOMES = ("ok", "expected_4xx", "unexpected_4xx", "5xx", "conn_error", "timeout",
            "bad_output", "held_open")
BAD_OUTCOMES = frozenset(OUTCOMES[2:])
# What a short request may wait behind: the long prompts (a burst of the long kind, a
# near_context prompt) and slow readers of a stream.
OVERLAP_CLASSES = ("long", "near_context", "slow_reader")
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
    label: str = ""  # how a slow-client or context-length case ended
    ttft_s: float | None = None  # a stream's first token, since its start
    overlaps: list[str] = field(default_factory=list)  # OVERLAP_CLASSES in flight until then

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
    max_model_len: int = 0  # the served context (/v1/models)
    near_context_tokens: int = 0  # the near_context prompts' length
    keepalive_timeout_s: float = 20.0  # the server's --keepalive-timeout
    body_read_timeout_s: float = 60.0  # the server's --body-read-timeout
    # OVERLAP_CLASSES now in flight, and how many of each have started so far.
    active: collections.Counter = field(default_factory=collections.Counter)
    started: collections.Counter = field(default_factory=collections.Counter)

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80

    @contextlib.contextmanager
    def running(self, what: str) -> Iterator[None]:
        """Marks one of OVERLAP_CLASSES in flight for the duration."""
        self.active[what] += 1
        self.started[what] += 1
        try:
            yield
        finally:
            self.active[what] -= 1

    def snapshot(self) -> tuple[frozenset[str], dict[str, int]]:
        return frozenset(k for k, v in self.active.items() if v > 0), dict(self.started)

    def overlaps(self, since: tuple[frozenset[str], dict[str, int]]) -> list[str]:
        """The classes in flight at `since` (a snapshot) or started after it."""
        active, started = since
        return sorted(k for k in OVERLAP_CLASSES
                      if k in active or self.started[k] != started.get(k, 0))


def excerpt(data: Any, limit: int = 2000) -> str:
    text = data.decode(errors="replace") if isinstance(data, bytes) else (
        data if isinstance(data, str) else orjson.dumps(data).decode())
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def status_verdict(status: int, raw: bytes) -> Verdict:
    """A non-200 answer to a request that should have succeeded."""
    return ("5xx" if status >= 500 else "unexpected_4xx", status, excerpt(raw))


async def timed(t: Traffic, kind: str, body: Any, work: Awaitable[Verdict],
                info: dict[str, Any] | None = None, timeout_s: float | None = None) -> Outcome:
    """Runs `work` under the request timeout (or `timeout_s`); `info`, filled by the work:
    how a case ended (label), a stream's ttft_s and overlaps."""
    start = time.monotonic()
    timeout_s = timeout_s or t.timeout_s
    try:
        outcome, status, detail = await asyncio.wait_for(work, timeout_s)
    except asyncio.TimeoutError:
        outcome, status, detail = "timeout", None, f"no answer in {timeout_s:g} s"
    except (aiohttp.ClientError, ConnectionError) as e:
        outcome, status, detail = "conn_error", None, f"{type(e).__name__}: {e}"
    info = info or {}
    return Outcome(kind, outcome, status, round(start - t.t0, 3),
                   round(time.monotonic() - start, 3), detail,
                   excerpt(body, 600) if outcome in BAD_OUTCOMES else "",
                   label=info.get("label", ""), ttft_s=info.get("ttft_s"),
                   overlaps=info.get("overlaps", []))


async def exchange(t: Traffic, path: str, body: Any,
                   check: Callable[[dict], str | None]) -> Verdict:
    """POSTs `body`; `check(answer)` says what is wrong with a 200's JSON, or None."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with t.session.post(t.url + path, data=data, headers=t.headers) as r:
        status, raw = r.status, await r.read()
    if status != 200:
        return status_verdict(status, raw)
    try:
        why = check(orjson.loads(raw))
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
    return ("ok", 200, "") if why is None else ("bad_output", 200, f"{why}: {excerpt(raw)}")


def choices_check(n: int, max_tokens: int, chat: bool) -> Callable[[dict], str | None]:
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


def chat_body(t: Traffic, content: str, **fields: Any) -> dict[str, Any]:
    return {"model": t.model, "messages": [{"role": "user", "content": content}], **fields}


# ---- the kinds -------------------------------------------------------------------------------

async def _completion(t: Traffic, rng: random.Random) -> list[Outcome]:
    max_tokens = rng.randint(8, 64)
    body = {"model": t.model, "prompt": rng.choice(PROMPTS), "max_tokens": max_tokens,
            "temperature": rng.choice((0.0, 0.8))}
    check = choices_check(1, max_tokens, chat=False)
    return [await timed(t, "completion", body, exchange(t, "/v1/completions", body, check))]


async def _chat_n(t: Traffic, rng: random.Random) -> list[Outcome]:
    n, max_tokens = rng.randint(2, 4), rng.randint(16, 48)
    body = chat_body(t, rng.choice(QUESTIONS), n=n, temperature=1.0, max_tokens=max_tokens)
    check = choices_check(n, max_tokens, chat=True)
    return [await timed(t, "chat_n", body, exchange(t, "/v1/chat/completions", body, check))]


def _structured_check(out: dict) -> str | None:
    choice = out["choices"][0]
    try:
        jsonschema.validate(json.loads(choice["message"]["content"]), CAT_SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return f"finish {choice['finish_reason']}, not the schema: {str(e)[:200]}"
    return None


async def _structured(t: Traffic, rng: random.Random) -> list[Outcome]:
    body = chat_body(t, "Describe a cat as JSON.", temperature=rng.choice((0.0, 1.0)),
                     max_tokens=120, seed=rng.randint(0, 1 << 30),
                     response_format={"type": "json_schema", "json_schema": {
                         "name": "cat", "schema": CAT_SCHEMA, "strict": True}})
    work = exchange(t, "/v1/chat/completions", body, _structured_check)
    return [await timed(t, "structured", body, work)]


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
    body = chat_body(t, rng.choice(TOOL_ASKS), tools=TOOLS, tool_choice="required",
                     parallel_tool_calls=parallel, max_tokens=150,
                     temperature=rng.choice((0.0, 1.0)))
    work = exchange(t, "/v1/chat/completions", body, _tools_check(parallel))
    return [await timed(t, "tools", body, work)]


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


async def expect_error(t: Traffic, path: str, body: Any, expected: int,
                       must_say: str | None = None) -> Verdict:
    """POSTs `body`, which must get `expected` with an OpenAI error body (whose message
    contains `must_say`, if given: then the message is the detail)."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with t.session.post(t.url + path, data=data, headers=t.headers) as r:
        status, raw = r.status, await r.read()
    if status == expected:
        try:
            message = orjson.loads(raw)["error"]["message"]
            ok = isinstance(message, str) and (must_say is None or must_say in message)
        except (orjson.JSONDecodeError, KeyError, TypeError):
            ok = False
        if ok:
            return ("expected_4xx", status, message[:200] if must_say else "")
        why = f" saying {must_say!r}" if must_say else ""
        return ("bad_output", status, f"not an OpenAI error body{why}: {excerpt(raw)}")
    if status == 200:
        return ("bad_output", status, f"accepted (wanted {expected}): {excerpt(raw)}")
    return ("5xx" if status >= 500 else "unexpected_4xx", status,
            f"wanted {expected}: {excerpt(raw)}")


async def _malformed(t: Traffic, rng: random.Random) -> list[Outcome]:
    path, body, expected = rng.choice(_malformed_bodies(t.model))
    work = expect_error(t, path, body, expected)
    return [await timed(t, "malformed", body, work)]


def has_token(chunk: dict[str, Any]) -> bool:
    """Whether a stream chunk carries generated text (the role chunk does not)."""
    for c in chunk.get("choices") or ():
        delta = c.get("delta") or {}
        if c.get("text") or delta.get("content") or delta.get("tool_calls"):
            return True
    return False


async def _read_stream(t: Traffic, path: str, body: dict, cancel_after: int | None,
                       info: dict[str, Any]) -> Verdict:
    """Reads the SSE stream to [DONE], or drops the connection after `cancel_after` chunks;
    records the first token's time and what overlapped until then in `info`."""
    start, since = time.monotonic(), t.snapshot()
    async with t.session.post(t.url + path, data=orjson.dumps(body), headers=t.headers) as r:
        if r.status != 200:
            return status_verdict(r.status, await r.read())
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
                return ("bad_output", 200, f"chunk {chunks + 1} is not JSON: {excerpt(data)}")
            if "error" in chunk:
                return ("bad_output", 200, f"error event after {chunks} chunks: "
                        f"{excerpt(data)}")
            chunks += 1
            if "ttft_s" not in info and has_token(chunk):
                info["ttft_s"] = round(time.monotonic() - start, 3)
                info["overlaps"] = t.overlaps(since)
            finish = finish or next((c["finish_reason"] for c in chunk.get("choices", [])
                                     if c.get("finish_reason")), None)
            if cancel_after is not None and chunks >= cancel_after:
                r.close()  # closes the socket: the server sees a disconnect mid-stream
                return ("ok", 200, f"cancelled after {chunks} chunks")
    if not done or finish is None:
        return ("bad_output", 200, f"{chunks} chunks, finish {finish!r}, [DONE] {done}")
    return ("ok", 200, "")


async def stream_kind(t: Traffic, rng: random.Random, kind: str,
                      cancel_after: int | None, max_tokens: int) -> list[Outcome]:
    if rng.random() < 0.7:
        path = "/v1/chat/completions"
        body = chat_body(t, rng.choice(QUESTIONS), max_tokens=max_tokens, stream=True)
    else:
        path = "/v1/completions"
        body = {"model": t.model, "prompt": rng.choice(PROMPTS), "max_tokens": max_tokens,
                "stream": True}
    body["temperature"] = rng.choice((0.0, 0.7))
    if rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    info: dict[str, Any] = {}
    work = _read_stream(t, path, body, cancel_after, info)
    return [await timed(t, kind, body, work, info)]


async def _stream(t: Traffic, rng: random.Random) -> list[Outcome]:
    return await stream_kind(t, rng, "stream", None, rng.randint(16, 96))


async def _cancel(t: Traffic, rng: random.Random) -> list[Outcome]:
    # Long enough that the drop really lands mid-generation.
    return await stream_kind(t, rng, "cancel", rng.randint(0, 6), 200)


Kind = Callable[[Traffic, random.Random], Awaitable[list[Outcome]]]
# The short requests (and malformed bodies): name: (weight in the mix, sender).
SHORT_KINDS: dict[str, tuple[int, Kind]] = {
    "stream": (3, _stream), "cancel": (2, _cancel), "malformed": (2, _malformed),
    "tools": (1, _tools), "structured": (1, _structured), "completion": (2, _completion),
    "chat_n": (1, _chat_n)}
