"""/v1/embeddings, /pooling, /score and /rerank on a real `aioengine serve` process with a
tiny random-weight Llama (fp32) and a PEFT adapter, driven by the real `openai` client and
LangChain's OpenAIEmbeddings: the vectors equal transformers' pooled `hidden_states[-1]`,
scores and rerank orders are the cosine similarities of those reference vectors, bad input
gets a 400 with an OpenAI error body, the API key is required, and every KV block is
free afterwards."""
from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import orjson
import pytest
import torch
from server_process import API_KEY, ServerProcess, openai_client, serving

from tests.lora_adapters import make_peft_adapter, peft_model
from tests.tiny_models import make_tiny_model_dir

TEXTS = ["The cat sat on the mat.", "A dog runs in the park with a red ball.",
         "Stock markets fell sharply today after the announcement.", "cats and dogs"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("embed") / "llama", seed=11)


@pytest.fixture(scope="module")
def adapter_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(model_dir, tmp_path_factory.mktemp("embed") / "ad", r=4,
                             target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def server(model_dir: Path, adapter_dir: Path) -> Iterator[ServerProcess]:
    # 16-token chunks: longer inputs are prefilled in several steps.
    yield from serving(str(model_dir), "--served-model-name", "tiny", "--dtype", "float32",
                       "--api-key", API_KEY, "--max-num-batched-tokens", "64",
                       "--long-prefill-token-threshold", "16", "--enable-lora",
                       "--lora-modules", f"ad={adapter_dir}")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, API_KEY)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def hidden_states(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


@pytest.fixture(scope="module")
def reference(model_dir: Path, adapter_dir: Path, tokenizer):
    """pooling -> {(text, adapter or None): transformers' pooled vector (normalised)}, and
    the raw (unnormalised) vectors under "raw-<pooling>"."""
    models = {None: peft_model(model_dir, None), "ad": peft_model(model_dir, adapter_dir)}
    out: dict[str, dict] = {}
    for name, model in models.items():
        for text in TEXTS:
            h = hidden_states(model, tokenizer.encode(text))
            for pooling, v in (("last", h[-1]), ("mean", h.mean(0)), ("cls", h[0])):
                out.setdefault(f"raw-{pooling}", {})[(text, name)] = v
                out.setdefault(pooling, {})[(text, name)] = torch.nn.functional.normalize(
                    v, dim=-1)
    return out


def close(got, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want,
                               atol=3e-5, rtol=1e-5)


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def post(server: ServerProcess, path: str, body: dict, auth: bool = True) -> tuple[int, dict]:
    status, raw = server.request("POST", path, body, headers=AUTH if auth else None)
    return status, orjson.loads(raw)


def test_openai_client_float_and_base64(client: openai.OpenAI, reference, tokenizer) -> None:
    resp = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in resp.data] == list(range(len(TEXTS)))
    for text, d in zip(TEXTS, resp.data):
        close(d.embedding, reference["last"][(text, None)])
    num_tokens = sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (num_tokens, num_tokens)
    assert resp.model == "tiny"
    # The client's default asks for base64 and decodes it itself.
    default = client.embeddings.create(model="tiny", input=TEXTS[0])
    close(default.data[0].embedding, reference["last"][(TEXTS[0], None)])
    raw = client.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    close(decoded.tolist(), reference["last"][(TEXTS[1], None)])


def test_token_id_inputs_pooling_override_and_adapter(client: openai.OpenAI, reference,
                                                      tokenizer) -> None:
    ids = [tokenizer.encode(t) for t in TEXTS]
    one = client.embeddings.create(model="tiny", input=ids[0], encoding_format="float")
    close(one.data[0].embedding, reference["last"][(TEXTS[0], None)])
    for pooling in ("mean", "cls"):
        many = client.embeddings.create(model="tiny", input=ids, encoding_format="float",
                                        extra_body={"pooling_type": pooling})
        for text, d in zip(TEXTS, many.data):
            close(d.embedding, reference[pooling][(text, None)])
    adapted = client.embeddings.create(model="ad", input=TEXTS, encoding_format="float")
    assert adapted.model == "ad"
    for text, d in zip(TEXTS, adapted.data):
        close(d.embedding, reference["last"][(text, "ad")])
    # The model's own size is accepted as `dimensions` (nothing to truncate).
    full = client.embeddings.create(model="tiny", input="x", dimensions=64,
                                    encoding_format="float")
    assert len(full.data[0].embedding) == 64


def test_langchain_openai_embeddings(server: ServerProcess, reference) -> None:
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model="tiny", base_url=server.base_url, api_key=API_KEY,
                                  check_embedding_ctx_length=False, tiktoken_enabled=False,
                                  max_retries=0)
    docs = embeddings.embed_documents(TEXTS)
    for text, vector in zip(TEXTS, docs):
        close(vector, reference["last"][(text, None)])
    close(embeddings.embed_query(TEXTS[2]), reference["last"][(TEXTS[2], None)])


