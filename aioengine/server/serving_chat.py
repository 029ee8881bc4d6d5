"""POST /v1/chat/completions: the model's chat template, one engine request, n choices.

Streaming: each choice's first delta carries the role; exactly one chunk per choice carries
its finish_reason; usage (when asked) comes in a last chunk with no choices; then [DONE].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from aioengine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from aioengine.server.protocol import (ApiError, chat_sampling_params, get_bool, get_priority,
                                       get_stream)
from aioengine.server.serving_engine import (ApiCall, SSEStream, ServingContext, check_failed,
                                             merged_outputs, random_id)
from aioengine.tokenizer_utils import ChatTemplateError, apply_chat_template


def _logprob_item(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], entries: list[PositionLogprobs] | None,
                  top: int) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content` items; `top_logprobs` holds the `top` best by rank."""
    items = []
    for token, entry in zip(token_ids, entries or []):
        chosen = entry[token]
        best = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)
        item = _logprob_item(chosen.decoded_token or "", chosen.logprob)
        item["top_logprobs"] = [_logprob_item(lp.decoded_token or "", lp.logprob) for lp in best]
        items.append(item)
    return items


@dataclass
class ChatChoice:
    index: int
    text: str = ""
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def render(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if messages is None:
            raise ApiError(400, "messages is required", "messages")
        add_generation_prompt = get_bool(body, "add_generation_prompt", True)
        try:
            return apply_chat_template(self.ctx.engine.tokenizer, messages,
                                       bool(add_generation_prompt))
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "messages") from None

    async def __call__(self, request: web.Request, body: dict) -> web.StreamResponse:
        ctx = self.ctx
        model, lora_request = ctx.resolve_model(body)
        stream = get_stream(body)
        params = chat_sampling_params(body)
        priority = get_priority(body)
        prompt_ids = self.render(body)
        per_prompt = ctx.validate([prompt_ids], params, prompt_param="messages")
        ctx.check_running()
        await ctx.compile_structured(params, body)
        call = _ChatCall(random_id("chatcmpl"), model, params.n, params.logprobs, len(prompt_ids))
        outputs = merged_outputs(ctx.engine, [prompt_ids], per_prompt, call.id, priority,
                                 lora_request)
        if stream.stream:
            return await call.stream(request, outputs, stream.include_usage)
        return await call.collect(outputs)


class _ChatCall(ApiCall):
    """One /v1/chat/completions call in flight."""

    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, call_id: str, model: str, n: int, logprobs: int | None,
                 num_prompt_tokens: int) -> None:
        super().__init__(call_id, model, [num_prompt_tokens])
        self.top_logprobs = logprobs
        self.choices = [ChatChoice(i) for i in range(n)]

    def _advance(self, c: CompletionOutput) -> tuple[ChatChoice, list[dict] | None]:
        check_failed(c.finish_reason, c.error)
        choice = self.choices[c.index]
        choice.text += c.text
        new_lp = None
        if self.top_logprobs is not None:
            new_lp = chat_logprobs(c.token_ids, c.logprobs, self.top_logprobs)
            choice.logprobs = (choice.logprobs or []) + new_lp
        if c.finished:
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        return choice, new_lp

    def collect_output(self, prompt_index: int, out: RequestOutput, c: CompletionOutput) -> None:
        self._advance(c)

    def final_choices(self) -> list[dict[str, Any]]:
        return [{
            "index": ch.index,
            "message": {"role": "assistant", "content": ch.text},
            "logprobs": {"content": ch.logprobs} if ch.logprobs is not None else None,
            "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason,
        } for ch in self.choices]

    async def stream_start(self, sse: SSEStream) -> None:
        for choice in self.choices:
            await sse.send(self.chunk([{
                "index": choice.index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}]))

    def stream_choice(self, prompt_index: int, out: RequestOutput,
                      c: CompletionOutput) -> dict[str, Any] | None:
        choice, new_lp = self._advance(c)
        if not (c.text or c.finished or new_lp):
            return None
        return {"index": choice.index,
                "delta": {"content": c.text} if c.text else {},
                "logprobs": {"content": new_lp} if new_lp is not None else None,
                "finish_reason": c.finish_reason if c.finished else None,
                "stop_reason": c.stop_reason if c.finished else None}
