"""--generation-config on a real server: a tiny HF model whose generation_config.json sets
sampling defaults; the OpenAI routes fill a request's omitted fields from them (never a
given one), /v1/models shows them, and a bad DIR stops the start with a clear error."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_process import ServerProcess, openai_client, serving

from tests.tiny_models import make_tiny_model_dir

# top_k 1: the defaults sample greedily, whatever the seed; max_new_tokens -> max_tokens 7;
# repetition_penalty 1.0 is transformers' own default, so not a model default.
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True,
                     "temperature": 0.7, "top_p": 0.95, "top_k": 1, "max_new_tokens": 7,
                     "repetition_penalty": 1.0}
DEFAULTS = {"temperature": 0.7, "top_p": 0.95, "top_k": 1, "max_tokens": 7}
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
NO_EOS = {"ignore_eos": True}  # every answer runs to its max_tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model_dir("llama", tmp_path_factory.mktemp("gencfg") / "llama", seed=5)
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return path


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    yield from serving(str(model_dir), "--served-model-name", "tiny", "--dtype", "float32")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


def test_models_card_and_log_show_the_defaults(server: ServerProcess) -> None:
    status, body = server.request("GET", "/v1/models")
    assert status == 200
    [card] = json.loads(body)["data"]
    assert card["generation_config"] == DEFAULTS
    assert any("Default sampling parameters from the model: " in line
               and "'top_k': 1" in line for line in server.log)


def test_omitted_fields_get_the_models_defaults(client: openai.OpenAI) -> None:
    chat = lambda seed, **kw: client.chat.completions.create(  # noqa: E731
        model="tiny", messages=HELLO, seed=seed, extra_body=NO_EOS, **kw)
    first, second = chat(1), chat(2)
    assert first.usage.completion_tokens == second.usage.completion_tokens == 7
    # top_k 1 from the model: the same text for any seed, the greedy one.
    greedy = chat(3, temperature=0.0)
    assert first.choices[0].message.content == second.choices[0].message.content \
        == greedy.choices[0].message.content
    completion = client.completions.create(model="tiny", prompt="Once upon a time",
                                           extra_body=NO_EOS)
    assert completion.usage.completion_tokens == 7  # min(vLLM's 16, the model's 7)
    response = client.responses.create(model="tiny", input="Hello there", extra_body=NO_EOS)
    assert response.usage.output_tokens == 7


def test_given_fields_win(client: openai.OpenAI) -> None:
    # temperature 1 and top_k 0 given: random samples, which differ between seeds.
    texts = {client.chat.completions.create(
        model="tiny", messages=HELLO, seed=seed, temperature=1, max_tokens=12,
        extra_body={"top_k": 0, **NO_EOS}).choices[0].message.content for seed in (1, 2, 3)}
    assert len(texts) > 1
    short = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3,
                                           extra_body=NO_EOS)
    assert short.usage.completion_tokens == 3
    longer = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20,
                                       extra_body=NO_EOS)
    assert longer.usage.completion_tokens == 20


def test_a_bad_dir_stops_the_start(model_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aioengine.cli", "serve", str(model_dir), "--port", "0",
         "--generation-config", str(tmp_path / "nowhere")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "generation_config must be 'auto', 'vllm' or a directory holding " \
           "generation_config.json" in proc.stderr
    assert "Traceback" not in proc.stderr
