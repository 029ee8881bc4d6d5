"""`aioengine run-batch`: an OpenAI Batch file run through one in-process AsyncEngine.

Input, one JSON object a line: `{"custom_id", "method": "POST", "url", "body"}`; the url
picks the serving handler of the HTTP route of that path (BATCH_ENDPOINTS), which
validates and prepares the body exactly as the route does (`create`), and its whole
response is collected (`collect_body`): no HTTP server, no second validation path.

Output, one line per request as it finishes (written and flushed at once, so an
interrupted run keeps what finished): `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`. A request the handler answers with an error has that
status and the OpenAI error body as `response.body` and `error` null (as OpenAI's Batch
API reports them); a line that never became a request (not JSON, no custom_id, an
unknown url, `stream: true`) gets status 400, the same kind of body, and `error` set to
`{"code", "message"}`. One bad line never stops the others; an engine that dies stops the
run (EngineDeadError) without a record for the lines it took down.

Resume: custom_ids already in the output file are skipped and the file is appended to (a
line cut short by a kill is dropped first). Lines run concurrently, at most
`max_concurrent` at a time, so the scheduler sees a full batch while memory stays bounded
however long the file is.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import orjson

from aioengine.errors import EngineDeadError
from aioengine.server.protocol import ApiError, get_stream
from aioengine.server.request_limits import check_request, json_depth
from aioengine.server.serving_chat import ChatHandler
from aioengine.server.serving_completions import CompletionsHandler
from aioengine.server.serving_embedding import EmbeddingsHandler
from aioengine.server.serving_engine import ServingContext, failure_body, random_id

logger = logging.getLogger("aioengine.batch")

# A parsed body and its size in bytes -> (status, response body).
BatchEndpoint = Callable[[dict, int], Awaitable[tuple[int, dict[str, Any]]]]
EndpointFactory = Callable[[ServingContext], BatchEndpoint]

DEFAULT_MAX_CONCURRENT = 256


def _generation(handler_type: Any) -> EndpointFactory:
    """A generation route's handler as a batch endpoint: `create` (the route's own
    validation and preparation), then the whole response collected."""
    def factory(ctx: ServingContext) -> BatchEndpoint:
        handler = handler_type(ctx)

        async def endpoint(body: dict, size: int) -> tuple[int, dict[str, Any]]:
            prepared = await handler.create(body, size)
            return await prepared.call.collect_body(prepared.outputs)
        return endpoint
    return factory


def _embeddings(ctx: ServingContext) -> BatchEndpoint:
    """/v1/embeddings through the route's own `create_embedding` (its 400s raise ApiError,
    recorded by run_line as the route would answer them)."""
    handler = EmbeddingsHandler(ctx)

    async def endpoint(body: dict, size: int) -> tuple[int, dict[str, Any]]:
        return 200, await handler.create_embedding(body)
    return endpoint


# url -> the endpoint it runs; None: a url of the Batch API this server does not serve,
# answered per line with a clear error.
BATCH_ENDPOINTS: dict[str, EndpointFactory | None] = {
    "/v1/chat/completions": _generation(ChatHandler),
    "/v1/completions": _generation(CompletionsHandler),
    "/v1/embeddings": _embeddings,
}


class LineError(Exception):
    """A line that never became a request (status 400, with `error` in its record)."""

    def __init__(self, message: str, param: str | None = None,
                 code: str = "invalid_batch_line") -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class BatchLine:
    number: int
    custom_id: str
    url: str
    body: dict
    size: int


@dataclass
class BatchSummary:
    """What one run did: lines run (`ok` answered 200), skipped (already in the output:
    resume), and how long the requests took (the engine's start-up excluded)."""

    total: int = 0
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    elapsed_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    failed_lines: list[int] = field(default_factory=list)

    def line(self) -> str:
        tps = self.completion_tokens / self.elapsed_s if self.elapsed_s else 0.0
        return (f"run-batch: {self.ok} ok, {self.failed} failed, {self.skipped} skipped "
                f"(already in the output) of {self.total} lines in {self.elapsed_s:.2f} s; "
                f"{self.prompt_tokens} prompt + {self.completion_tokens} completion tokens, "
                f"{tps:.1f} completion tokens/s")


def parse_line(raw: bytes, number: int, endpoints: dict[str, BatchEndpoint | None],
               max_depth: int | None = None) -> BatchLine:
    """One input line checked as a Batch request (LineError otherwise); one nested deeper
    than `max_depth` (--max-json-depth) is refused before it is parsed."""
    if max_depth is not None and (depth := json_depth(raw)) > max_depth:
        raise LineError(f"line {number} nests {depth} levels deep; at most {max_depth} are "
                        "allowed (--max-json-depth)")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise LineError(f"line {number} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise LineError(f"line {number} must be a JSON object, got {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(f"line {number}: custom_id must be a non-empty string", "custom_id")
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineError(f"line {number}: method must be POST, got {method!r}", "method")
    url = obj.get("url")
    if url not in endpoints:
        raise LineError(f"line {number}: url {url!r} is not a Batch API url; use one of "
                        f"{', '.join(sorted(endpoints))}", "url", "unsupported_url")
    if endpoints[url] is None:
        raise LineError(f"line {number}: url {url} is not supported by this server",
                        "url", "unsupported_url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(f"line {number}: body must be a JSON object", "body")
    return BatchLine(number, custom_id, url, body, len(raw))


def custom_id_of(raw: bytes) -> str | None:
    """The custom_id of a line, if it has one (to report a bad line under its id)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def record(custom_id: str | None, status: int, body: dict[str, Any] | None,
           error: dict[str, Any] | None = None) -> dict[str, Any]:
    """One line of the Batch output format."""
    return {"id": random_id("batch_req"), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": random_id("req"), "body": body},
            "error": error}


def line_error_record(custom_id: str | None, e: LineError) -> dict[str, Any]:
    body = ApiError(400, str(e), e.param, code=e.code).body()
    return record(custom_id, 400, body, {"code": e.code, "message": str(e)})


def completed_ids(path: str) -> set[str]:
    """The custom_ids already in an output file (resume). A last line without its newline
    (the run was killed while writing it) is cut off so the file is appended to cleanly."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            logger.warning("%s: dropping a last line cut short (%d bytes)", path,
                           len(data) - end)
            f.truncate(end)
    done: set[str] = set()
    for line in data[:end].splitlines():
        try:
            custom_id = orjson.loads(line).get("custom_id")
        except (orjson.JSONDecodeError, AttributeError):
            continue
        if isinstance(custom_id, str):
            done.add(custom_id)
    return done


def input_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of the non-blank lines of the input file, read as needed."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            raw = raw.strip()
            if raw:
                yield number, raw


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


class BatchRunner:
    """Runs the lines of one input file, appending their records to the output file."""

    def __init__(self, ctx: ServingContext, out: BinaryIO, progress: Any,
                 max_concurrent: int = DEFAULT_MAX_CONCURRENT) -> None:
        self.ctx, self.out, self.progress = ctx, out, progress
        self.endpoints = {url: None if make is None else make(ctx)
                          for url, make in BATCH_ENDPOINTS.items()}
        self.slots = asyncio.Semaphore(max_concurrent)
        self.summary = BatchSummary()
        self.engine_dead: EngineDeadError | None = None

    def write(self, rec: dict[str, Any], number: int) -> None:
        self.out.write(orjson.dumps(rec) + b"\n")
        self.out.flush()
        if rec["response"]["status_code"] == 200:
            self.summary.ok += 1
            usage = rec["response"]["body"].get("usage") or {}
            self.summary.prompt_tokens += usage.get("prompt_tokens", 0)
            self.summary.completion_tokens += usage.get("completion_tokens", 0)
        else:
            self.summary.failed += 1
            self.summary.failed_lines.append(number)
        self.progress.update(1)

    async def run_line(self, line: BatchLine) -> None:
        """One request through its endpoint; every failure becomes its record."""
        endpoint = self.endpoints[line.url]
        assert endpoint is not None
        try:
            if get_stream(line.body).stream:
                raise LineError(f"line {line.number}: stream is not supported in a batch",
                                "stream")
            check_request(line.body, self.ctx.limits)
            status, body = await endpoint(line.body, line.size)
        except LineError as e:
            self.write(line_error_record(line.custom_id, e), line.number)
            return
        except Exception as e:  # noqa: BLE001 - one request's failure, recorded
            status, body = failure_body(e)
            if status >= 500 and self.ctx.engine.is_running:
                logger.exception("line %d (%s) failed", line.number, line.custom_id)
        if status >= 500 and not self.ctx.engine.is_running:
            # The engine died under it: no record, so a resumed run does this line again.
            self.engine_dead = EngineDeadError(f"the engine stopped at line {line.number}")
            return
        self.write(record(line.custom_id, status, body), line.number)

    async def run(self, lines: Iterator[tuple[int, bytes]], done: set[str]) -> BatchSummary:
        start = time.perf_counter()
        seen: set[str] = set()
        tasks: set[asyncio.Task] = set()
        for number, raw in lines:
            if self.engine_dead is not None:
                break
            self.summary.total += 1
            try:
                line = parse_line(raw, number, self.endpoints,
                                  self.ctx.limits.max_json_depth)
            except LineError as e:
                custom_id = custom_id_of(raw)
                if custom_id is not None and custom_id in done:
                    self._skip()
                else:
                    self.write(line_error_record(custom_id, e), number)
                continue
            if line.custom_id in done:
                self._skip()
                continue
            if line.custom_id in seen:
                self.write(line_error_record(line.custom_id, LineError(
                    f"line {number}: custom_id {line.custom_id!r} is used by an earlier "
                    "line", "custom_id", "duplicate_custom_id")), number)
                continue
            seen.add(line.custom_id)
            await self.slots.acquire()
            task = asyncio.create_task(self.run_line(line))
            tasks.add(task)
            task.add_done_callback(self._finished(tasks))
        if tasks:
            await asyncio.gather(*tasks)
        self.summary.elapsed_s = time.perf_counter() - start
        if self.engine_dead is not None:
            raise self.engine_dead
        return self.summary

    def _finished(self, tasks: set[asyncio.Task]) -> Callable[[asyncio.Task], None]:
        def done(task: asyncio.Task) -> None:
            tasks.discard(task)
            self.slots.release()
        return done

    def _skip(self) -> None:
        self.summary.skipped += 1
        self.progress.update(1)


async def run_batch_file(ctx: ServingContext, input_path: str, output_path: str,
                         max_concurrent: int = DEFAULT_MAX_CONCURRENT,
                         progress: bool = True) -> BatchSummary:
    """Runs `input_path` into `output_path` (resumed when it exists); see the module."""
    from tqdm import tqdm

    done = completed_ids(output_path)
    total = count_lines(input_path)
    with open(output_path, "ab") as out, tqdm(total=total, desc="run-batch", unit="req",
                                              disable=not progress) as bar:
        runner = BatchRunner(ctx, out, bar, max_concurrent)
        return await runner.run(input_lines(input_path), done)
