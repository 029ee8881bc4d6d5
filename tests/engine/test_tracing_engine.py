"""Request traces from AsyncEngine itself (the Python API), on the tiny Llama, to a real
OTLP/HTTP receiver: drafts proposed and accepted in the decode span equal the engine's own
spec-decode counters, an n > 1 request is one span, an aborted request still gets its
span, and `generate(trace_headers=...)` continues the caller's trace."""
from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path

import pytest

from aioengine import AsyncEngine, SamplingParams

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from tests.otlp_receiver import OtlpReceiver, attributes  # noqa: E402

TRACE_ID = "5b8efff798038103d269b633813fc60c"
PARENT_ID = "eee19b7ec3c1b174"
_rng = random.Random(7)
PATTERN = [_rng.randrange(100, 40000) for _ in range(6)]
# A random model's greedy output cycles once the vocabulary is narrowed to a few tokens:
# n-gram lookups then find drafts, some accepted.
NARROW = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                        logit_bias={t: 30.0 for t in PATTERN})


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    rx = OtlpReceiver().start()
    yield rx
    rx.stop()


@pytest.fixture
async def engine(tiny_llama_dir: Path, receiver: OtlpReceiver,
                 monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    engine = await AsyncEngine.create(
        str(tiny_llama_dir), max_model_len=256, dtype="float32", max_num_batched_tokens=32,
        otlp_traces_endpoint=receiver.url, speculative_config={
            "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3})
    yield engine
    await engine.shutdown()


async def _spans(receiver: OtlpReceiver, request_id: str):
    """The request span of `request_id` (waited for off the loop) and its children."""
    spans = await asyncio.to_thread(receiver.wait_for, lambda s: s.name == "llm_request" and
                                    attributes(s)["gen_ai.response.id"] == request_id)
    assert len(spans) == 1
    return spans[0], receiver.children(spans[0])


async def test_decode_span_counts_the_engines_drafts(engine: AsyncEngine,
                                                     receiver: OtlpReceiver) -> None:
    before = engine.stats()
    async for out in engine.generate(PATTERN * 3, NARROW, request_id="spec"):
        pass
    after = engine.stats()
    span, children = await _spans(receiver, "spec")
    decode = attributes(children[-1])
    drafts = decode["aioengine.spec_decode.num_draft_tokens"]
    accepted = decode["aioengine.spec_decode.num_accepted_tokens"]
    assert drafts == after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    assert accepted == (after["spec_decode_num_accepted_tokens"]
                        - before["spec_decode_num_accepted_tokens"])
    assert 0 < accepted <= drafts
    # Accepted drafts are tokens no step of their own produced: fewer steps than tokens.
    assert decode["aioengine.decode.num_steps"] == 24 - 1 - accepted
    assert [c.name for c in children] == ["prefill_chunk"] * (len(children) - 1) + ["decode"]
    assert sum(attributes(c)["aioengine.prefill.num_tokens"] for c in children[:-1]) == 18


async def test_n_samples_are_one_span(engine: AsyncEngine, receiver: OtlpReceiver) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    async for out in engine.generate([5, 6, 7, 8], params, request_id="three"):
        pass
    span, children = await _spans(receiver, "three")
    attrs = attributes(span)
    assert attrs["gen_ai.response.finish_reasons"] == ["length"] * 3
    assert attrs["gen_ai.usage.output_tokens"] == 18 and attrs["gen_ai.request.n"] == 3
    assert [c.name for c in children] == ["prefill_chunk", "decode"]


async def test_aborted_request_gets_its_span(engine: AsyncEngine,
                                             receiver: OtlpReceiver) -> None:
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    async with aclosing(engine.generate([9, 10, 11], params, request_id="cut")) as stream:
        async for out in stream:
            if len(out.outputs[0].cumulative_token_ids) >= 3:
                break  # closing the stream aborts the request
    span, _ = await _spans(receiver, "cut")
    attrs = attributes(span)
    assert attrs["gen_ai.response.finish_reasons"] == ["abort"]
    assert 3 <= attrs["gen_ai.usage.output_tokens"] < 200


async def test_generate_continues_the_callers_trace(engine: AsyncEngine,
                                                    receiver: OtlpReceiver) -> None:
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    async for out in engine.generate([{"role": "user", "content": "hi"}],
                                     SamplingParams(max_tokens=3), request_id="chat",
                                     trace_headers=headers):
        pass
    span, _ = await _spans(receiver, "chat")
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert attributes(span)["gen_ai.operation.name"] == "chat"
    prepared = await engine.prepare("hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="trace headers"):
        async for out in engine.generate(prepared, trace_headers=headers):
            pass
