"""Responses API items -> chat messages, and the bounded store of responses."""
from __future__ import annotations

import pytest

from aioengine.server.protocol import ApiError
from aioengine.server.responses_items import ResponseState, input_messages, output_messages
from aioengine.server.serving_responses import ResponsesStore, StoredResponse


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
        input_messages([{"type": "reasoning", "id": "r"}])
    assert e.value.param == "input"


def test_the_store_drops_the_oldest_beyond_its_size() -> None:
    store = ResponsesStore(max_entries=2)
    for i in range(3):
        store.put(StoredResponse(ResponseState(f"resp_{i}", "m", {}), []))
    with pytest.raises(ApiError) as e:
        store.get("resp_0")
    assert e.value.status == 404
    assert [store.get(f"resp_{i}").state.id for i in (1, 2)] == ["resp_1", "resp_2"]