def test_pooling_route_returns_raw_vectors(server: ServerProcess, reference) -> None:
    status, body = post(server, "/pooling", {"model": "tiny", "input": TEXTS,
                                             "pooling_type": "mean"})
    assert status == 200, body
    assert body["object"] == "list" and body["id"].startswith("pool-")
    for text, d in zip(TEXTS, body["data"]):
        assert d["object"] == "pooling"
        close(d["data"], reference["raw-mean"][(text, None)])
    status, body = post(server, "/pooling", {"input": TEXTS[0], "normalize": True})
    close(body["data"][0]["data"], reference["last"][(TEXTS[0], None)])


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_is_the_cosine_of_the_reference_embeddings(server: ServerProcess, reference,
                                                         path: str) -> None:
    ref = reference["last"]
    status, body = post(server, path, {"model": "tiny", "text_1": TEXTS[0], "text_2": TEXTS})
    assert status == 200, body
    scores = [d["score"] for d in body["data"]]
    assert scores == pytest.approx([cos(ref[(TEXTS[0], None)], ref[(t, None)])
                                    for t in TEXTS], abs=1e-5)
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    status, body = post(server, path, {"text_1": TEXTS[:2], "text_2": TEXTS[2:],
                                       "pooling_type": "mean"})
    ref = reference["mean"]
    assert [d["score"] for d in body["data"]] == pytest.approx(
        [cos(ref[(a, None)], ref[(b, None)]) for a, b in zip(TEXTS[:2], TEXTS[2:])], abs=1e-5)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_rerank_orders_documents_by_reference_similarity(server: ServerProcess, reference,
                                                         path: str) -> None:
    ref = reference["last"]
    query, docs = TEXTS[3], TEXTS[:3]
    want = sorted(range(3), key=lambda i: -cos(ref[(query, None)], ref[(docs[i], None)]))
    status, body = post(server, path, {"model": "tiny", "query": query, "documents": docs})
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == want
    assert [r["document"]["text"] for r in body["results"]] == [docs[i] for i in want]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
        [cos(ref[(query, None)], ref[(docs[i], None)]) for i in want], abs=1e-5)
    assert body["usage"]["total_tokens"] > 0
    status, body = post(server, path, {"query": query, "documents": [{"text": d} for d in docs],
                                       "top_n": 2, "return_documents": False})
    assert [r["index"] for r in body["results"]] == want[:2]
    assert all("document" not in r for r in body["results"])


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ["ok", ""]}, "input"),
    ("/v1/embeddings", {"input": 5}, "input"),
    ("/v1/embeddings", {"input": [1.5, 2]}, "input"),
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": "hello " * 600}, "input"),
    ("/v1/embeddings", {"input": [[1] * 513]}, "input"),
    ("/v1/embeddings", {"input": [10 ** 9]}, "input"),
    ("/v1/embeddings", {"input": "x", "pooling_type": "max"}, "pooling_type"),
    ("/v1/embeddings", {"input": "x", "pooling_type": 3}, "pooling_type"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "dimensions": 16}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "normalize": "yes"}, "normalize"),
    ("/pooling", {"input": [[]]}, "input"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/score", {"text_1": "a"}, "text_2"),
    ("/score", {"text_1": 3, "text_2": "b"}, "text_1"),
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a", 4]}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
])
def test_bad_input_is_a_400_with_an_openai_error_body(server: ServerProcess, path: str,
                                                      body: dict, param: str) -> None:
    status, err = post(server, path, body)
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["param"] == param, err
    assert err["error"]["message"]


def test_unknown_model_is_a_404_and_the_key_is_required(server: ServerProcess) -> None:
    status, err = post(server, "/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404 and err["error"]["message"]
    for path in ("/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank"):
        status, err = post(server, path, {"input": "x", "text_1": "a", "text_2": "b",
                                          "query": "q", "documents": ["d"]}, auth=False)
        assert status == 401 and err["error"]["code"] == "invalid_api_key", path


def test_every_block_is_free_afterwards(server: ServerProcess) -> None:
    m = server.wait_idle()
    assert m["aioengine:num_requests_running"] == 0
    assert m["aioengine:kv_cache_usage_perc"] == 0


def test_pooling_flag_sets_the_default(model_dir: Path, reference) -> None:
    srv = next(serving(str(model_dir), "--served-model-name", "tiny", "--dtype", "float32",
                       "--pooling", "cls"))
    try:
        status, body = post(srv, "/v1/embeddings", {"input": TEXTS[1]}, auth=False)
        assert status == 200, body
        close(body["data"][0]["embedding"], reference["cls"][(TEXTS[1], None)])
    finally:
        srv.stop_cleanly()
