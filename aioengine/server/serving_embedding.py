"""POST /v1/embeddings (OpenAI's format) and /pooling (vLLM's raw pooled vectors): one
prefill-only engine request per input (AsyncEngine.encode), batched by the scheduler with
everything else, pooled as --pooling says (a request's `pooling_type` overrides it).

`create_embedding(body)` / `create_pooling(body)` take a parsed body and return the
response as a dict, or raise ApiError (the 400s, with the OpenAI error body the route
answers) / EngineDeadError: the routes and `aioengine run-batch` call them alike.

`dimensions`: this server's models are decoder LLMs, not trained Matryoshka-style, so a
truncated vector would not be a valid embedding; as vLLM does for such models, any other
value than the model's own size is a 400 (the own size is accepted: nothing changes).

A call's inputs are counted before anything is tokenized (at most --max-pooling-inputs),
and its body-sized work runs off the event loop: tokenizing (PromptWork), turning the
vectors into the answer's items, and dumping them (`dumps_pooled`, a piece at a time). On
the 2-core AMD EPYC of issue 48, 2,048 inputs held the loop ~0.1 s converting the vectors
to lists and ~0.1-0.5 s more in one `orjson.dumps` of the 25 MB answer; 20,000 (then
unbounded) ran 392 s and stalled /health for 10 s.
"""
from __future__ import annotations

import asyncio
import base64
import time
from contextlib import aclosing
from typing import Any

import numpy as np
import orjson
import torch
from aiohttp import web

from aioengine.errors import InvalidRequestError
from aioengine.lora.request import LoRARequest
from aioengine.outputs import PoolingRequestOutput
from aioengine.pooling_params import PoolingParams
from aioengine.server.offload import encode_text
from aioengine.server.protocol import (ApiError, get_bool, get_int, get_priority, get_str,
                                       _type_error)
from aioengine.server.serving_engine import ServingContext, random_id

Inputs = list[str | list[int]]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_pooling_inputs(count: int, max_inputs: int, name: str) -> None:
    """At most `max_inputs` (--max-pooling-inputs) inputs or documents in one call: each
    is an engine request, and the answer grows with them (12 KB per float vector here)."""
    if count > max_inputs:
        raise ApiError(400, f"{name} has {count} items; at most {max_inputs} are allowed in "
                       "one request (--max-pooling-inputs)", name)


def parse_inputs(body: dict, max_inputs: int, name: str = "input") -> Inputs:
    """`input`: a string, a list of strings, a list of token ids or a list of such lists;
    none of them empty, at most `max_inputs` of them (counted before anything else)."""
    value = body.get(name)
    if value is None:
        raise ApiError(400, f"{name} is required", name)
    if isinstance(value, list) and value and not _is_int(value[0]):
        check_pooling_inputs(len(value), max_inputs, name)  # (a list of ids is one input)
    if isinstance(value, str):
        inputs: Inputs = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        inputs = [value]
    elif isinstance(value, list) and value and all(
            isinstance(v, str) or (isinstance(v, list) and all(_is_int(t) for t in v))
            for v in value):
        inputs = list(value)
    elif isinstance(value, list) and not value:
        raise ApiError(400, f"{name} must not be empty", name)
    else:
        raise _type_error(name, "a string, a list of strings, a list of token ids or a list "
                          "of token id lists", value)
    if any(len(i) == 0 for i in inputs):
        raise ApiError(400, f"{name} must not contain an empty string or list", name)
    return inputs


def pooling_params(ctx: ServingContext, body: dict, normalize: bool) -> PoolingParams:
    """The request's pooling: `pooling_type` (default --pooling), `normalize`."""
    pooling_type = get_str(body, "pooling_type", None) or ctx.pooling
    norm = get_bool(body, "normalize", normalize)
    try:
        return PoolingParams(pooling_type, bool(norm))
    except InvalidRequestError as e:
        raise ApiError.invalid(e) from None


