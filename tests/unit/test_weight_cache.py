"""The start-up cache (aioengine/model/weight_cache.py): where it lives, entries written whole
or not at all, damaged entries found and removed, tensors read back bit for bit; and the
KV cache allocated without writing a page (make_kv_caches)."""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
import torch

from aioengine.model import weight_cache
from aioengine.model.arch import ModelArchConfig
from aioengine.model.llama import make_kv_caches


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(weight_cache.CACHE_DIR_ENV, str(root))
    return root


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(weight_cache.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weight_cache.cache_root() == tmp_path / "xdg" / "aioengine"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert weight_cache.cache_root() == Path(os.path.expanduser("~")) / ".cache" / "aioengine"
    monkeypatch.setenv(weight_cache.CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert weight_cache.cache_root() == tmp_path / "mine"


def test_every_cache_follows_envs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench's HF exports live under the start-up cache's root; the compiled kernels under
    the user's cache whatever $AIOENGINE_CACHE_DIR says (a fresh one does not rebuild them)."""
    from aioengine.bench import hf_export
    from aioengine.kernels import cpu_build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(weight_cache.CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert hf_export.cache_root() == tmp_path / "mine" / "hf-export"
    assert Path(cpu_build._cache_dir()) == tmp_path / "xdg" / "aioengine" / "kernels"
    monkeypatch.delenv(weight_cache.CACHE_DIR_ENV)
    assert hf_export.cache_root() == tmp_path / "xdg" / "aioengine" / "hf-export"
    assert Path(cpu_build._cache_dir()) == tmp_path / "xdg" / "aioengine" / "kernels"


def test_entry_names_follow_content_and_kind(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"same bytes")
    b.write_bytes(b"same bytes")
    da, db = weight_cache.file_digest(str(a)), weight_cache.file_digest(str(b))
    assert da == db  # a copy elsewhere shares the entry
    assert weight_cache.entry_name(da, "x") != weight_cache.entry_name(da, "y")
    a.write_bytes(b"other bytes")  # edited in place: another size, so another digest
    assert weight_cache.file_digest(str(a)) != da


def test_a_digest_is_remembered_across_processes_until_the_file_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(weight_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"first")
    assert weight_cache.file_digest(str(model))  # just written: not remembered on disk
    assert not (tmp_path / "cache" / "digests").exists()
    weight_cache._digest_memo.clear()
    monkeypatch.setattr(weight_cache, "_SETTLE_S", -1.0)  # as if written long ago
    first = weight_cache.file_digest(str(model))
    weight_cache._digest_memo.clear()  # as a new process starts
    memo, = (tmp_path / "cache" / "digests").iterdir()
    memo.write_text("0" * 64)  # what a remembered digest is read from: no hashing
    assert weight_cache.file_digest(str(model)) == "0" * 64
    weight_cache._digest_memo.clear()
    time.sleep(0.05)  # past the timestamp tick
    with open(model, "r+b") as f:  # same size: its ctime moves
        f.write(b"FIRST")
    assert weight_cache.file_digest(str(model)) not in (first, "0" * 64)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w/a": torch.randn(7, 5, generator=g), "w/b": torch.randn(3, generator=g),
            "q/c": torch.randint(0, 255, (4, 20), generator=g, dtype=torch.uint8),
            "h": torch.randn(2, 3, generator=g).to(torch.bfloat16)}


def _store(name: str = "e") -> Path:
    entry = weight_cache.store("weights", name, "test", lambda tmp: weight_cache.save_tensors(
        tmp, _tensors(), {"k": "v"}))
    assert entry is not None
    return entry


def test_tensors_round_trip(cache_dir: Path) -> None:
    entry = _store()
    assert weight_cache.lookup("weights", "e") == entry
    assert weight_cache.read_metadata(entry) == {"k": "v"}
    want = _tensors()
    got = dict(weight_cache.iter_tensors(entry, "w/"))
    assert set(got) == {"a", "b"}
    for name, t in got.items():
        assert t.dtype == want["w/" + name].dtype and torch.equal(t, want["w/" + name])
    (_, h), = weight_cache.iter_tensors(entry, "h")
    assert h.dtype == torch.bfloat16 and torch.equal(h, want["h"])


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest", "remove"])
def test_damaged_entry_is_found_and_removed(cache_dir: Path, damage: str) -> None:
    entry = _store()
    data = entry / weight_cache.TENSORS_FILE
    if damage == "flip":  # same size, one bit off
        raw = bytearray(data.read_bytes())
        raw[-3] ^= 0x10
        data.write_bytes(bytes(raw))
    elif damage == "truncate":  # a partial write
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "manifest":
        (entry / weight_cache.MANIFEST).write_text("{not json")
    else:
        data.unlink()
    assert weight_cache.lookup("weights", "e") is None
    assert not entry.exists()
    assert _store() == entry  # rebuilt in its place
    assert weight_cache.lookup("weights", "e") == entry


def test_failed_write_leaves_nothing(cache_dir: Path) -> None:
    def write(tmp: Path) -> None:
        (tmp / "half").write_bytes(b"x" * 100)
        raise OSError("disk full")

    assert weight_cache.store("weights", "e", "test", write) is None
    assert list((cache_dir / "weights").iterdir()) == []  # no entry, no temporary directory
    assert weight_cache.lookup("weights", "e") is None


def test_second_store_keeps_the_first(cache_dir: Path) -> None:
    entry = _store()
    before = (entry / weight_cache.TENSORS_FILE).stat().st_mtime_ns
    assert _store() == entry  # a second process that lost the race
    assert (entry / weight_cache.TENSORS_FILE).stat().st_mtime_ns == before
    assert sorted(p.name for p in (cache_dir / "weights").iterdir()) == ["e"]


def test_the_least_recently_used_entries_go(cache_dir: Path) -> None:
    """At most MAX_ENTRIES per section: adding one removes the least recently used, and a
    lookup counts as a use."""
    names = [f"e{i}" for i in range(weight_cache.MAX_ENTRIES)]
    for i, name in enumerate(names):
        os.utime(_store(name), (1000 + i, 1000 + i))
    assert weight_cache.lookup("weights", "e0") is not None  # e0 is now the newest
    _store("new")
    kept = sorted(p.name for p in (cache_dir / "weights").iterdir())
    assert kept == sorted(["e0", "new", *names[2:]])  # e1, the oldest, is gone


def _arch(layers: int) -> ModelArchConfig:
    return ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
        tie_word_embeddings=True, attention_bias=False, qk_norm=False, bos_token_id=None,
        eos_token_ids=[])


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux only")
def test_kv_cache_is_zero_without_being_written(monkeypatch) -> None:
    """The CPU KV cache reads as zeros everywhere (padded reads of slots no request wrote
    must not meet a NaN), yet allocating it writes no page: 4 layers x 32 MiB leave the
    resident memory where it was. Memory freed just before, full of NaNs, is not reused."""
    monkeypatch.delenv("AIOENGINE_CPU_KV_PREFAULT", raising=False)
    junk = [torch.full((8 << 20,), float("nan")) for _ in range(4)]
    del junk
    arch = _arch(4)
    num_blocks, block_size = 8192, 16  # 2 x 8192 x 16 x 2 x 16 floats = 32 MiB a layer
    before = _rss()
    caches = make_kv_caches(arch, num_blocks, block_size, torch.float32, torch.device("cpu"))
    grown = _rss() - before
    nbytes = sum(c.numel() * c.element_size() for c in caches)
    assert nbytes == (4 * 32) << 20
    assert grown < nbytes // 8, f"allocating the KV cache made {grown >> 20} MiB resident"
    for cache in caches:
        assert cache.shape == (2, num_blocks, block_size, 2, 16)
        assert torch.count_nonzero(cache) == 0 and not torch.isnan(cache).any()
    # A small cache (below hugepages.MIN_BYTES) comes from malloc, so it is zeroed.
    small = make_kv_caches(arch, 2, block_size, torch.float32, torch.device("cpu"))
    assert all(torch.count_nonzero(c) == 0 for c in small)
    assert math.prod(small[0].shape) * 4 < 1 << 20


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux only")
def test_kv_prefault_makes_the_cache_resident_at_once(monkeypatch) -> None:
    """AIOENGINE_CPU_KV_PREFAULT=1: every page written at start-up, so no step pays for a
    fresh page's first touch; the cache still reads as zeros."""
    monkeypatch.setenv("AIOENGINE_CPU_KV_PREFAULT", "1")
    before = _rss()
    caches = make_kv_caches(_arch(4), 8192, 16, torch.float32, torch.device("cpu"))
    nbytes = sum(c.numel() * c.element_size() for c in caches)
    assert _rss() - before >= nbytes * 7 // 8
    assert all(torch.count_nonzero(c) == 0 for c in caches)
