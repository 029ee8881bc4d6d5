"""Multi-LoRA through a real `aioengine serve --enable-lora` process and the `openai` client:
adapters as models (completions and chat, streamed or not, mixed with base requests in one
batch), /v1/models, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (while a stream
runs on the adapter being unloaded), their error statuses and bodies, vLLM's
lora_requests_info gauge, and every KV block free at the end. The adapters are random PEFT
adapters for the bundled model's Hugging Face export; the start-up failures and the server
without LoRA run on a tiny model (seconds, not the bundled model's load)."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import orjson
import pytest
from server_process import MODEL, ServerProcess, openai_client, serving, start_server

from tests.lora_adapters import make_peft_adapter

slow = pytest.mark.slow  # the tests on the bundled model

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> make_peft_adapter arguments; random A and B, so each adapter's greedy text is far
# from the base model's (and from the others').
ADAPTERS = {
    "alpha": dict(r=8, target_modules=["q_proj", "v_proj"], seed=1),
    "beta": dict(r=4, target_modules=ALL_MODULES, seed=2, scale=0.1),
    "gamma": dict(r=16, target_modules=["o_proj", "down_proj"], seed=3, scale=0.1),
    "big": dict(r=32, target_modules=["q_proj"], seed=4),  # above --max-lora-rank 16
}
BETA_PARENT = "HuggingFaceTB/SmolLM2-135M-Instruct"  # --lora-modules' base_model_name
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three largest cities of Italy are"
NEW_TOKENS = 8
LONG = 100  # tokens of the stream that outlives its adapter's unload
LABEL = re.compile(r'(\w+)="([^"]*)"')


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The PEFT adapters of ADAPTERS, plus `corrupt` (a config, weights that are not
    safetensors) and `empty` (a directory without adapter_config.json)."""
    from aioengine.bench.hf_export import export_hf

    root = tmp_path_factory.mktemp("server_lora")
    model_dir = export_hf()
    made = {name: make_peft_adapter(model_dir, root / name, **kw) for name, kw in ADAPTERS.items()}
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_bytes(
        (made["alpha"] / "adapter_config.json").read_bytes())
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    (root / "empty").mkdir()
    return {**made, "corrupt": corrupt, "empty": root / "empty"}


@pytest.fixture(scope="module")
def server(adapters: dict[str, Path]) -> Iterator[ServerProcess]:
    beta = {"name": "beta", "path": str(adapters["beta"]), "base_model_name": BETA_PARENT}
    yield from serving("--dtype", "float32", "--enable-lora", "--max-loras", "2",
                       "--max-lora-rank", "16", "--max-cpu-loras", "3",
                       "--lora-modules", f"alpha={adapters['alpha']}", json.dumps(beta),
                       "--allow-runtime-lora-updating")


def greedy(client: openai.OpenAI, route: str, model: str, **extra) -> str:
    if route == "chat":
        out = client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                             max_tokens=NEW_TOKENS, **extra)
        assert out.model == model
        return out.choices[0].message.content
    out = client.completions.create(model=model, prompt=PROMPT, temperature=0,
                                    max_tokens=NEW_TOKENS, **extra)
    assert out.model == model
    return out.choices[0].text


@pytest.fixture(scope="module")
def solo(client: openai.OpenAI) -> dict[tuple[str, str], str]:
    """(route, model) -> greedy text alone, the base model's first: before any adapter
    request reached the server."""
    return {(route, model): greedy(client, route, model)
            for model in (MODEL, "alpha", "beta") for route in ("chat", "completions")}


def post(server: ServerProcess, path: str, body: dict | bytes) -> tuple[int, bytes]:
    return server.request("POST", path, body)


