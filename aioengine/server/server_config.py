"""ServerConfig: the settings of the HTTP server in front of one engine (a plain `aioengine
serve`, or each Ray Serve replica). Its fields are the defaults of the server flags
(aioengine.serve_args generates them from it), so this module imports nothing heavy:
building the command line's parser does not import the server."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aioengine.server.request_limits import RequestLimits

if TYPE_CHECKING:
    from aioengine.server.serving_models import LoRAModulePath

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
# Longer than the keep-alive expiry of the common clients' pools (httpx, which the openai
# client uses: 5 s; aiohttp's: 15 s), so a client never reuses a connection the server is
# closing at that moment.
DEFAULT_KEEPALIVE_TIMEOUT = 20.0
# 8 MiB (the body limit) in 60 s is ~140 KB/s: any real client, not a slow-loris.
DEFAULT_BODY_READ_TIMEOUT = 60.0
# A streaming client that accepts no chunk for this long (its socket buffer full: it stopped
# reading but did not disconnect) is dropped and its requests aborted.
DEFAULT_STREAM_WRITE_TIMEOUT = 60.0
# 8x the default --max-num-seqs: room for the running, the queued and idle keep-alive
# connections, far below the usual 1024 open files per process.
DEFAULT_MAX_CONNECTIONS = 512


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # With api_key: /metrics answers without it too (for a Prometheus scraper).
    metrics_without_api_key: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # Connections: one idle this long, or that has not sent a whole request head in that
    # time, is closed (aiohttp's keepalive_timeout); a body not received within
    # body_read_timeout gets a 408 and the connection is closed; beyond max_connections open
    # connections a new one gets a 503 and is closed (0: no cap).
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT
    body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT
    stream_write_timeout: float = DEFAULT_STREAM_WRITE_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # Seconds to wait for open connections after in-flight requests were aborted.
    shutdown_timeout: float = 5.0
    # Adapters loaded before serving (--lora-modules); the load/unload routes
    # (--allow-runtime-lora-updating).
    lora_modules: tuple[LoRAModulePath, ...] = ()
    allow_runtime_lora_updating: bool = False
    # Ray Serve model multiplexing: lora_modules are listed, not loaded; each replica loads
    # one when a request names it (aioengine/ray_serve/adapters.py).
    load_lora_modules_on_demand: bool = False
    # Tool calling (vLLM's flags), the chat template override, the Responses API's store.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # --reasoning-parser (reasoning_parsers.REASONING_PARSERS): None = output is all answer.
    reasoning_parser: str | None = None
    chat_template: str | None = None
    # The pooling of the embedding routes (pooling_params.POOLING_TYPES): `last` suits a
    # decoder LLM; a request's pooling_type overrides it.
    pooling: str = "last"
    max_stored_responses: int = 1024
    response_id_tag: str = ""  # in every response id (a Ray Serve replica's id)
    # Overload: beyond this many waiting requests new ones get 503 + Retry-After (SGLang's
    # --max-queued-requests); None = unlimited.
    max_queued_requests: int | None = None
    # The work budget of one request (request_limits.py; the --max-* limit flags).
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Browser safety: the Host names served (None: the loopback names when bound to a
    # loopback address, any otherwise; "*" any), and the origins CORS lets read responses
    # (none unless given; "*" any).
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()
    # Special tokens in message content are tokenized as text and roles are checked against
    # the template's, unless the callers are trusted with control tokens.
    trust_message_special_tokens: bool = False
