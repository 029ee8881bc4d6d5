"""POST /v1/chat/completions: the model's chat template, one engine request, n choices.

Streaming: each choice's first delta carries the role; exactly one chunk per choice carries
its finish_reason; usage (when asked) comes in a last chunk with no choices; then [DONE].

With tools (`tools.py`), each choice's text goes through the tool-call parser: a finished
choice's calls become `message.tool_calls` (finish_reason "tool_calls"), and a stream sends
OpenAI's tool-call deltas (a call's index, id and name first, then argument fragments).

With --reasoning-parser (aioengine/reasoning_parsers.py), each choice's text is first split
into its reasoning (`message.reasoning_content`, streamed as `delta.reasoning_content`,
vLLM's field) and its answer; only the answer reaches the tool-call parser and `content`,
and a response format or forced call constrains only the answer (the structured feature's
reasoning gate). `chat_template_kwargs` and `enable_thinking` reach the template.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from aioengine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from aioengine.reasoning_parsers import ReasoningParser, ReasoningSplit, ReasoningStream
from aioengine.sampling_params import SamplingParams
from aioengine.chat_prompt import ChatPrompt, render_chat
from aioengine.server.offload import body_bytes, encode_text
from aioengine.engine.client import PreparedRequest
from aioengine.server.protocol import (ApiError, StreamSpec, chat_sampling_params, get_bool,
                                       get_priority, get_stream, structured_outputs_field)
from aioengine.server.serving_engine import (ApiCall, Outputs, PreparedCall, SSEStream,
                                             ServingContext, check_failed, merged_outputs,
                                             random_id, trace_headers)
from aioengine.tool_parsers import (ContentDelta, ToolCallArgsDelta, ToolCallStart,
                                           ToolCallStream, ToolEvent)
from aioengine.server.tools import ToolPlan, chat_tool_plan, new_tool_call_id
from aioengine.tokenizer_utils import ChatTemplateError


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


def apply_tool_plan(plan: ToolPlan | None, params: SamplingParams,
                    format_param: str | None) -> None:
    """The tools' constraint replaces (or folds in) the response format (from the field
    `format_param`); special tokens stay in the text, where some models' call markers are."""
    if plan is None:
        return
    params.structured_outputs = plan.constraint(params.structured_outputs, format_param)
    params.skip_special_tokens = False


# apply_chat_template's own parameters: not template variables.
_RESERVED_TEMPLATE_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"))


def chat_template_kwargs(body: dict) -> dict[str, Any] | None:
    """The extra template variables of a chat body: `chat_template_kwargs` (an object;
    vLLM's field), with `enable_thinking` at the top level as a shorthand (the object's
    own wins). 400 for a bad type or a name that is apply_chat_template's own parameter."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    kwargs = dict(kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ApiError(400, f"chat_template_kwargs.{reserved[0]} is not a template variable "
                       "(it is set by the request itself)", "chat_template_kwargs")
    if not isinstance(kwargs.get("enable_thinking", False), bool):
        raise ApiError(400, "chat_template_kwargs.enable_thinking must be a boolean",
                       "chat_template_kwargs")
    enable_thinking = get_bool(body, "enable_thinking", None)
    if enable_thinking is not None:
        kwargs.setdefault("enable_thinking", enable_thinking)
    return kwargs or None


def render_messages(ctx: ServingContext, messages: Any, plan: ToolPlan | None,
                    add_generation_prompt: bool = True, param: str = "messages",
                    check: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Prompt ids of chat messages, with the plan's tools offered, behind the prompt
    boundary unless --trust-message-special-tokens (400 on bad messages or roles; `check`:
    and for a prompt that could never run, counted before it is listed); `template_kwargs`:
    extra template variables (chat_template_kwargs)."""
    tokenizer = ctx.engine.tokenizer
    try:
        prompt = render_chat(tokenizer, messages,
                             [t.chat_dict() for t in plan.tools] if plan else [],
                             plan.parser if plan else ctx.tools.parser,
                             ctx.chat_template, add_generation_prompt, template_kwargs,
                             trust_special_tokens=ctx.trust_message_special_tokens)
        if not check:
            return _encode_prompt(tokenizer, prompt)
        with ctx.prompt_errors(param):
            ids = _encode_prompt(tokenizer, prompt, ctx.engine.check_prompt_length)
            ctx.engine.check_prompt(ids)
        return ids
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param) from None