def lora_info(server: ServerProcess) -> tuple[str, str, str, float]:
    """(max_lora, running_lora_adapters, waiting_lora_adapters, value) of the gauge, whose
    one series has exactly these labels."""
    _, text = server.request("GET", "/metrics")
    series = [line.rsplit(" ", 1) for line in text.decode().splitlines()
              if line.startswith("aioengine:lora_requests_info{")]
    assert len(series) == 1, series
    labels = dict(LABEL.findall(series[0][0]))
    assert set(labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    return (labels["max_lora"], labels["running_lora_adapters"],
            labels["waiting_lora_adapters"], float(series[0][1]))


def wait_for_info(server: ServerProcess, running: str, waiting: str) -> None:
    deadline = time.monotonic() + 30
    while lora_info(server)[1:3] != (running, waiting):
        assert time.monotonic() < deadline, lora_info(server)
        time.sleep(0.05)


@slow
def test_models_lists_the_base_then_the_adapters(client: openai.OpenAI, server: ServerProcess,
                                                 adapters: dict[str, Path], solo) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, "alpha", "beta"]
    base, alpha, beta = (m.model_extra for m in models)
    assert base["parent"] is None
    assert (alpha["root"], alpha["parent"]) == (str(adapters["alpha"]), MODEL)
    assert (beta["root"], beta["parent"]) == (str(adapters["beta"]), BETA_PARENT)
    assert alpha["max_model_len"] == base["max_model_len"]
    log = "".join(server.log)
    assert "LoRA: 2 slots of rank 16" in log and "up to 3 adapters in CPU memory" in log, log


@slow
def test_each_adapter_has_its_own_output(solo: dict[tuple[str, str], str]) -> None:
    # The base model's text after adapter traffic: test_every_kv_block_free_...
    for route in ("chat", "completions"):
        base, alpha, beta = (solo[(route, m)] for m in (MODEL, "alpha", "beta"))
        assert len({base, alpha, beta}) == 3, (base, alpha, beta)


