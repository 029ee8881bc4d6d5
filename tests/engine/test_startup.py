"""Start-up (issue 27): a real engine on the bundled GGUF built twice reads the second time
what the first computed (weights, config, tokenizer: nothing parsed), with the same
logprobs; a damaged or partly written cache file is found and rebuilt; and the CPU KV cache
is sized to the model and the memory available, or by the AIOENGINE_CPU_KVCACHE_SPACE
override."""
from __future__ import annotations

import gc
import logging
from pathlib import Path

import pytest

from aioengine import LLM, SamplingParams
from aioengine.config import ConfigError
from aioengine.model import weight_cache
from aioengine.model.llama import kv_cache_bytes_per_block
from aioengine.worker import gpu_memory

PROMPT = "The capital of France is"
SMALL = dict(max_model_len=256, max_num_batched_tokens=32, num_kv_blocks=32, max_num_seqs=4)


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(weight_cache.CACHE_DIR_ENV, str(root))
    return root


def _run(caplog: pytest.LogCaptureFixture) -> tuple[tuple, str, list[str]]:
    """A fresh engine's greedy tokens with their top-20 logprobs (and the prompt's), its
    tokenizer's serialization, and what the loader logged."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="aioengine"):
        llm = LLM(**SMALL)
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=20,
                                                  prompt_logprobs=20, ignore_eos=True))[0]
    tokenizer = llm.tokenizer.backend_tokenizer.to_str()
    sample = out.outputs[0]
    result = (sample.token_ids, sample.logprobs, out.prompt_logprobs)
    messages = [r.getMessage() for r in caplog.records]
    del llm, out
    gc.collect()
    return result, tokenizer, messages


def _entries(root: Path, section: str) -> list[Path]:
    return [p for p in (root / section).iterdir() if not p.name.startswith(".")]


def test_second_start_reads_the_cache(cache_dir: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    cold, cold_tok, logs = _run(caplog)
    assert any("computed and written to the start-up cache" in m for m in logs)
    (weights,) = _entries(cache_dir, "weights")
    (tokenizer,) = _entries(cache_dir, "tokenizer")

    warm, warm_tok, logs = _run(caplog)
    assert any("GGUF config read from the start-up cache" in m for m in logs)
    assert any("GGUF weights read from the start-up cache" in m for m in logs)
    assert any("tokenizer read from the start-up cache" in m for m in logs)
    assert warm == cold and warm_tok == cold_tok  # bit-identical logprobs, same tokenizer

    # One bit of the weights off (same size) and a tokenizer file cut short (a partial
    # write): both found, rebuilt, and the engine answers as before.
    data = weights / weight_cache.TENSORS_FILE
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    tok_json = tokenizer / "tokenizer.json"
    tok_json.write_bytes(tok_json.read_bytes()[:1000])
    again, again_tok, logs = _run(caplog)
    damaged = [m for m in logs if "damaged, rebuilding" in m]
    assert len(damaged) == 2, logs
    assert any("computed and written to the start-up cache" in m for m in logs)
    assert again == cold and again_tok == cold_tok
    assert weight_cache.lookup("weights", weights.name) == weights
    assert weight_cache.lookup("tokenizer", tokenizer.name) == tokenizer


def test_cpu_kv_cache_space(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sized to the model: the least of half of MemAvailable, the cap and what the requests
    can use; the environment's explicit GiB win; bad values are refused."""
    monkeypatch.delenv(gpu_memory.CPU_KVCACHE_SPACE_ENV, raising=False)
    available = gpu_memory.mem_available()
    assert available > 0
    few, reason = gpu_memory.cpu_kv_cache_memory(1000, 64)
    assert few == 64_000 and reason.endswith("max_num_seqs x max_model_len")
    many, reason = gpu_memory.cpu_kv_cache_memory(1 << 20, 1 << 30)
    cap = int(gpu_memory.CPU_KV_CAP_GIB * 2**30)
    assert 0 < many <= min(cap, available)  # MemAvailable moves: not an exact value
    assert reason.endswith("of MemAvailable") == (many < cap)
    monkeypatch.setenv(gpu_memory.CPU_KVCACHE_SPACE_ENV, "0.25")
    assert gpu_memory.cpu_kv_cache_memory(1000, 64)[0] == 2**28
    for bad in ("0", "-1", "lots", "inf", "nan"):
        monkeypatch.setenv(gpu_memory.CPU_KVCACHE_SPACE_ENV, bad)
        with pytest.raises(ConfigError, match="AIOENGINE_CPU_KVCACHE_SPACE"):
            gpu_memory.cpu_kv_cache_memory(1000, 64)


def test_engine_sizes_kv_to_the_model(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """Without a space set, a small max_num_seqs x max_model_len is what the pool holds
    (the bundled model needs far less than half of the memory), logged with its bytes per
    token."""
    monkeypatch.delenv(gpu_memory.CPU_KVCACHE_SPACE_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="aioengine"):
        llm = LLM(max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4)
    assert llm.num_kv_blocks == 4 * 256 // 16
    arch = llm.core.loaded.arch
    per_token = (arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim
                 * llm.core.kv_cache_dtype.itemsize)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert f"({per_token} bytes/token" in line and "MemAvailable" in line, line


def test_engine_sizes_kv_by_the_space(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 MiB of KV space: its blocks of the bundled model, not the old quarter of free
    memory up to 4 GiB (5,825 blocks on a 24 GiB machine)."""
    monkeypatch.setenv(gpu_memory.CPU_KVCACHE_SPACE_ENV, str(64 / 1024))
    llm = LLM(max_model_len=256, max_num_batched_tokens=32, max_num_seqs=64)
    per_block = kv_cache_bytes_per_block(llm.core.loaded.arch, 16, llm.core.kv_cache_dtype)
    assert llm.num_kv_blocks == (64 << 20) // per_block
    # The CPU warm-up runs only the 128 tokens that pay (ModelRunner.warm_up).
    assert llm.core.runner.warm_up(512, 256) == 128