def _encode_prompt(tokenizer: Any, prompt: ChatPrompt,
                   check_length: Callable[[int], None] | None = None) -> list[int]:
    """A rendered chat's ids: content's special-token text as text (the boundary), or the
    text as it is through the fast backend (encode_text) when nothing was escaped."""
    if prompt.boundary is not None:
        return prompt.boundary.encode(prompt.text, check_length)
    return encode_text(tokenizer, prompt.text, False, check_length)


def chat_prompt(ctx: ServingContext, body: dict) -> tuple[ToolPlan | None, list[int]]:
    """A chat body's tool plan and prompt ids, checked against the context (for a large
    body, off the loop: the tools are validated, the messages rendered and tokenized)."""
    plan = chat_tool_plan(body, ctx.tools)
    if body.get("messages") is None:
        raise ApiError(400, "messages is required", "messages")
    prompt_ids = render_messages(ctx, body["messages"], plan,
                                 bool(get_bool(body, "add_generation_prompt", True)),
                                 check=True, template_kwargs=chat_template_kwargs(body))
    return plan, prompt_ids


def apply_reasoning(parser: ReasoningParser | None, params: SamplingParams,
                    prompt_ids: list[int]) -> bool:
    """With a reasoning parser: its output constraint (if any) gated to the answer, the
    think tags kept in the text; returns whether the output starts inside the reasoning."""
    if parser is None:
        return False
    if params.structured_outputs is not None:
        params.structured_outputs = parser.constrain_answer(params.structured_outputs,
                                                            prompt_ids)
    if parser.tags_are_special:
        params.skip_special_tokens = False
    return parser.starts_in_reasoning(prompt_ids)


@dataclass
class ChatChoice:
    index: int
    text: str = ""
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    tool_stream: ToolCallStream | None = None
    reasoning_stream: ReasoningStream | None = None
    call_ids: list[str] = field(default_factory=list)  # of the calls streamed so far


@dataclass
class ChatRequest:
    """A chat call's engine request, prepared (nothing runs until `outputs` is iterated)."""
    model: str
    params: SamplingParams
    plan: ToolPlan | None
    prompt_ids: list[int]
    prepared: list[PreparedRequest]
    stream: StreamSpec
    priority: int
    # With a reasoning parser: the output starts inside the reasoning (the prompt says).
    in_reasoning: bool = False

    def outputs(self, ctx: ServingContext, call_id: str) -> Outputs:
        return merged_outputs(ctx.engine, self.prepared, call_id, self.priority)


class ChatHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, request: web.Request, body: dict) -> web.StreamResponse:
        return await (await self.create(body, body_bytes(request), trace_headers(request))
                      ).respond(request)

    async def create(self, body: dict, body_size: int = 0,
                     trace: Mapping[str, str] | None = None) -> PreparedCall:
        """The call of a parsed body of `body_size` bytes, validated and prepared (the
        HTTP route and run-batch both come here); `trace`: the client's trace context."""
        chat = await self.prepare(body, body_size, trace)
        params = chat.params
        call = _ChatCall(random_id("chatcmpl"), chat.model, params.n, params.logprobs,
                         len(chat.prompt_ids), chat.plan, self.ctx.reasoning_parser,
                         chat.in_reasoning)
        return PreparedCall(call, chat.outputs(self.ctx, call.id), chat.stream)

    async def prepare(self, body: dict, body_size: int = 0,
                      trace: Mapping[str, str] | None = None) -> ChatRequest:
        """A chat body validated, rendered and prepared by the engine; /v1/messages comes
        here too, with its body translated into a chat body (serving_messages.py)."""
        ctx = self.ctx
        model, lora_request = ctx.resolve_model(body)
        stream = get_stream(body)
        params = chat_sampling_params(body, ctx.engine.default_sampling)
        priority = get_priority(body)
        plan, prompt_ids = await ctx.work.run_sized(body_size, chat_prompt, ctx, body)
        apply_tool_plan(plan, params, structured_outputs_field(body))
        in_reasoning = apply_reasoning(ctx.reasoning_parser, params, prompt_ids)
        prepared = await ctx.prepare([prompt_ids], params, lora_request, body,
                                     prompt_param="messages",
                                     grammar_param="tools" if plan else None,
                                     trace_headers=trace, operation="chat")
        return ChatRequest(model, params, plan, prompt_ids, prepared, stream, priority,
                           in_reasoning)


