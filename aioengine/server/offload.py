"""Work of one request that grows with its body (parsing a prompt's token ids, tokenizing,
chat-template rendering, detokenizing) runs off the event loop once the body is large, so
/health, streaming and every other request go on while it runs.

A 6 MB prompt took ~12 s to tokenize on the 2-core AMD EPYC this was measured on, and a
200,000-message chat ~15 s to render; inline, the loop answered nothing for that long.
Parsing itself holds the GIL in one C call (orjson: ~0.15 s for 8 MB of token ids), so a
body of PARSE_OFF_LOOP_BYTES or more is parsed incrementally on a thread instead
(`parse_json_chunks`, ijson's C parser fed the body's chunks one at a time, yielding the
GIL to the loop between chunks).
The tokenizer's batch calls (Rust) release the GIL; Jinja and the Python checks keep it,
but the interpreter hands it to the loop every 5 ms (its switch interval).

Tokenizing goes straight to a fast tokenizer's Rust backend (`encode_text`, `decode_ids`),
which gives the same ids and text as transformers' wrapper, through its batch calls, the
ones that release the GIL: on a thread, transformers' encode of a 6 MB prompt still held the
GIL for 0.6 s at a time (Python lists of every field, then freeing the offsets and token
strings), its decode of 3.9M ids for 2 s (a Python check of every id, then the backend's
`decode`, which keeps the GIL). `encode_batch_fast` skips the offsets (2.7x faster), and a
prompt over the context is refused from its token count, before its ids become a list.

Small bodies stay inline: the hop through a thread adds ~0.1-0.3 ms to the request, while
inline work on a body under INLINE_BODY_BYTES blocks the loop for ~1 ms at most (measured
with the bundled tokenizer: 16 chars 65 us inline / 171 us through a thread, 256 chars
158 / 284 us, 1 KiB 633 / 857 us, 4 KiB 2.2 / 2.5 ms, 64 KiB 46 / 46 ms).
"""
from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import ijson
from aiohttp import web

T = TypeVar("T")

INLINE_BODY_BYTES = 2048
# orjson parses ~1 MiB of token ids in ~10-25 ms on the loop; past that, incrementally on a
# thread (several times slower in all, but the loop waits at most one piece's parse, ~1 ms).
PARSE_OFF_LOOP_BYTES = 1 << 20
_PARSE_PIECE_BYTES = 1 << 14  # ~1 ms of parsing between two chances for the loop
# Two threads: a second large request does not wait for the first; more would only take
# cores from the forward (each call tokenizes on one thread).
PROMPT_THREADS = 2
BODY_BYTES = web.RequestKey("body_bytes", int)


def body_bytes(request: web.Request) -> int:
    """The size of the request's body as read (0 for a route that reads none)."""
    return request.get(BODY_BYTES, 0)


def _backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind a fast tokenizer when calling it directly gives what the
    wrapper gives (no truncation or padding set on it), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or not hasattr(backend, "encode_batch_fast")
            or backend.truncation is not None or backend.padding is not None):
        return None
    return backend


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True,
                check_length: Callable[[int], None] | None = None) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...)`; `check_length(count)` is called
    with the token count first (it raises for a prompt over the context)."""
    backend = _backend(tokenizer)
    if backend is None:
        ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if check_length is not None:
            check_length(len(ids))
        return ids
    encoding = backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
    if check_length is not None:
        check_length(len(encoding))
    return encoding.ids


def decode_ids(tokenizer: Any, token_ids: list[int]) -> str:
    """`tokenizer.decode(token_ids)` (special tokens kept)."""
    backend = _backend(tokenizer)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.decode(token_ids)
    return backend.decode_batch([token_ids], skip_special_tokens=False)[0]


def parse_json_chunks(chunks: list[bytes]) -> Any:
    """The JSON value of the concatenated `chunks`, parsed one chunk per C call, so another
    thread takes the GIL between them. As orjson.loads, except that a lone surrogate escape
    becomes '?' and an integer past 64 bits is an error; raises ValueError when invalid."""
    values = ijson.sendable_list()
    parser = ijson.items_coro(values, "", use_float=True)
    try:
        for chunk in chunks:
            for start in range(0, len(chunk), _PARSE_PIECE_BYTES):
                parser.send(chunk[start:start + _PARSE_PIECE_BYTES])
                time.sleep(1e-4)  # the GIL free long enough for the loop to take it
        parser.close()
    except ijson.JSONError as e:
        raise ValueError(" ".join(str(e).split())) from None
    if len(values) != 1:
        raise ValueError("the body holds no JSON value")
    return values[0]


class PromptWork:
    """Runs a request's body-sized work inline or on a small pool of threads."""

    def __init__(self, threads: int = PROMPT_THREADS,
                 inline_below: int = INLINE_BODY_BYTES) -> None:
        self.inline_below = inline_below
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="aioengine-prompt")

    async def run(self, request: web.Request, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`: inline for a small body, else on a thread (a cancelled request's
        call is dropped if it has not started; one that has runs to its end)."""
        return await self.run_sized(body_bytes(request), fn, *args)

    async def run_sized(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`run` for a body of `size` bytes (run-batch: one line of its file)."""
        if size < self.inline_below:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    async def run_off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a thread, whatever its size (callers without an HTTP request,
        such as a batch file's lines, cannot tell)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
