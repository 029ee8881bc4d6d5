"""Responses API items -> chat messages, `metadata`'s rules, a Response's frozen output, and
the store of responses, bounded in entries and bytes (running background ones pinned)."""
from __future__ import annotations

import gc

import orjson
import pytest

from aioengine.sampling_params import SamplingParams
from aioengine.server.protocol import ApiError
from aioengine.server.responses_items import (ResponseState, check_metadata, input_messages,
                                              message_item, output_messages)
from aioengine.server.responses_store import ResponsesStore, StoredResponse
from aioengine.server.serving_responses import _echo


def test_items_become_chat_turns() -> None:
    messages = input_messages([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "done"}])
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1] == {"role": "user", "content": "a\nb"}
    # Two calls of one turn are one assistant message.
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "done"}
    output = [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]},
              {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"}]
    turn = output_messages(output)
    assert len(turn) == 1 and turn[0]["content"] == "hi" and turn[0]["tool_calls"][0]["id"] == "c3"
    with pytest.raises(ApiError, match="unsupported type") as e:
        input_messages([{"type": "web_search_call", "id": "w"}])
    assert e.value.param == "input"
    # A past output's reasoning item, passed back as clients do, is skipped.
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "hmm"}]}
    assert input_messages([{"role": "user", "content": "a"}, reasoning]) == [
        {"role": "user", "content": "a"}]


def test_metadata_follows_openais_limits() -> None:
    most = {f"{i:064d}": "v" * 512 for i in range(16)}
    assert check_metadata(most) is most and check_metadata(None) == {}
    for bad, why in [([], "must be an object"), ("x", "must be an object"),
                     ({f"k{i}": "v" for i in range(17)}, "17 keys; at most 16"),
                     ({"k" * 65: "v"}, "65 characters; at most 64"),
                     ({"k": "v" * 513}, "513 characters; at most 512"),
                     ({"k": 1}, "must be a string"), ({"k": {"a": "b"}}, "must be a string"),
                     ({"k": None}, "must be a string")]:
        with pytest.raises(ApiError, match=why) as e:
            check_metadata(bad)
        assert e.value.status == 400 and e.value.param == "metadata"


def test_an_ended_response_keeps_its_output_as_json() -> None:
    state = ResponseState("resp_1", "m", {"metadata": orjson.Fragment(b'{"a":"b"}')})
    state.output.append(message_item("hello"))
    before = orjson.loads(orjson.dumps(state.body()))
    assert state.freeze() == len(orjson.dumps(before["output"]))
    assert state.output == [] and not gc.is_tracked(orjson.Fragment(state.output_json))
    after = orjson.loads(orjson.dumps(state.body()))
    assert after == before and after["metadata"] == {"a": "b"}


def test_the_echoed_settings_are_kept_as_json() -> None:
    """What a stored response repeats of its request holds no container the garbage
    collector would walk on every full collection, and `text` only its format's fields."""
    tool = {"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}}
    body = {"tools": [tool], "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_object", "junk": [{"a": 1}] * 1000},
                     "junk": [{"a": 1}] * 1000}}
    echo, nbytes = _echo(body, "Be brief.", {"k": "v"}, SamplingParams(), None)
    assert not any(gc.is_tracked(v) for v in echo.values())
    assert nbytes == sum(len(orjson.dumps(echo[k])) for k in
                         ("metadata", "text", "tool_choice", "tools")) + len("Be brief.")
    shown = orjson.loads(orjson.dumps(echo))
    assert shown["tools"] == [tool] and shown["text"] == {"format": {"type": "json_object"}}
    assert shown["metadata"] == {"k": "v"} and shown["instructions"] == "Be brief."


def _response(i: int, background: bool = False) -> StoredResponse:
    return StoredResponse(ResponseState(f"resp_{i}", "m", {"store": True}), [], background)


def _ids(store: ResponsesStore) -> list[str]:
    ids = []
    for i in range(20):
        try:
            ids.append(store.get(f"resp_{i}").state.id)
        except ApiError as e:
            assert e.status == 404
    return ids


def test_the_store_drops_the_oldest_beyond_its_entries() -> None:
    store = ResponsesStore(max_entries=2)
    for i in range(3):
        assert store.admit(_response(i), 10)
    assert _ids(store) == ["resp_1", "resp_2"] and store.nbytes == 20


def test_the_store_drops_the_oldest_beyond_its_bytes() -> None:
    store = ResponsesStore(max_entries=10, max_bytes=100)
    for i in range(3):
        assert store.admit(_response(i), 40)
    assert _ids(store) == ["resp_1", "resp_2"] and store.nbytes == 80
    # One bigger than the whole budget is not stored, and nothing is dropped for it.
    assert not store.admit(_response(3), 101) and not store.fits(101)
    assert _ids(store) == ["resp_1", "resp_2"]
    # A response that has ended is stored anew: the older one goes first.
    ended = store.get("resp_1")
    ended.ended = True
    assert store.update(ended, 45) and store.admit(_response(4), 40)
    assert _ids(store) == ["resp_1", "resp_4"] and store.nbytes == 85


def test_running_background_responses_are_never_dropped() -> None:
    store = ResponsesStore(max_entries=2, max_bytes=100)
    running = _response(0, background=True)
    assert store.admit(running, 30)
    for i in range(1, 4):  # finished ones come and go around it
        assert store.admit(_response(i), 30)
    assert _ids(store) == ["resp_0", "resp_3"]
    assert store.admit(_response(4, background=True), 60)
    assert _ids(store) == ["resp_0", "resp_4"]
    # Only running ones are left: no room, and none of them is dropped.
    assert not store.admit(_response(5), 10) and not store.admit(_response(6, True), 10)
    assert store.fits(10) and _ids(store) == ["resp_0", "resp_4"]
    # One that ends larger than the running ones leave room for is dropped, itself last.
    running.ended = True
    assert not store.update(running, 50)
    assert _ids(store) == ["resp_4"] and store.nbytes == 60
    assert not store.update(running, 10)  # no longer stored


def test_a_store_of_no_entries_stores_nothing() -> None:
    store = ResponsesStore(max_entries=0)
    assert not store.fits(1) and not store.admit(_response(0), 1) and len(store) == 0
