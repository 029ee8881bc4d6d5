"""A real OTLP/HTTP trace receiver for the tracing tests: an aiohttp server on 127.0.0.1,
on a thread and event loop of its own, that parses each POSTed body as OTLP's
ExportTraceServiceRequest (protobuf) and keeps the spans. Needs the `tracing` extra."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span


def value_of(value: AnyValue) -> Any:
    """An OTLP attribute value as Python (arrays as lists)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, kind)


def attributes(span: Span) -> dict[str, Any]:
    return {a.key: value_of(a.value) for a in span.attributes}


class OtlpReceiver:
    """Collects spans posted to http://127.0.0.1:PORT/v1/traces (`url`)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.resources: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    def start(self) -> OtlpReceiver:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        self.url = f"http://127.0.0.1:{port}/v1/traces"
        return self

    async def _serve(self) -> int:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/traces", self._export)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return self._runner.addresses[0][1]

    async def _export(self, request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        with self._lock:
            for resource_spans in message.resource_spans:
                self.resources.append({a.key: value_of(a.value)
                                       for a in resource_spans.resource.attributes})
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def wait_for(self, predicate: Callable[[Span], bool], count: int = 1,
                 timeout: float = 30) -> list[Span]:
        """The spans matching `predicate`, once at least `count` of them arrived."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                found = [s for s in self.spans if predicate(s)]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.02)

    def children(self, parent: Span) -> list[Span]:
        with self._lock:
            return sorted((s for s in self.spans if s.parent_span_id == parent.span_id
                           and s.trace_id == parent.trace_id),
                          key=lambda s: s.start_time_unix_nano)
