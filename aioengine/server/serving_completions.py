"""POST /v1/completions: one engine request per prompt, choice index = prompt * n + sample."""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from aioengine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from aioengine.server.offload import body_bytes
from aioengine.server.protocol import (completion_sampling_params, get_priority,
                                       get_stream, parse_completion_prompts)
from aioengine.server.serving_engine import (ApiCall, PreparedCall, ServingContext,
                                             check_failed, merged_outputs, random_id,
                                             trace_headers)


@dataclass
class CompletionLogprobs:
    """OpenAI's legacy logprobs object, built up token by token. `text_offset` counts
    characters from the start of the choice's text (the prompt too when echoing)."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token_id: int, entry: PositionLogprobs | None, offset: int,
            fallback_text: str) -> int:
        """Appends one position; returns the offset after it."""
        chosen = entry.get(token_id) if entry else None
        text = chosen.decoded_token if chosen and chosen.decoded_token is not None \
            else fallback_text
        self.tokens.append(text)
        self.token_logprobs.append(chosen.logprob if chosen else None)
        self.top_logprobs.append(
            {(lp.decoded_token or ""): lp.logprob for lp in entry.values()} if entry else None)
        self.text_offset.append(offset)
        return offset + len(text)

    def extend(self, other: CompletionLogprobs) -> None:
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += other.text_offset

    def body(self) -> dict[str, Any]:
        return {"text_offset": self.text_offset, "token_logprobs": self.token_logprobs,
                "tokens": self.tokens, "top_logprobs": self.top_logprobs}


@dataclass
class Choice:
    index: int
    text: str = ""
    started: bool = False
    logprobs: CompletionLogprobs | None = None
    offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def completion_prompts(ctx: ServingContext,
                       body: dict) -> tuple[list[str | list[int]], list[list[int]]]:
    """The prompts as given and their token ids, each checked against the context (for a
    large body, off the loop: its ids are walked, its text tokenized)."""
    with ctx.prompt_errors("prompt"):
        prompts = parse_completion_prompts(body, ctx.engine.check_prompt_length)
    return prompts, [ctx.encode(p) for p in prompts]


class CompletionsHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, request: web.Request, body: dict) -> web.StreamResponse:
        return await (await self.create(body, body_bytes(request), trace_headers(request))
                      ).respond(request)

    async def create(self, body: dict, body_size: int = 0,
                     trace: Mapping[str, str] | None = None) -> PreparedCall:
        """The call of a parsed body of `body_size` bytes, validated and prepared (the
        HTTP route and run-batch both come here); `trace`: the client's trace context."""
        ctx = self.ctx
        model, lora_request = ctx.resolve_model(body)
        stream = get_stream(body)
        params, echo = completion_sampling_params(body, ctx.engine.default_sampling)
        priority = get_priority(body)
        prompts, prompt_ids = await ctx.work.run_sized(body_size, completion_prompts, ctx, body)
        prepared = await ctx.prepare(prompt_ids, params, lora_request, body,
                                     trace_headers=trace)
        call = _Call(ctx, random_id("cmpl"), model, params.n, echo, params.logprobs,
                     [ctx.prompt_text(p, need_text=echo) for p in prompts], prompt_ids)
        return PreparedCall(call, merged_outputs(ctx.engine, prepared, call.id, priority),
                            stream)


class _Call(ApiCall):
    """One /v1/completions call in flight."""

    object_name = chunk_object_name = "text_completion"

    def __init__(self, ctx: ServingContext, call_id: str, model: str, n: int, echo: bool,
                 logprobs: int | None, prompt_texts: list[str],
                 prompt_ids: list[list[int]]) -> None:
        super().__init__(call_id, model, [len(ids) for ids in prompt_ids])
        self.ctx, self.n = ctx, n
        self.echo, self.want_logprobs = echo, logprobs is not None
        self.prompt_texts, self.prompt_ids = prompt_texts, prompt_ids
        self.choices = [Choice(i) for i in range(len(prompt_ids) * n)]

    def _advance(self, prompt_index: int, out: RequestOutput,
                 c: CompletionOutput) -> tuple[Choice, str, CompletionLogprobs | None]:
        """Applies one sample's delta; returns the choice, the new text and new logprobs."""
        check_failed(c.finish_reason, c.error)
        choice = self.choices[prompt_index * self.n + c.index]
        delta_lp = CompletionLogprobs() if self.want_logprobs else None
        text = ""
        if not choice.started:
            choice.started = True
            if self.echo:
                text = self.prompt_texts[prompt_index]
                if delta_lp is not None:
                    self._add_prompt_logprobs(delta_lp, prompt_index, out)
                choice.offset = len(text)  # generated tokens' offsets follow the prompt
        text += c.text
        if delta_lp is not None:
            self._add_sample_logprobs(choice, delta_lp, c)
        choice.text += text
        if c.finished:
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        if delta_lp is not None:
            choice.logprobs = choice.logprobs or CompletionLogprobs()
            choice.logprobs.extend(delta_lp)
        return choice, text, delta_lp

    def _add_prompt_logprobs(self, lp: CompletionLogprobs, prompt_index: int,
                             out: RequestOutput) -> None:
        """Echoed prompt positions; the first has no logprob (nothing predicts it)."""
        entries = out.prompt_logprobs or []
        decode = self.ctx.engine.tokenizer.decode
        offset = 0
        for pos, token in enumerate(self.prompt_ids[prompt_index]):
            entry = entries[pos] if pos < len(entries) else None
            offset = lp.add(token, entry, offset, decode([token], skip_special_tokens=False))

    def _add_sample_logprobs(self, choice: Choice, lp: CompletionLogprobs,
                             c: CompletionOutput) -> None:
        for token, entry in zip(c.token_ids, c.logprobs or []):
            choice.offset = lp.add(token, entry, choice.offset, "")

    def _choice_body(self, choice: Choice, text: str, lp: CompletionLogprobs | None,
                     finished: bool) -> dict[str, Any]:
        return {"index": choice.index, "text": text,
                "logprobs": lp.body() if lp is not None else None,
                "finish_reason": choice.finish_reason if finished else None,
                "stop_reason": choice.stop_reason if finished else None}

    def collect_output(self, prompt_index: int, out: RequestOutput, c: CompletionOutput) -> None:
        self._advance(prompt_index, out, c)

    def final_choices(self) -> list[dict[str, Any]]:
        return [self._choice_body(ch, ch.text, ch.logprobs, True) for ch in self.choices]

    def stream_choice(self, prompt_index: int, out: RequestOutput,
                      c: CompletionOutput) -> dict[str, Any] | None:
        choice, text, lp = self._advance(prompt_index, out, c)
        if not (text or c.finished or (lp is not None and lp.tokens)):
            return None
        return self._choice_body(choice, text, lp, c.finished)
