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

from dataclasses import dataclass

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
    # Stop strings of one request: how many, and their characters in all.
    max_stop_strings: int = 1024
    max_stop_chars: int = 65536
    # `logit_bias` entries (OpenAI allows 300).
    max_logit_bias: int = 300
    # Tools of one chat or Responses request (OpenAI allows 128).
    max_tools: int = 128
    # Bytes (as compact JSON) of one request's output schema, and of its tools in all.
    max_schema_bytes: int = 256 << 10
    # Bytes the Responses store keeps in all (as well as --max-stored-responses entries).
    max_stored_response_bytes: int = 256 << 20