class _ChatCall(ApiCall):
    """One /v1/chat/completions call in flight."""

    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, call_id: str, model: str, n: int, logprobs: int | None,
                 num_prompt_tokens: int, plan: ToolPlan | None = None,
                 reasoning: ReasoningParser | None = None, in_reasoning: bool = False) -> None:
        super().__init__(call_id, model, [num_prompt_tokens])
        self.top_logprobs = logprobs
        self.plan = plan
        self.reasoning, self.in_reasoning = reasoning, in_reasoning
        self.choices = [ChatChoice(i, tool_stream=plan.parser.stream() if plan else None,
                                   reasoning_stream=(reasoning.stream(in_reasoning)
                                                     if reasoning else None))
                        for i in range(n)]

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

    def _message(self, ch: ChatChoice) -> tuple[dict[str, Any], str | None]:
        """The choice's message and finish_reason ("tool_calls" when it called)."""
        message: dict[str, Any] = {"role": "assistant", "content": ch.text}
        if self.reasoning is not None:
            split = self.reasoning.extract(ch.text, self.in_reasoning)
            message["content"] = split.content
            message["reasoning_content"] = split.reasoning or None
        if self.plan is None:
            return message, ch.finish_reason
        found = self.plan.parser.extract(message["content"])
        message["content"] = None if self.plan.forced else found.content
        if not found.calls:
            return message, ch.finish_reason
        message["tool_calls"] = [
            {"id": new_tool_call_id(), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in found.calls]
        return message, "tool_calls" if ch.finish_reason == "stop" else ch.finish_reason

    def final_choices(self) -> list[dict[str, Any]]:
        choices = []
        for ch in self.choices:
            message, finish_reason = self._message(ch)
            choices.append({
                "index": ch.index, "message": message,
                "logprobs": {"content": ch.logprobs} if ch.logprobs is not None else None,
                "finish_reason": finish_reason, "stop_reason": ch.stop_reason})
        return choices

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

    def stream_choices(self, prompt_index: int, out: RequestOutput,
                       c: CompletionOutput) -> list[dict[str, Any]]:
        if self.plan is None and self.reasoning is None:
            return super().stream_choices(prompt_index, out, c)
        choice, new_lp = self._advance(c)
        chunks = [{"index": choice.index, "delta": delta, "logprobs": None,
                   "finish_reason": None} for delta in self._deltas(choice, c)]
        if c.finished:
            finish = c.finish_reason
            if choice.call_ids and finish == "stop":
                finish = "tool_calls"
            chunks.append({"index": choice.index, "delta": {}, "logprobs": None,
                           "finish_reason": finish, "stop_reason": c.stop_reason})
        if new_lp is not None:
            if not chunks:
                chunks.append({"index": choice.index, "delta": {}, "finish_reason": None})
            chunks[0]["logprobs"] = {"content": new_lp}
        return chunks

    def _deltas(self, choice: ChatChoice, c: CompletionOutput) -> list[dict[str, Any]]:
        """The deltas of a choice's new text: its reasoning, then the answer's content or
        tool-call deltas (the tool-call parser sees the answer only)."""
        deltas: list[dict[str, Any]] = []
        text = c.text
        if choice.reasoning_stream is not None:
            split = choice.reasoning_stream.feed(text) if text else ReasoningSplit()
            if c.finished:
                rest = choice.reasoning_stream.finish()
                split = ReasoningSplit(split.reasoning + rest.reasoning,
                                       split.content + rest.content)
            if split.reasoning:
                deltas.append({"reasoning_content": split.reasoning})
            text = split.content
        if self.plan is None:
            return deltas + ([{"content": text}] if text else [])
        stream = choice.tool_stream
        assert stream is not None
        events = stream.feed(text) if text else []
        if c.finished:
            events += stream.finish()
        if self.plan.forced:
            events = [e for e in events if not isinstance(e, ContentDelta)]
        return deltas + [self._delta(choice, e) for e in events]

    @staticmethod
    def _delta(choice: ChatChoice, event: ToolEvent) -> dict[str, Any]:
        if isinstance(event, ContentDelta):
            return {"content": event.text}
        if isinstance(event, ToolCallStart):
            choice.call_ids.append(new_tool_call_id())
            return {"tool_calls": [{"index": event.index, "id": choice.call_ids[event.index],
                                    "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        assert isinstance(event, ToolCallArgsDelta)
        return {"tool_calls": [{"index": event.index,
                                "function": {"arguments": event.text}}]}