def encode_vectors(vectors: list[torch.Tensor], encoding_format: str) -> list[np.ndarray | str]:
    """Each vector as float64 numpy (orjson dumps it as the digits `tensor.tolist()` gives,
    without making a Python float of each value), or base64 of its little-endian float32
    bytes (OpenAI's base64). Runs on a thread: body-sized."""
    if encoding_format == "base64":
        return [base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii")
                for v in vectors]
    return list(torch.stack(vectors).to(torch.float64).numpy())


# Items of an answer's `data` dumped per orjson call: ~0.5 ms for 32 float vectors of 576
# values, so a thread dumping a 2,048-vector answer hands the GIL to the loop every few ms
# (orjson keeps it for a whole call: one dumps of that answer held it 0.1-0.5 s).
_DUMP_PIECE_ITEMS = 32


def dumps_pooled(response: dict[str, Any]) -> bytes:
    """`response` as JSON (its `data` items may hold numpy vectors), `data` dumped a piece
    at a time and joined once (`data` goes last: a JSON object's keys have no order)."""
    items = response["data"]
    rest = orjson.dumps({k: v for k, v in response.items() if k != "data"})
    parts = [rest[:-1], b',"data":[' if len(rest) > 2 else b'"data":[']
    for start in range(0, len(items), _DUMP_PIECE_ITEMS):
        piece = orjson.dumps(items[start:start + _DUMP_PIECE_ITEMS],
                             option=orjson.OPT_SERIALIZE_NUMPY)
        parts += [b"," if start else b"", piece[1:-1]]
    parts.append(b"]}")
    return b"".join(parts)


def as_lists(response: dict[str, Any], key: str) -> dict[str, Any]:
    """`response` with each item's numpy vector as a float list (plain JSON values)."""
    for item in response["data"]:
        if isinstance(item[key], np.ndarray):
            item[key] = item[key].tolist()
    return response


def get_encoding_format(body: dict) -> str:
    fmt = get_str(body, "encoding_format", None) or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, f"encoding_format must be 'float' or 'base64', got {fmt!r}",
                       "encoding_format")
    return fmt


# Pooling requests of one call started per event-loop iteration (PoolingRuns.run).
_START_PIECE = 64


class PoolingRuns:
    """Tokenizes inputs and runs them as pooling requests: what the embedding, pooling,
    score and rerank routes share."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _token_ids(self, inputs: Inputs, add_special_tokens: bool, param: str) -> list[list[int]]:
        """Each input's ids, checked (for a large body, on a thread)."""
        engine, limit = self.ctx.engine, self.ctx.max_model_len

        def check_length(count: int) -> None:
            if count > limit:
                raise InvalidRequestError(f"the input has {count} tokens but the model's "
                                          f"context length is {limit}", param)
        out = []
        try:
            for item in inputs:
                if isinstance(item, str):
                    out.append(encode_text(engine.tokenizer, item, add_special_tokens,
                                           check_length))
                else:
                    engine.check_token_ids(item, param)
                    check_length(len(item))
                    out.append(list(item))
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param) from None
        return out

    async def token_ids(self, inputs: Inputs, add_special_tokens: bool, param: str,
                        raw_request: web.Request | None) -> list[list[int]]:
        work = self.ctx.work
        if raw_request is not None:
            return await work.run(raw_request, self._token_ids, inputs, add_special_tokens,
                                  param)
        return await work.run_off_loop(self._token_ids, inputs, add_special_tokens, param)

    async def run(self, prompt_ids: list[list[int]], params: PoolingParams,
                  lora_request: LoRARequest | None, priority: int,
                  call_id: str, param: str = "input") -> list[torch.Tensor]:
        """The pooled vector of each prompt, in order. All are admitted before any runs
        (a 400 queues nothing); cancelling the caller aborts every request."""
        engine = self.ctx.engine
        try:
            prepared = await engine.prepare_pooling(prompt_ids, params, lora_request,
                                                    admit=self.ctx.check_running)
        except InvalidRequestError as e:
            raise ApiError.invalid(e, param if e.param in ("input", "prompt") else None) from None

        async def one(i: int) -> PoolingRequestOutput:
            async with aclosing(engine.encode(prepared[i], request_id=f"{call_id}-{i}",
                                              priority=priority)) as outs:
                async for out in outs:
                    return out
            raise RuntimeError("the pooling request ended without an output")

        # Started a piece at a time: asyncio runs every callback ready in one iteration
        # before it polls the sockets again, and 2,048 requests added to the scheduler in
        # one iteration (each insertion scans the waiting queue) held /health 0.3-0.5 s.
        async with asyncio.TaskGroup() as group:
            tasks: list[asyncio.Task[PoolingRequestOutput]] = []
            for start in range(0, len(prepared), _START_PIECE):
                if start:
                    await asyncio.sleep(0)  # the previous piece's tasks run, then the sockets
                tasks += [group.create_task(one(i))
                          for i in range(start, min(start + _START_PIECE, len(prepared)))]
        vectors = []
        for task in tasks:
            out = task.result()
            if out.outputs is None:
                raise ApiError(500, f"the pooling request failed: {out.error or out.finish_reason}",
                               type="internal_server_error")
            vectors.append(out.outputs.data)
        return vectors


