"""What an attacker's client could do to a real `aioengine serve` process and must not
(issue 27): stall the event loop with a large body under the size limit, reach a route
without the API key, hold connections open forever, fill the log with tracebacks, slip a
malformed past tool call or a path-like adapter name through, or learn from a 404 whether
a directory exists. One server for the module; raw sockets and urllib (the connection
timeouts are short here, so no client pool reuses a connection the server has closed)."""
from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from server_process import API_KEY, MODEL, ServerProcess, serving

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TIMEOUT_S = 2  # --keepalive-timeout, --body-read-timeout and --stream-write-timeout
MAX_CONNECTIONS = 8
PIRATE = Path(__file__).resolve().parents[2] / "lora" / "examples" / "pirate"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving("--api-key", API_KEY, "--keepalive-timeout", str(TIMEOUT_S),
                       "--body-read-timeout", str(TIMEOUT_S),
                       "--stream-write-timeout", str(TIMEOUT_S),
                       "--max-connections", str(MAX_CONNECTIONS), "--enable-lora",
                       "--allow-runtime-lora-updating",
                       env={"AIOENGINE_FAULT_INJECTION": "1"})


def post(server: ServerProcess, path: str, body: dict | bytes,
         headers: dict[str, str] | None = None) -> tuple[int, dict]:
    status, raw = server.request("POST", path, body, headers=AUTH if headers is None else headers)
    return status, orjson.loads(raw)


LARGE_BODIES = [
    # (route, body, status): ~1 MB of text to tokenize (over the context), 25,000 chat
    # messages to render, 500,000 ids to detokenize; each blocked the loop 1-4 s before.
    ("/v1/completions", {"model": MODEL, "prompt": "hello world " * 90_000, "max_tokens": 1},
     400),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                              "messages": [{"role": "user", "content": "hi"}] * 25_000}, 400),
    ("/detokenize", {"model": MODEL, "tokens": [1] * 500_000}, 200),
    # 7.8 MB of token ids (under the 8 MiB default limit): parsing alone held the loop for
    # ~0.15 s when orjson parsed it there.
    ("/v1/completions", {"model": MODEL, "prompt": [7] * 3_900_000, "max_tokens": 1}, 400),
]


@pytest.mark.parametrize("path,body,status", LARGE_BODIES, ids=[b[0] for b in LARGE_BODIES])
def test_health_answers_while_a_large_body_is_processed(server: ServerProcess, path: str,
                                                         body: dict, status: int) -> None:
    got, _, latencies = server.post_polling_health(path, orjson.dumps(body), AUTH, 120,
                                                   interval=0.02)
    assert got == status
    p95 = latencies[int(len(latencies) * 0.95)]
    assert p95 < 0.1 and latencies[-1] < 0.5, (len(latencies), p95, latencies[-5:])


def test_the_api_key_protects_every_route_but_health(server: ServerProcess) -> None:
    requests = [("GET", "/version", None), ("GET", "/metrics", None),
                ("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "hi"}),
                ("POST", "/detokenize", {"tokens": [1]}),
                ("POST", "/debug/faults", {"kind": "no such fault"}),
                ("GET", "/no/such/route", None)]
    for method, path, body in requests:
        status, raw = server.request(method, path, body)
        assert status == 401, (path, raw)
        assert orjson.loads(raw)["error"]["code"] == "invalid_api_key"
    for method, path, body in requests[:-2]:
        assert server.request(method, path, body, headers=AUTH)[0] == 200, path
    # With the key the fault route is reached (an unknown kind: 400, nothing armed).
    assert server.request("POST", "/debug/faults", {"kind": "no such fault"},
                          headers=AUTH)[0] == 400
    assert server.request("GET", "/health")[0] == 200


def _connect(server: ServerProcess) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_idle_and_half_sent_connections_are_closed(server: ServerProcess) -> None:
    idle, half_head, half_body = (_connect(server) for _ in range(3))
    half_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Le")
    half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 1000\r\nAuthorization: Bearer "
                      + API_KEY.encode() + b"\r\n\r\n{\"prompt\": \"he")
    start = time.monotonic()
    assert _read_all(idle) == b"" and _read_all(half_head) == b""
    answer = _read_all(half_body)
    assert time.monotonic() - start < TIMEOUT_S + 3
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"--body-read-timeout" in answer
    for sock in (idle, half_head, half_body):
        sock.close()


