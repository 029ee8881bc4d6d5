"""POST /score, /v1/score (vLLM's body and response) and /rerank, /v1/rerank (Jina's and
Cohere's): the cosine similarity of the texts' embeddings (aioengine/scoring.py), pooled
as --pooling says (a request's `pooling_type` overrides it). Each distinct text is
embedded once; usage counts the tokens of the texts embedded. A call holds at most
--max-pooling-inputs texts in `text_1`, in `text_2` and in `documents` (counted before
anything else); they are tokenized off the event loop (PromptWork) and scored in one
tensor call.

`create_score(body)` / `create_rerank(body)` take a parsed body and return the response
dict, or raise ApiError (400s): the routes and batch runners call them alike.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from aiohttp import web

from aioengine.errors import InvalidRequestError
from aioengine.scoring import cosine_similarities, score_pairs
from aioengine.server.protocol import ApiError, get_bool, get_int, get_priority
from aioengine.server.serving_embedding import (PoolingRuns, check_pooling_inputs,
                                                pooling_params)
from aioengine.server.serving_engine import ServingContext, json_response, random_id


def _texts(body: dict, name: str, max_inputs: int) -> str | list[str]:
    value = body.get(name)
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list):
        check_pooling_inputs(len(value), max_inputs, name)
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return value
    if value is None:
        raise ApiError(400, f"{name} is required", name)
    raise ApiError(400, f"{name} must be a non-empty string or a non-empty list of non-empty "
                   "strings", name)


def _documents(body: dict, max_inputs: int) -> list[str]:
    """Rerank `documents`: strings, or objects with a `text` (Cohere's v2)."""
    value = body.get("documents")
    if not isinstance(value, list) or not value:
        raise ApiError(400, "documents must be a non-empty list of strings", "documents")
    check_pooling_inputs(len(value), max_inputs, "documents")
    docs = []
    for doc in value:
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str) or not text:
            raise ApiError(400, "each document must be a non-empty string (or an object with "
                           "a non-empty text)", "documents")
        docs.append(text)
    return docs


class ScoreHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.runs = PoolingRuns(ctx)

    async def score(self, request: web.Request, body: dict) -> web.Response:
        return json_response(await self.create_score(body, request))

    async def rerank(self, request: web.Request, body: dict) -> web.Response:
        return json_response(await self.create_rerank(body, request))

    async def _embed(self, body: dict, texts: list[str], raw_request: web.Request | None,
                     call_id: str, param: str) -> tuple[str, dict[str, torch.Tensor], int]:
        """The served model's name, each distinct text's vector, and their token count."""
        model, lora_request = self.ctx.resolve_model(body)
        params = pooling_params(self.ctx, body, True)
        unique = list(dict.fromkeys(texts))
        add_special = bool(get_bool(body, "add_special_tokens", True))
        ids = await self.runs.token_ids(unique, add_special, param, raw_request)
        vectors = await self.runs.run(ids, params, lora_request, get_priority(body), call_id,
                                      param)
        return model, dict(zip(unique, vectors)), sum(len(i) for i in ids)

    async def create_score(self, body: dict,
                           raw_request: web.Request | None = None) -> dict[str, Any]:
        """vLLM's score response: text_1 against each text_2 (one text_1), or pairwise."""
        try:
            max_inputs = self.ctx.limits.max_pooling_inputs
            pairs = score_pairs(_texts(body, "text_1", max_inputs),
                                _texts(body, "text_2", max_inputs))
        except InvalidRequestError as e:
            raise ApiError.invalid(e) from None
        call_id = random_id("score")
        model, vectors, num_tokens = await self._embed(
            body, [t for pair in pairs for t in pair], raw_request, call_id, "text_1")
        scores = cosine_similarities([vectors[a] for a, _ in pairs],
                                     [vectors[b] for _, b in pairs])
        data = [{"index": i, "object": "score", "score": score}
                for i, score in enumerate(scores)]
        return {"id": call_id, "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens,
                                        "completion_tokens": 0}}

    async def create_rerank(self, body: dict,
                            raw_request: web.Request | None = None) -> dict[str, Any]:
        """Jina's / Cohere's rerank response: documents by relevance (cosine similarity to
        the query), best first, the first `top_n` (0 or absent: all), each with its text
        unless `return_documents` is false."""
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise ApiError(400, "query must be a non-empty string", "query")
        docs = _documents(body, self.ctx.limits.max_pooling_inputs)
        top_n = get_int(body, "top_n", None, lo=0) or len(docs)
        return_documents = get_bool(body, "return_documents", True)
        call_id = random_id("rerank")
        model, vectors, num_tokens = await self._embed(body, [query, *docs], raw_request,
                                                       call_id, "documents")
        scores = cosine_similarities([vectors[query]] * len(docs), [vectors[d] for d in docs])
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:top_n]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if return_documents:
                result["document"] = {"text": docs[i]}
            results.append(result)
        return {"id": call_id, "model": model, "usage": {"total_tokens": num_tokens},
                "results": results}
