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
