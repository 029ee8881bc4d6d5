"""Default fixtures of the e2e tests: one `aioengine serve` per test module, with no extra
flags, and the real `openai` client on it. A module that needs flags (an API key, limits)
defines its own `server` (and `client`)."""
from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from server_process import ServerProcess, openai_client, serving


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


# The flags of `make serve`: tool calls read (and auto calls constrained) in the hermes format.
TOOL_SERVER_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="session")
def tool_server() -> Iterator[ServerProcess]:
    """One server with tool calling for the tool, Responses and agent-library modules."""
    yield from serving(*TOOL_SERVER_ARGS)


@pytest.fixture(scope="session")
def tool_client(tool_server: ServerProcess) -> openai.OpenAI:
    return openai_client(tool_server)
