"""The work budget of one request, counted before any work is done (issue 48).

Every limit here bounds something a single client could otherwise make the server do or keep
without end: nesting the parser follows, inputs a pooling call runs, stop strings matched per
token, `logit_bias` entries applied per sample, tools rendered into a prompt, schema bytes
compiled, and bytes the Responses store keeps. Over a limit is a 400 naming the field and the
limit (and the flag that raises it); each field is a `serve` flag (serve_args.LIMIT_FLAGS).

The defaults follow OpenAI's own limits where it has one (300 `logit_bias` entries, 128 tools,
2,048 embedding inputs) and are otherwise far above what a real client sends.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from aioengine.server.protocol import ApiError

# OpenAI's limits on a Responses `metadata` object (its API reference): fixed by the API,
# so not flags.
METADATA_MAX_KEYS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


@dataclass(frozen=True)
class RequestLimits:
    # Nesting of the request body's JSON (objects and arrays), the same for every parser
    # path (orjson inline, ijson on a thread for a large body).
    max_json_depth: int = 64
    # Inputs of one /v1/embeddings, /pooling call; documents of one /score or /rerank call.
    max_pooling_inputs: int = 2048
    # Stop strings of one request: how many, and their characters in all. The request's
    # stop automaton is built on the event loop at ~3-10 us a character (stop_strings.py),
    # so the characters bound that one-time stall (~50-150 ms at the limit).
    max_stop_strings: int = 1024
    max_stop_chars: int = 16384
    # `logit_bias` entries (OpenAI allows 300).
    max_logit_bias: int = 300
    # Tools of one chat or Responses request (OpenAI allows 128).
    max_tools: int = 128
    # Bytes (as compact JSON) of one request's output schema, and of its tools in all.
    max_schema_bytes: int = 256 << 10
    # Bytes the Responses store keeps in all (as well as --max-stored-responses entries).
    max_stored_response_bytes: int = 256 << 20


# ---- checks, each before the work it bounds ------------------------------------------------

_BACKSLASH, _QUOTE = 0x5C, 0x22
# Bytes scanned per numpy pass: bounds the temporaries (~9 bytes per byte scanned).
_DEPTH_PIECE_BYTES = 1 << 20


@dataclass
class _DepthScan:
    """What json_depth carries from one piece of the body to the next."""

    depth: int = 0
    max_depth: int = 0
    in_string: bool = False
    backslashes: int = 0  # the run of backslashes that ended the last piece

    def feed(self, piece: bytes) -> None:
        b = np.frombuffer(piece, np.uint8)
        n = len(b)
        # Index of the last non-backslash byte at or before each position (-1: none yet).
        last = np.maximum.accumulate(np.where(b == _BACKSLASH, -1, np.arange(n)))
        quotes = np.flatnonzero(b == _QUOTE)
        before = np.maximum(quotes - 1, 0)
        # The run of backslashes right before each quote; odd means the quote is escaped.
        run = np.where(quotes > 0, quotes - 1 - last[before], 0)
        run += np.where((quotes == 0) | (last[before] == -1), self.backslashes, 0)
        real = quotes[run % 2 == 0]
        # '[' 0x5b and '{' 0x7b both become 0x7b with bit 5 set, ']' and '}' 0x7d.
        folded = b | 0x20
        brackets = np.flatnonzero((folded == 0x7B) | (folded == 0x7D))
        outside = (np.searchsorted(real, brackets) + self.in_string) % 2 == 0
        steps = np.where(folded[brackets[outside]] == 0x7B, 1, -1)
        if len(steps):
            levels = np.cumsum(steps) + self.depth
            self.max_depth = max(self.max_depth, int(levels.max()))
            self.depth = int(levels[-1])
        self.in_string ^= bool(len(real) % 2)
        self.backslashes = (self.backslashes + n) if last[-1] == -1 else int(n - 1 - last[-1])


def json_depth(raw: bytes) -> int:
    """The nesting depth of the JSON text `raw` (0 for a scalar), from its bytes alone, so
    that it is known before a parser builds (or recurses into) anything: a bracket counts
    unless an odd number of unescaped quotes precede it. Vectorized in pieces (numpy
    releases the GIL, so on a thread the loop goes on). For invalid JSON the figure is
    meaningless, and the parser that follows refuses it anyway."""
    scan = _DepthScan()
    for start in range(0, len(raw), _DEPTH_PIECE_BYTES):
        scan.feed(raw[start:start + _DEPTH_PIECE_BYTES])
    return scan.max_depth


def check_json_depth(raw: bytes, limits: RequestLimits) -> None:
    depth = json_depth(raw)
    if depth > limits.max_json_depth:
        raise ApiError(400, f"the request body nests {depth} levels deep; at most "
                       f"{limits.max_json_depth} are allowed (--max-json-depth)",
                       code="too_deep")


def _over(field: str, what: str, got: int, limit: int, flag: str) -> ApiError:
    return ApiError(400, f"{field}: {got} {what}; at most {limit} are allowed ({flag})", field)


def _json_size(value: Any) -> int:
    """Bytes of `value` as compact JSON (a schema or tool list: bounded by the body)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    try:
        return len(orjson.dumps(value))
    except TypeError:  # not JSON (the type checks that follow answer it)
        return 0


def _check_stop(body: dict, limits: RequestLimits) -> None:
    for field in ("stop", "stop_sequences"):  # OpenAI's, Anthropic's
        stop = body.get(field)
        if not isinstance(stop, list):
            continue
        if len(stop) > limits.max_stop_strings:
            raise _over(field, "stop strings", len(stop), limits.max_stop_strings,
                        "--max-stop-strings")
        chars = sum(len(s) for s in stop if isinstance(s, str))
        if chars > limits.max_stop_chars:
            raise _over(field, "characters of stop strings", chars, limits.max_stop_chars,
                        "--max-stop-chars")


def _constraint_values(body: dict) -> Iterator[tuple[str, Any]]:
    """(field, value) of every output constraint a request may carry: a schema, regex,
    grammar, choice list or structural tag (chat, completions, vLLM's and Responses')."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        yield "response_format", fmt.get("json_schema")
    for field in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "structured_outputs"):
        if body.get(field) is not None:
            yield field, body[field]
    text = body.get("text")
    if isinstance(text, dict):
        yield "text", text.get("format")


def check_request(body: dict, limits: RequestLimits) -> None:
    """The budget of one parsed request body, whatever its route (a 400 past a limit):
    stop strings, `logit_bias` entries, tools and the size of its schemas. Nothing is
    tokenized, rendered or compiled before this passes."""
    _check_stop(body, limits)
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
        raise _over("logit_bias", "entries", len(bias), limits.max_logit_bias,
                    "--max-logit-bias")
    tools = body.get("tools")
    if isinstance(tools, list):
        if len(tools) > limits.max_tools:
            raise _over("tools", "tools", len(tools), limits.max_tools, "--max-tools")
        size = _json_size(tools)
        if size > limits.max_schema_bytes:
            raise _over("tools", "bytes of tool definitions", size, limits.max_schema_bytes,
                        "--max-schema-bytes")
    for field, value in _constraint_values(body):
        size = _json_size(value)
        if size > limits.max_schema_bytes:
            raise _over(field, "bytes of output constraint", size, limits.max_schema_bytes,
                        "--max-schema-bytes")