def test_a_stream_whose_client_stops_reading_is_dropped(server: ServerProcess) -> None:
    """A client that asks for a long stream of big chunks (8 samples with top_logprobs 20:
    ~10 MB, more than the kernel's socket buffers grow to) through a 4 KiB receive buffer
    and stops reading, connection kept: once the server's writes have
    waited --stream-write-timeout it drops the connection (no [DONE] ever comes) and logs
    why in one line, instead of holding the handler and its queued chunks forever."""
    logged = len(server.log)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    body = orjson.dumps({"model": MODEL, "stream": True, "max_tokens": 700, "n": 8,
                         "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
                         "messages": [{"role": "user", "content": "Tell a long story."}]})
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                 b"application/json\r\nAuthorization: Bearer " + API_KEY.encode()
                 + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 120
    while "dropped: no data accepted" not in "".join(server.log[logged:]):
        assert time.monotonic() < deadline, "".join(server.log[logged:])
        time.sleep(0.5)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    sock.close()
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    assert b"chat.completion.chunk" in data and b"[DONE]" not in data


def test_connections_beyond_the_cap_get_a_503(server: ServerProcess) -> None:
    held = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    time.sleep(0.2)  # accepted by the server's loop
    refused = _connect(server)
    answer = _read_all(refused)
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    assert b"Retry-After: 1" in answer and b"too_many_connections" in answer
    for sock in held + [refused]:
        sock.close()
    deadline = time.monotonic() + 5
    while server.request("GET", "/health")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_an_over_long_header_is_a_400_logged_in_one_line(server: ServerProcess) -> None:
    logged = len(server.log)
    status, _ = server.request("GET", "/health", headers={"X-Long": "a" * 10_000})
    assert status == 400
    time.sleep(0.2)
    new = "".join(server.log[logged:])
    assert "Traceback" not in new, new
    lines = [line for line in new.splitlines() if "Error handling request" in line]
    assert len(lines) == 1 and "400" in lines[0] and "8190 bytes" in lines[0], new


def test_a_past_tool_call_with_unparsable_arguments_is_a_400(server: ServerProcess) -> None:
    for arguments in ("{not json", "[1, 2]"):
        messages = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [{
                        "id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        status, body = post(server, "/v1/chat/completions",
                            {"model": MODEL, "messages": messages, "max_tokens": 1})
        assert status == 400, body
        error = body["error"]
        assert error["param"] == "messages" and error["type"] == "invalid_request_error"
        assert "messages[1].tool_calls[0].function.arguments" in error["message"]


def test_adapter_names_and_missing_adapters(server: ServerProcess, tmp_path: Path) -> None:
    for name in ("a/b/../c", "../pirate", "/abs", "a//b", "x" * 129, "a b"):
        status, body = post(server, "/v1/load_lora_adapter",
                            {"lora_name": name, "lora_path": str(PIRATE)})
        assert status == 400 and "letters, digits" in body["error"]["message"], (name, body)
    missing = {str(tmp_path / "nothing-here"), str(tmp_path)}  # absent; a dir, no adapter
    texts = set()
    for path in missing:
        status, body = post(server, "/v1/load_lora_adapter",
                            {"lora_name": "x", "lora_path": path})
        assert status == 404 and body["error"]["param"] == "lora_path", body
        texts.add(body["error"]["message"].replace(path, "PATH"))
    assert len(texts) == 1, texts  # one text: the client learns nothing about the files
    status, raw = server.request("POST", "/v1/load_lora_adapter",
                                 {"lora_name": "org/pirate-v1.2", "lora_path": str(PIRATE)},
                                 headers=AUTH)
    assert status == 200 and raw.startswith(b"Success"), raw
