"""The Responses store under hostile input (issue 48, findings 4 and 8), on a server with a
small store (3 entries, 16,000 bytes): `metadata` under OpenAI's limits, the store bounded in
bytes as well as entries, and running background responses never dropped from it (fetchable
and cancellable to their end; one that does not fit beside them is refused)."""
from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import orjson
import pytest
from server_process import ServerProcess, openai_client, serving

pytestmark = pytest.mark.slow

MAX_ENTRIES = 3
MAX_BYTES = 16_000
# OpenAI's largest metadata: 16 keys of 64 characters, values of 512 (~9.3 KB as JSON), so
# that two responses carrying it do not fit MAX_BYTES and one does.
BIG_METADATA = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
SMALL = {"input": "Hi", "max_output_tokens": 2, "temperature": 0}
# Runs until cancelled (on the bundled model, thousands of tokens take minutes on a CPU).
LONG = {"input": "Write a very long story about a dragon.", "max_output_tokens": 4000,
        "background": True, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving("--max-stored-responses", str(MAX_ENTRIES),
                       "--max-stored-response-bytes", str(MAX_BYTES))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _stored(client: openai.OpenAI, response_id: str) -> bool:
    try:
        client.responses.retrieve(response_id)
    except openai.NotFoundError:
        return False
    return True


def _cancel_all(client: openai.OpenAI, server: ServerProcess, ids: list[str]) -> None:
    for response_id in ids:
        assert client.responses.cancel(response_id).status == "cancelled"
    m = server.wait_idle()  # their engine requests aborted, every KV block free
    assert m["aioengine:num_requests_running"] == 0
    assert m["aioengine:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("metadata, why", [
    ({f"k{i}": "v" for i in range(17)}, "17 keys; at most 16"),
    ({"k" * 65: "v"}, "65 characters; at most 64"),
    ({"k": "v" * 513}, "513 characters; at most 512"),
    ({"k": 1}, "must be a string"),
    ({"k": [{"a": 1}] * 3}, "must be a string"),
    (["k", "v"], "must be an object")])
def test_metadata_past_openais_limits_is_a_400(client, model, metadata, why) -> None:
    with pytest.raises(openai.BadRequestError, match=why) as e:
        client.responses.create(model=model, **SMALL, metadata=metadata)
    assert e.value.body["param"] == "metadata"


def test_metadata_of_8_mb_is_refused_before_any_work(server, client, model) -> None:
    """The finding's request: ~7 MB of small objects under one key (the body limit is
    8 MiB) kept ~190 MB per stored response; now a 400 that stores nothing."""
    body = orjson.dumps({**SMALL, "model": model, "metadata": {"m": [{"a": 1}] * 900_000}})
    assert len(body) > 7_000_000
    start = time.monotonic()
    status, out = server.request("POST", "/v1/responses", body)
    assert status == 400 and orjson.loads(out)["error"]["param"] == "metadata"
    assert time.monotonic() - start < 10  # parsing the body, off the loop, and no more


def test_the_largest_metadata_is_kept(client, model) -> None:
    r = client.responses.create(model=model, **SMALL, metadata=BIG_METADATA)
    assert r.metadata == BIG_METADATA and r.store
    assert client.responses.retrieve(r.id).metadata == BIG_METADATA


def test_the_store_drops_the_oldest_beyond_its_entries(client, model) -> None:
    ids = [client.responses.create(model=model, **SMALL).id for _ in range(MAX_ENTRIES + 1)]
    assert [_stored(client, i) for i in ids] == [False] + [True] * MAX_ENTRIES


def test_the_store_drops_the_oldest_beyond_its_bytes(client, model) -> None:
    first = client.responses.create(model=model, **SMALL, metadata=BIG_METADATA)
    assert first.store and _stored(client, first.id)
    second = client.responses.create(model=model, **SMALL, metadata=BIG_METADATA)
    # Two entries of MAX_ENTRIES, but not both within MAX_BYTES: the older is dropped.
    assert second.store and _stored(client, second.id) and not _stored(client, first.id)


def test_a_response_larger_than_the_store_is_answered_unstored(client, model) -> None:
    kept = client.responses.create(model=model, **SMALL)
    big = {"format": {"type": "json_object", "description": "d" * MAX_BYTES}}
    r = client.responses.create(model=model, **SMALL, text=big)
    assert r.status in ("completed", "incomplete") and r.output
    assert r.store is False and not _stored(client, r.id)
    assert _stored(client, kept.id)  # nothing was dropped for it
    with pytest.raises(openai.BadRequestError, match="must be stored") as e:
        client.responses.create(model=model, **SMALL, text=big, background=True)
    assert e.value.body["param"] == "background"


def test_a_running_background_response_is_never_dropped(server, client, model) -> None:
    """The finding: a background response dropped from the store ran on, out of reach
    (404 to GET and to cancel)."""
    running = client.responses.create(model=model, **LONG)
    others = [client.responses.create(model=model, **SMALL) for _ in range(MAX_ENTRIES + 1)]
    assert all(r.store for r in others)
    assert client.responses.retrieve(running.id).status in ("queued", "in_progress")
    assert not _stored(client, others[0].id)  # finished ones go instead
    _cancel_all(client, server, [running.id])
    assert client.responses.retrieve(running.id).status == "cancelled"


def test_a_store_full_of_running_background_responses(server, client, model) -> None:
    """No room beside the running ones: a new background response is a 429 (retry once one
    has ended), a foreground one is answered unstored; the running ones stay reachable."""
    running = [client.responses.create(model=model, **LONG).id for _ in range(MAX_ENTRIES)]
    try:
        with pytest.raises(openai.RateLimitError, match="full of running background") as e:
            client.responses.create(model=model, **LONG)
        assert e.value.body["param"] == "background"
        r = client.responses.create(model=model, **SMALL)
        assert r.output and r.store is False and not _stored(client, r.id)
        assert all(_stored(client, i) for i in running)
    finally:
        _cancel_all(client, server, running)
    # Cancelled, they have ended: room again.
    again = client.responses.create(model=model, **SMALL)
    assert again.store and _stored(client, again.id)
    assert [_stored(client, i) for i in running] == [False, True, True]


def test_a_finished_background_response_continues_a_conversation(client, model) -> None:
    r = client.responses.create(model=model, **SMALL, background=True)
    for _ in range(600):
        r = client.responses.retrieve(r.id)
        if r.status not in ("queued", "in_progress"):
            break
        time.sleep(0.1)
    assert r.status in ("completed", "incomplete") and r.output_text
    follow = client.responses.create(model=model, **SMALL, previous_response_id=r.id)
    assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
