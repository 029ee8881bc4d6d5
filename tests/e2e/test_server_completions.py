"""/v1/completions, /v1/models, /tokenize, /metrics through a real `aioengine serve`
process and the real `openai` client (sync and async)."""
from __future__ import annotations

from collections.abc import Iterator

import asyncio

import openai
import orjson
import pytest

from server_process import API_KEY, MODEL, ServerProcess, openai_client, serving

AUTH = {"Authorization": f"Bearer {API_KEY}"}

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving("--api-key", API_KEY)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, API_KEY)


@pytest.fixture
def aclient(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                              timeout=120)


def test_ready_line_binds_loopback_and_names_the_model(server: ServerProcess) -> None:
    assert server.url.startswith("http://127.0.0.1:")
    assert server.model == MODEL


def test_models_health_version(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "aioengine"
    assert models[0].model_extra["max_model_len"] == 8192
    status, body = server.request("GET", "/health")
    assert status == 200
    status, body = server.request("GET", "/version", headers=AUTH)
    version = orjson.loads(body)
    assert status == 200 and version["version"]
    # dtype "auto": what it chose and the CPU flags it was based on.
    from aioengine import cpu_info
    expected = "bfloat16" if cpu_info.has_bf16_compute() else "float32"
    assert version["dtype"] == expected == models[0].model_extra["dtype"]
    # The KV cache follows bf16 weights (dtypes.auto_kv_cache_dtype).
    assert version["activations"] == "float32" and version["kv_cache_dtype"] == expected
    assert version["cpu"]["flags"] == cpu_info.relevant_flags()
    best = __import__("aioengine.kernels.cpu", fromlist=["x"]).supported_variants()[0]
    # the amx build names where its bf16 GEMM runs (tiles, unless the kernel refused them)
    assert version["cpu"]["kernels"] in (best, f"{best} (bf16 GEMM on AMX tiles)")
    assert version["weight_bytes"] > 0 and version["dtype_reason"]


def test_greedy_stream_joins_to_the_non_streamed_text(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.model == MODEL and isinstance(full.created, int)
    assert choice.index == 0 and choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == 5  # SmolLM2 adds no BOS
    assert full.usage.total_tokens == 17
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)
    # Streamed as produced, not as one final blob (drafts kept in one step arrive together).
    assert len(chunks) >= 3


def test_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16
    assert out.choices[0].finish_reason == "length"


def test_n3_with_seed_gives_three_choices_and_streams_route_by_index(
        client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, n=3, seed=7,
                  temperature=1.0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = [c.text for c in full.choices]
    assert len(set(texts)) == 3
    streamed = ["", "", ""]
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts  # same seed, same samples, whatever the batch
    assert full.usage.completion_tokens == 30


def test_batch_of_prompts_strings_and_token_ids(server: ServerProcess,
                                               client: openai.OpenAI) -> None:
    prompts = [PROMPT, "1, 2, 3, 4,"]
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
              .choices[0].text for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0,
                                      n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    # choice index = prompt index * n + sample index
    assert [c.text for c in batch.choices] == [single[0], single[0], single[1], single[1]]
    ids = [orjson.loads(server.request("POST", "/tokenize", {"prompt": p},
                                      headers=AUTH)[1])["tokens"]
           for p in prompts]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == single
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=6, temperature=0)
    assert one.choices[0].text == single[0]
    assert by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_echo_with_logprobs(server: ServerProcess, client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                    echo=True, logprobs=2)
    choice = out.choices[0]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert choice.text == PROMPT + plain.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == 5 + 4
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[5] == len(PROMPT)
    for token, top, value in zip(lp.tokens[5:], lp.top_logprobs[5:], lp.token_logprobs[5:]):
        assert top[token] == value == max(top.values())  # greedy takes the best
        assert len(top) <= 3
    ids = orjson.loads(server.request("POST", "/tokenize", {"prompt": PROMPT},
                                      headers=AUTH)[1])["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                       echo=True)
    assert by_ids.choices[0].text == choice.text  # token ids echo as their text


def test_stop_string_and_stop_reason(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text.strip().split()[1]  # a word the greedy text contains
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    assert out.choices[0].text == text[:text.index(stop)]


def test_include_usage_only_in_a_final_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 10
    assert last.usage.total_tokens == last.usage.prompt_tokens + 10
    assert all(c.usage is None and c.choices for c in chunks[:-1])
    finished = [c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


def test_prefix_cache_hits_show_in_usage(client: openai.OpenAI) -> None:
    prompt = "Paged attention stores the key and value cache in fixed-size blocks. " * 4
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_tokenize_detokenize_roundtrip(server: ServerProcess) -> None:
    status, body = server.request("POST", "/tokenize", {"prompt": PROMPT}, headers=AUTH)
    tokens = orjson.loads(body)
    assert status == 200 and tokens["count"] == 5 == len(tokens["tokens"])
    assert tokens["max_model_len"] == 8192
    status, body = server.request("POST", "/detokenize", {"tokens": tokens["tokens"]},
                                  headers=AUTH)
    assert status == 200 and orjson.loads(body)["prompt"] == PROMPT
    status, body = server.request("POST", "/tokenize", {
        "messages": [{"role": "user", "content": "Hi"}]}, headers=AUTH)
    assert status == 200 and orjson.loads(body)["count"] > 5


def test_metrics_count_requests_and_tokens(server: ServerProcess,
                                           client: openai.OpenAI) -> None:
    before = server.wait_idle()
    outs = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3 + i,
                                      temperature=0, extra_body={"ignore_eos": True})
            for i in range(3)]
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("aioengine:request_success_total") == 3
    assert delta("aioengine:generation_tokens_total") == sum(
        o.usage.completion_tokens for o in outs) == 3 + 4 + 5
    assert delta("aioengine:prompt_tokens_total") == 15
    assert after["aioengine:kv_cache_usage_perc"] == 0
    # Speculation is on by default (auto), so its counters exist
    # (test_server_spec_decode_metrics.py checks them).
    assert "aioengine:spec_decode_num_drafts_total" in after


async def test_async_client_concurrent_requests(aclient: openai.AsyncOpenAI,
                                                client: openai.OpenAI) -> None:
    prompts = [PROMPT, "Water boils at", "The opposite of hot is"]
    expected = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
                .choices[0].text for p in prompts]

    async def streamed(p: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=8,
                                                  temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    got = await asyncio.gather(*(streamed(p) for p in prompts))
    assert got == expected  # greedy output does not depend on the batch
