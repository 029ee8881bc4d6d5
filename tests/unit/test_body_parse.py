"""Request bodies of 1 MiB or more are parsed incrementally on a thread
(`offload.parse_json_chunks`): the same value as orjson for any split into chunks, and a
ValueError (a 400 in `read_json`) for whatever orjson refuses."""
from __future__ import annotations

import orjson
import pytest

from aioengine.server.offload import parse_json_chunks

BODIES = [
    {"model": "m", "prompt": [1, 22, 333, 4444] * 50, "max_tokens": 4},
    {"messages": [{"role": "user", "content": "héllo \u2603 \U0001f600\n\"q\""}] * 3,
     "temperature": 0.7, "top_p": -0.0, "stop": None, "stream": True, "n": 1e3},
    {"nested": {"a": [[], {}, [1.5e-300, -2.25e300]], "b": False}},
]


def _split(raw: bytes, size: int) -> list[bytes]:
    return [raw[i:i + size] for i in range(0, len(raw), size)]


@pytest.mark.parametrize("size", [1, 3, 7, 64, 1 << 16])
@pytest.mark.parametrize("body", BODIES, ids=["ids", "chat", "nested"])
def test_chunked_parse_equals_orjson(body: dict, size: int) -> None:
    raw = orjson.dumps(body)
    assert parse_json_chunks(_split(raw, size)) == orjson.loads(raw)


@pytest.mark.parametrize("raw", [b"", b'{"a": 1', b'{"a": 1} x', b'{"a": 1}{"b": 2}',
                                 b'{"a": NaN}', b'{"a": "\xff"}', b'{"a": 1e400}',
                                 b"[1, 2,]"])
def test_what_orjson_refuses_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw)
    with pytest.raises(ValueError):
        parse_json_chunks(_split(raw, 2))
