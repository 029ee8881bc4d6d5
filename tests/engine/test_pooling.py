"""Pooling (embedding) requests through the engine: the vectors equal transformers' pooled
`hidden_states[-1]` of the same weights (fp32) for every pooling, and batching, chunked
prefill, preemption and prefix caching do not change them; pooling requests run alongside
generation without changing its tokens, and every KV block is released afterwards."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from aioengine import LLM, AsyncEngine, InvalidRequestError, SamplingParams
from aioengine.pooling_params import PoolingParams

from tests.engine.conftest import assert_blocks_released
from tests.tiny_models import make_tiny_model_dir

POOLINGS = ("last", "mean", "cls")


def hf_hidden(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' last hidden states (after the final norm) of each prompt, alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0]
                for p in prompts]


def pooled(hidden: torch.Tensor, pooling: str, normalize: bool = True) -> torch.Tensor:
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def vectors(llm: LLM, prompts, pooling: str, normalize: bool = True) -> list[torch.Tensor]:
    outs = llm.encode(prompts, PoolingParams(pooling, normalize), use_tqdm=False)
    assert all(o.outputs is not None and o.finish_reason == "stop" for o in outs)
    return [o.outputs.data for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, tiny_prompts: list[list[int]]) -> list[torch.Tensor]:
    return hf_hidden(tiny_llama_dir, tiny_prompts)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_every_pooling_matches_transformers(arch: str, tmp_path: Path,
                                            tiny_prompts: list[list[int]]) -> None:
    model_dir = make_tiny_model_dir(arch, tmp_path / arch, seed=5)
    llm = LLM(str(model_dir), dtype="float32", block_size=16, num_kv_blocks=64)
    hidden = hf_hidden(model_dir, tiny_prompts)
    for pooling in POOLINGS:
        for normalize in (True, False):
            got = vectors(llm, tiny_prompts, pooling, normalize)
            for g, h in zip(got, hidden):
                assert g.dtype == torch.float32 and g.shape == (h.shape[1],)
                torch.testing.assert_close(g, pooled(h, pooling, normalize),
                                           atol=2e-5, rtol=1e-5)
    assert_blocks_released(llm.core)


@pytest.mark.parametrize("pooling", POOLINGS)
def test_batching_chunking_and_prefix_caching_do_not_change_the_vectors(
        pooling: str, tiny_llama_dir: Path, tiny_prompts: list[list[int]],
        reference: list[torch.Tensor]) -> None:
    alone_llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=16, num_kv_blocks=64,
                    enable_prefix_caching=False)
    alone = [vectors(alone_llm, [p], pooling)[0] for p in tiny_prompts]
    # Chunks of at most 16 tokens (several per prompt, some laid out as decode rows), the
    # whole batch at once, the prefix cache warm (the shared 40-token prefix, and the
    # second pass finds every full block cached).
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=16, num_kv_blocks=64,
              max_num_batched_tokens=16, long_prefill_token_threshold=16)
    for _ in range(2):
        batched = vectors(llm, tiny_prompts, pooling)
        for a, b, h in zip(alone, batched, reference):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(b, pooled(h, pooling), atol=2e-5, rtol=1e-5)
    stats = llm.stats()
    if pooling == "last":  # the only pooling that reads cached prefixes
        assert stats["prefix_cache_hits"] > 0
    assert_blocks_released(llm.core)


def test_preempted_pooling_requests_start_their_vectors_over(
        tiny_llama_dir: Path, tiny_prompts: list[list[int]],
        reference: list[torch.Tensor]) -> None:
    # 6 blocks of 16 for prompts of up to 70 tokens, four 16-token chunks a step: running
    # requests preempt each other for their next chunk's blocks.
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=16, num_kv_blocks=6,
              max_num_batched_tokens=64, long_prefill_token_threshold=16,
              enable_prefix_caching=False)
    got = vectors(llm, tiny_prompts, "mean")
    assert llm.stats()["num_preemptions"] > 0
    for g, h in zip(got, reference):
        torch.testing.assert_close(g, pooled(h, "mean"), atol=2e-5, rtol=1e-5)
    assert_blocks_released(llm.core)


def test_embed_and_score(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=16, num_kv_blocks=64)
    texts = ["the cat sat on the mat", "a dog in the park", "stock markets fell today"]
    embs = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts, pooling="mean")]
    scores = [s.outputs.score for s in llm.score(texts[0], texts, pooling="mean")]
    expected = [float(embs[0].double() @ e.double()) for e in embs]
    assert scores == pytest.approx(expected, abs=1e-6)
    assert scores[0] == pytest.approx(1.0, abs=1e-6)
    pairwise = llm.score(texts, texts[::-1], pooling="mean")
    assert [s.outputs.score for s in pairwise] == pytest.approx(
        [float(a.double() @ b.double()) for a, b in zip(embs, embs[::-1])], abs=1e-6)
    with pytest.raises(InvalidRequestError):
        llm.score(texts[:2], texts)


def test_bad_pooling_requests_are_refused(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=16, num_kv_blocks=64,
              max_model_len=64)
    with pytest.raises(InvalidRequestError, match="pooling"):
        llm.embed("hello", pooling="max")
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.encode([[]])
    with pytest.raises(InvalidRequestError, match="context length"):
        llm.encode([[5] * 65])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.encode([[10**9]])
    # A prompt may fill the whole context: nothing is generated after it.
    assert llm.encode([[5] * 64])[0].outputs is not None
    assert_blocks_released(llm.core)


async def generate_id(engine: AsyncEngine, prompt: list[int], params: SamplingParams,
                      request_id: str) -> None:
    async for _ in engine.generate(prompt, params, request_id=request_id):
        pass


async def test_pooling_runs_alongside_generation(tiny_llama_dir: Path,
                                                 tiny_prompts: list[list[int]],
                                                 tiny_reference: list[list[int]],
                                                 reference: list[torch.Tensor]) -> None:
    engine = await AsyncEngine.create(str(tiny_llama_dir), max_model_len=256, dtype="float32",
                                      max_num_batched_tokens=32)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

        async def generate(prompt: list[int]) -> list[int]:
            return [t async for out in engine.generate(prompt, params)
                    for t in out.outputs[0].token_ids]

        async def encode(prompt: list[int], pooling: str) -> torch.Tensor:
            outs = [o async for o in engine.encode(prompt, PoolingParams(pooling))]
            assert len(outs) == 1 and outs[0].finished and outs[0].outputs is not None
            return outs[0].outputs.data

        jobs = [generate(p) for p in tiny_prompts]
        jobs += [encode(p, pooling) for pooling in POOLINGS for p in tiny_prompts]
        results = await asyncio.gather(*jobs)
        n = len(tiny_prompts)
        assert results[:n] == tiny_reference
        for k, pooling in enumerate(POOLINGS):
            for got, h in zip(results[n * (k + 1):n * (k + 2)], reference):
                torch.testing.assert_close(got, pooled(h, pooling), atol=2e-5, rtol=1e-5)
        assert_blocks_released(engine.core)
        # Cancelled while queued or running: aborted, its blocks freed.
        task = asyncio.ensure_future(encode(tiny_prompts[3] * 3, "mean"))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert_blocks_released(engine.core)
        # An id an encode() in flight holds is refused to generate(), and the encode ends.
        held = engine.encode(tiny_prompts[3] * 3, PoolingParams("mean"), request_id="same")
        task = asyncio.ensure_future(held.__anext__())
        await asyncio.sleep(0)
        with pytest.raises(InvalidRequestError, match="already in use"):
            await generate_id(engine, tiny_prompts[0], params, "same")
        assert (await task).outputs is not None
        await held.aclose()
        assert_blocks_released(engine.core)
        with pytest.raises(InvalidRequestError):
            async for _ in engine.encode("hi", PoolingParams("mean")):
                pass
            async for _ in engine.encode([], PoolingParams("mean")):
                pass
    finally:
        await engine.shutdown()