class EmbeddingsHandler:
    """/v1/embeddings and /pooling."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.runs = PoolingRuns(ctx)

    async def embeddings(self, request: web.Request, body: dict) -> web.Response:
        return await self._respond(await self._embedding(body, request))

    async def pooling(self, request: web.Request, body: dict) -> web.Response:
        return await self._respond(await self._pooling(body, request))

    async def create_embedding(self, body: dict,
                               raw_request: web.Request | None = None) -> dict[str, Any]:
        """OpenAI's embeddings response for a /v1/embeddings body; ApiError for bad input."""
        response = await self._embedding(body, raw_request)
        return await self.ctx.work.run_off_loop(as_lists, response, "embedding")

    async def create_pooling(self, body: dict,
                             raw_request: web.Request | None = None) -> dict[str, Any]:
        """vLLM's /pooling response: the pooled vectors as they are (not normalised unless
        the body's `normalize` is true)."""
        return await self.ctx.work.run_off_loop(as_lists, await self._pooling(body, raw_request),
                                                "data")

    async def _respond(self, response: dict[str, Any]) -> web.Response:
        body = await self.ctx.work.run_off_loop(dumps_pooled, response)
        return web.Response(body=body, content_type="application/json")

    async def _embedding(self, body: dict, raw_request: web.Request | None) -> dict[str, Any]:
        dimensions = get_int(body, "dimensions", None, lo=1)
        hidden = self.ctx.engine.model_arch.hidden_size
        if dimensions is not None and dimensions != hidden:
            raise ApiError(400, f"dimensions={dimensions} is not supported: this model was not "
                           "trained for truncated (Matryoshka) embeddings; its embeddings have "
                           f"{hidden} dimensions", "dimensions")
        return await self._create(body, raw_request, "embd", "embedding", "embedding", True)

    async def _pooling(self, body: dict, raw_request: web.Request | None) -> dict[str, Any]:
        return await self._create(body, raw_request, "pool", "pooling", "data", False)

    async def _create(self, body: dict, raw_request: web.Request | None, prefix: str,
                      object_name: str, key: str, normalize: bool) -> dict[str, Any]:
        """The response, its vectors as numpy arrays (or base64 strings): `dumps_pooled`
        writes it, `as_lists` makes it plain JSON values."""
        ctx = self.ctx
        model, lora_request = ctx.resolve_model(body)
        inputs = parse_inputs(body, ctx.limits.max_pooling_inputs)
        encoding_format = get_encoding_format(body)
        params = pooling_params(ctx, body, normalize)
        priority = get_priority(body)
        add_special = bool(get_bool(body, "add_special_tokens", True))
        ids = await self.runs.token_ids(inputs, add_special, "input", raw_request)
        call_id = random_id(prefix)
        vectors = await self.runs.run(ids, params, lora_request, priority, call_id)
        num_tokens = sum(len(i) for i in ids)
        encoded = await ctx.work.run_off_loop(encode_vectors, vectors, encoding_format)
        data = [{"index": i, "object": object_name, key: v} for i, v in enumerate(encoded)]
        usage: dict[str, int] = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
        if prefix == "pool":
            usage["completion_tokens"] = 0  # vLLM's UsageInfo
        return {"id": call_id, "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": usage}