@slow
def test_streaming_with_an_adapter(client: openai.OpenAI,
                                   solo: dict[tuple[str, str], str]) -> None:
    stream = client.chat.completions.create(model="alpha", messages=QUESTION, temperature=0,
                                            max_tokens=NEW_TOKENS, stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {"alpha"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == solo[("chat", "alpha")]
    stream = client.completions.create(model="beta", prompt=PROMPT, temperature=0,
                                       max_tokens=NEW_TOKENS, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == \
        solo[("completions", "beta")]
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS


@slow
async def test_one_batch_of_base_and_adapter_requests(
        server: ServerProcess, solo: dict[tuple[str, str], str]) -> None:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                timeout=120)
    keys = [(route, model) for model in (MODEL, "alpha", "beta", MODEL)
            for route in ("chat", "completions")]

    async def one(route: str, model: str) -> str:
        if route == "chat":
            out = await client.chat.completions.create(
                model=model, messages=QUESTION, temperature=0, max_tokens=NEW_TOKENS)
            return out.choices[0].message.content
        out = await client.completions.create(model=model, prompt=PROMPT, temperature=0,
                                              max_tokens=NEW_TOKENS)
        return out.choices[0].text

    texts = await asyncio.gather(*(one(*key) for key in keys))
    await client.close()
    assert [solo[key] for key in keys] == list(texts)


@slow
def test_an_unknown_model_is_404(server: ServerProcess, client: openai.OpenAI) -> None:
    for path, body in (("/v1/completions", {"model": "nope", "prompt": "Hi"}),
                       ("/v1/chat/completions", {"model": "nope", "messages": QUESTION})):
        status, raw = post(server, path, body)
        assert (status, orjson.loads(raw)) == (404, {"error": {
            "message": "The model `nope` does not exist.", "type": "NotFoundError",
            "param": "model", "code": 404}})
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="alph", prompt="Hi", max_tokens=2, stream=True)
    assert e.value.status_code == 404 and "`alph`" in e.value.message


def _load(server: ServerProcess, name: str, path: Path | str) -> tuple[int, str]:
    status, raw = post(server, "/v1/load_lora_adapter",
                       {"lora_name": name, "lora_path": str(path)})
    return status, raw.decode()


def _unload(server: ServerProcess, name: str) -> tuple[int, str]:
    status, raw = post(server, "/v1/unload_lora_adapter", {"lora_name": name})
    return status, raw.decode()


def _model_ids(client: openai.OpenAI) -> list[str]:
    return [m.id for m in client.models.list().data]


@slow
def test_load_and_unload_while_a_stream_runs(server: ServerProcess, client: openai.OpenAI,
                                             adapters: dict[str, Path],
                                             solo: dict[tuple[str, str], str]) -> None:
    assert lora_info(server)[:3] == ("2", "", "")
    long = client.chat.completions.create(
        model="alpha", messages=QUESTION, max_tokens=LONG, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    long_chunks = iter(long)
    first = [next(long_chunks), next(long_chunks)]  # the role, then the first token
    assert first[1].choices[0].delta.content
    # Unloaded while its stream runs: new requests get a 404 at once, the stream goes on.
    assert _unload(server, "alpha") == (
        200, "Success: LoRA adapter 'alpha' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="alpha", prompt="Hi", max_tokens=2)
    assert _model_ids(client) == [MODEL, "beta"]
    wait_for_info(server, running="alpha", waiting="")
    assert _load(server, "gamma", adapters["gamma"]) == (
        200, "Success: LoRA adapter 'gamma' added successfully.")
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, "beta", "gamma"]
    assert models[2].model_extra["root"] == str(adapters["gamma"])
    assert models[2].model_extra["parent"] == MODEL
    # alpha and beta fill --max-loras 2: a gamma request waits for one of them to finish.
    beta = client.completions.create(model="beta", prompt=PROMPT, max_tokens=32, stream=True,
                                     extra_body={"ignore_eos": True})
    beta_chunks = iter(beta)
    next(beta_chunks)
    with ThreadPoolExecutor(1) as pool:
        gamma = pool.submit(greedy, client, "completions", "gamma")
        wait_for_info(server, running="alpha,beta", waiting="gamma")
        assert list(beta_chunks)[-1].choices[0].finish_reason == "length"
        assert gamma.result(timeout=120) != solo[("completions", MODEL)]
    rest = list(long_chunks)
    assert rest[-2].choices[0].finish_reason == "length"
    assert rest[-1].usage.completion_tokens == LONG
    # Loaded again under its name (a new load of the same files): the same text.
    assert _load(server, "alpha", adapters["alpha"])[0] == 200
    assert greedy(client, "chat", "alpha") == solo[("chat", "alpha")]
    assert _model_ids(client) == [MODEL, "beta", "gamma", "alpha"]
    _, _, _, stamp = lora_info(server)
    assert lora_info(server)[:3] == ("2", "", "") and abs(stamp - time.time()) < 60


LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
BOTH = "Both 'lora_name' and 'lora_path' must be provided."


def _bad_requests(adapters: dict[str, Path]) -> list[tuple[str, dict | bytes, int, str, str]]:
    """(route, body, status, type, words of the message)."""
    return [
        (LOAD, {}, 400, "InvalidUserInput", BOTH),
        (LOAD, {"lora_name": "x"}, 400, "InvalidUserInput", BOTH),
        (LOAD, {"lora_path": str(adapters["gamma"])}, 400, "InvalidUserInput", BOTH),
        (LOAD, {"lora_name": "x", "lora_path": 7}, 400, "InvalidUserInput", BOTH),
        (LOAD, {"lora_name": "beta", "lora_path": str(adapters["gamma"])}, 400,
         "InvalidUserInput", "The lora adapter 'beta' has already been loaded."),
        (LOAD, {"lora_name": MODEL, "lora_path": str(adapters["gamma"])}, 400,
         "InvalidUserInput", f"'{MODEL}' is a served name of the base model"),
        # One text for any adapter that cannot be found: it never says what exists.
        (LOAD, {"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 404, "NotFoundError",
         "No LoRA adapter can be loaded from lora_path '/nonexistent/adapter'"),
        (LOAD, {"lora_name": "x", "lora_path": str(adapters["empty"])}, 404, "NotFoundError",
         "No LoRA adapter can be loaded from lora_path"),
        (LOAD, {"lora_name": "x", "lora_path": str(adapters["corrupt"])}, 400,
         "BadRequestError", "adapter_model.safetensors: cannot be read"),
        (LOAD, {"lora_name": "x", "lora_path": str(adapters["big"])}, 400, "BadRequestError",
         "rank 32 of layers.0.q_proj is above max_lora_rank 16"),
        (UNLOAD, {}, 400, "InvalidUserInput",
         "'lora_name' needs to be provided to unload a LoRA adapter."),
        (UNLOAD, {"lora_name": "nope", "lora_int_id": 3}, 404, "NotFoundError",
         "The lora adapter 'nope' cannot be found."),
        (UNLOAD, {"lora_name": MODEL}, 404, "NotFoundError",
         f"The lora adapter '{MODEL}' cannot be found."),
        (LOAD, b"{not json", 400, "invalid_request_error", "not valid JSON"),
    ]


@slow
def test_load_and_unload_errors(server: ServerProcess, client: openai.OpenAI,
                                adapters: dict[str, Path]) -> None:
    before = _model_ids(client)
    for route, body, status, kind, words in _bad_requests(adapters):
        got_status, raw = post(server, route, body)
        error = orjson.loads(raw)["error"]
        assert (got_status, error["type"]) == (status, kind), (route, body, error)
        assert words in error["message"], (route, body, error)
        assert error["code"] == (None if kind == "invalid_request_error" else status)
    assert _model_ids(client) == before  # nothing half-loaded
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="x", prompt="Hi", max_tokens=2)


@slow
def test_every_kv_block_free_and_the_base_model_unchanged(
        server: ServerProcess, client: openai.OpenAI,
        solo: dict[tuple[str, str], str]) -> None:
    m = server.wait_idle()
    assert m["aioengine:num_requests_running"] == 0
    assert m["aioengine:num_requests_waiting"] == 0
    assert m["aioengine:kv_cache_usage_perc"] == 0
    for reason in ("abort", "error"):
        assert m[f'aioengine:request_success_total{{finished_reason="{reason}",'
                 f'model_name="{MODEL}"}}'] == 0
    for route in ("chat", "completions"):
        assert greedy(client, route, MODEL) == solo[(route, MODEL)]


# ---- without --enable-lora, and start-up failures: a tiny model -------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    from aioengine.bench.hf_export import export_hf
    from tests.tiny_models import make_tiny_model_dir

    tokenizer = AutoTokenizer.from_pretrained(export_hf())  # fast: tokenizer.json
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny") / "llama",
                               tokenizer=tokenizer)


def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "aioengine.cli", "serve", "--port", "0",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def bad_start_up(tiny_model: Path, adapters: dict[str, Path]) -> subprocess.Popen:
    """`serve --lora-modules` with an adapter whose weights cannot be read (found only
    once the model has loaded); started early, so it runs beside the next server."""
    return _serve(str(tiny_model), "--enable-lora", "--lora-modules",
                  f"bad={adapters['corrupt']}")


@pytest.mark.usefixtures("bad_start_up")
def test_without_lora_flags_no_routes_no_adapters_no_gauge(tiny_model: Path,
                                                           adapters: dict[str, Path]) -> None:
    srv = start_server(str(tiny_model), "--served-model-name", "tiny")
    try:
        for route in (LOAD, UNLOAD):
            status, raw = post(srv, route, {"lora_name": "alpha",
                                            "lora_path": str(adapters["alpha"])})
            assert status == 404 and orjson.loads(raw)["error"]["type"] == "not_found_error"
        status, raw = post(srv, "/v1/completions", {"model": "alpha", "prompt": "Hi"})
        assert status == 404
        assert orjson.loads(raw)["error"]["message"] == "The model `alpha` does not exist."
        assert [m.id for m in openai_client(srv).models.list().data] == ["tiny"]
        assert "lora_requests_info" not in srv.request("GET", "/metrics")[1].decode()
    finally:
        srv.stop_cleanly()


def test_a_bad_lora_module_stops_the_start_up(bad_start_up: subprocess.Popen,
                                              adapters: dict[str, Path]) -> None:
    _, stderr = bad_start_up.communicate(timeout=120)
    corrupt = adapters["corrupt"]
    assert bad_start_up.returncode == 2, stderr
    assert (f"error: --lora-modules bad={corrupt}: {corrupt}/adapter_model.safetensors: "
            f"cannot be read") in stderr
    assert "Traceback" not in stderr and "ready: serving" not in stderr


def test_lora_flags_are_checked_before_the_model_loads(adapters: dict[str, Path]) -> None:
    alpha = f"alpha={adapters['alpha']}"
    for args, words in [
        (["--lora-modules", alpha], "--lora-modules needs --enable-lora"),
        (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "alpha"], "expected name=path or a JSON object"),
        (["--enable-lora", "--lora-modules", '{"name": "a"'], "invalid JSON in --lora-modules"),
        (["--enable-lora", "--lora-modules", '{"name": "a", "paht": "/x"}'],
         "unknown field(s) paht"),
        (["--enable-lora", "--lora-modules", alpha, "beta=/nonexistent"],
         "--lora-modules beta=/nonexistent: no LoRA adapter directory at '/nonexistent'"),
    ]:
        start = time.monotonic()
        proc = _serve(*args)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 2 and words in stderr, (args, stderr)
        assert time.monotonic() - start < 20  # argparse's error, not the model's load
