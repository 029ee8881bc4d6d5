"""Prefix-cache block hashes (--prefix-caching-hash-algo): a stable byte encoding, chaining
over parent and extra keys, digests equal across processes, the builtin hash's collisions,
the setting's validation, and prefix hits under every algorithm."""
from __future__ import annotations

import argparse
import hashlib
import os
import struct
import subprocess
import sys

import pytest

from aioengine.config import ConfigError, EngineArgs, add_engine_args, engine_kwargs
from aioengine.kv.block_pool import (DEFAULT_PREFIX_CACHING_HASH_ALGO,
                                       PREFIX_CACHING_HASH_ALGOS, builtin_block_hash,
                                       get_block_hasher, hash_block_tokens, sha256_block_hash,
                                       xxhash_block_hash)
from aioengine.kv.kv_cache_manager import KVCacheManager

from test_kv_cache_manager import BS, admit, make_request  # tests/unit is on sys.path

DIGEST_SIZES = {"sha256": 32, "xxhash": 16, "builtin": 8}
# Token ids and salts of a three-block chain, hashed in this process and in others.
CHAIN = ([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], ("lora", 3))
CHAIN_SCRIPT = """
import sys
from aioengine.kv.block_pool import get_block_hasher
blocks, salt = {chain!r}
for algo in sys.argv[1:]:
    parent = None
    for tokens in blocks:
        parent = get_block_hasher(algo)(parent, tokens, salt)
        print(algo, parent.hex())
"""


def chain_digests(algos: tuple[str, ...]) -> list[str]:
    blocks, salt = CHAIN
    out = []
    for algo in algos:
        parent = None
        for tokens in blocks:
            parent = get_block_hasher(algo)(parent, tokens, salt)
            out.append(f"{algo} {parent.hex()}")
    return out


def test_default_is_sha256_everywhere() -> None:
    assert DEFAULT_PREFIX_CACHING_HASH_ALGO == "sha256"
    assert EngineArgs().prefix_caching_hash_algo == DEFAULT_PREFIX_CACHING_HASH_ALGO
    assert KVCacheManager(4, BS).hash_algo == DEFAULT_PREFIX_CACHING_HASH_ALGO
    assert hash_block_tokens(None, [1, 2], None) == sha256_block_hash(None, [1, 2], None)


def test_sha256_digests_the_documented_encoding() -> None:
    # root tag, uint32 count, int64 tokens (little-endian), then the extra keys' encoding.
    root = hashlib.sha256(b"\x00" + struct.pack("<I2q", 2, 1, 2) + b"N").digest()
    assert sha256_block_hash(None, [1, 2], None) == root
    salt = b"t" + struct.pack("<I", 2) + b"s" + struct.pack("<I", 4) + b"lora" + b"i\x01\x00\x07"
    child = hashlib.sha256(b"\x01" + root + struct.pack("<I1q", 1, 3) + salt).digest()
    assert sha256_block_hash(root, [3], ("lora", 7)) == child


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_digests_are_equal_across_processes(algo: str) -> None:
    """Unlike hash(), the digests do not depend on PYTHONHASHSEED (or the process)."""
    here = chain_digests((algo,))
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        there = subprocess.run(
            [sys.executable, "-c", CHAIN_SCRIPT.format(chain=CHAIN), algo], env=env,
            capture_output=True, text=True, check=True, timeout=60).stdout.split("\n")
        assert there[:-1] == here, f"PYTHONHASHSEED={seed}"


@pytest.mark.parametrize("algo", PREFIX_CACHING_HASH_ALGOS)
def test_hash_chains_over_parent_tokens_and_extra_keys(algo: str) -> None:
    h = get_block_hasher(algo)
    root = h(None, [1, 2, 3, 4], None)
    assert isinstance(root, bytes) and len(root) == DIGEST_SIZES[algo]
    assert root == h(None, (1, 2, 3, 4), None)  # any sequence of ints
    assert root != h(None, [4, 3, 2, 1], None)
    other = h(None, [9, 9, 9, 9], None)
    # Same tokens under different parents (or none) are different blocks.
    assert len({h(root, [5, 6], None), h(other, [5, 6], None), h(None, [5, 6], None)}) == 3
    salts = [None, ("lora", 1), ("lora", 2), ("lora", "1"), ("lora", (1,)), (("lora", 1),),
             ("lo", "ra", 1)]
    if algo != "builtin":  # CPython's hash("1") == hash(b"1"): one more builtin collision
        salts.append(("lora", b"1"))
    assert len({h(root, [5, 6], s) for s in salts}) == len(salts)
    assert h(root, [5, 6], ("lora", 1)) == h(root, [5, 6], ("lora", 1))


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_encoding_keeps_field_boundaries(algo: str) -> None:
    h = get_block_hasher(algo)
    assert h(None, [1, 2], None) != h(None, [1], (2,))
    assert h(None, [1], ("ab",)) != h(None, [1], ("a", "b"))
    assert h(None, [1], (-1,)) != h(None, [1], (255,))
    assert h(None, [2**40], None) != h(None, [0], None)  # ids wider than int32


def test_unsupported_extra_keys_are_refused() -> None:
    """Only types with a process-independent encoding may salt a hash."""
    with pytest.raises(TypeError, match="not supported"):
        sha256_block_hash(None, [1], ("lora", object()))
    with pytest.raises(TypeError, match="not supported"):
        xxhash_block_hash(None, [1], (0.5,))


def test_builtin_hash_collides_where_sha256_and_xxhash_do_not() -> None:
    """CPython's hash(-1) == hash(-2) (-1 is its error code), and a tuple's hash is a fixed
    mix of its items' unrandomised 64-bit int hashes, so these two blocks collide under
    builtin. Real token ids are non-negative, so this pair cannot come from a prompt, but
    the same structure lets a 2^32 birthday search (or algebra on the tuple-hash mix)
    produce colliding non-negative prompts: builtin is opt-in, for one trusted tenant."""
    assert hash(-1) == hash(-2)
    a, b = [7, -1, 8], [7, -2, 8]
    assert builtin_block_hash(None, a, None) == builtin_block_hash(None, b, None)
    assert sha256_block_hash(None, a, None) != sha256_block_hash(None, b, None)
    assert xxhash_block_hash(None, a, None) != xxhash_block_hash(None, b, None)


@pytest.mark.parametrize("algo,leaks", [("builtin", True), ("sha256", False),
                                        ("xxhash", False)])
def test_a_colliding_prompt_reads_foreign_kv_only_under_builtin(algo: str, leaks: bool) -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, hash_algo=algo)
    victim = make_request("victim", [5, 6, -1, 7, 1])
    admit(mgr, victim)
    hits, num_hit = mgr.get_computed_blocks(make_request("attacker", [5, 6, -2, 7, 1]))
    assert num_hit == (BS if leaks else 0)
    assert hits == (mgr.get_blocks("victim")[:1] if leaks else [])


@pytest.mark.parametrize("algo", PREFIX_CACHING_HASH_ALGOS)
def test_prefix_cache_hits_with_each_algorithm(algo: str) -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS, hash_algo=algo)
    a = make_request("a", list(range(10)))
    admit(mgr, a)
    assert [len(h) for h in a.block_hashes] == [DIGEST_SIZES[algo]] * 2
    mgr.free(a)
    b = make_request("b", list(range(9)) + [99])
    assert admit(mgr, b) == [3]
    assert mgr.get_block_ids("b")[:2] == [0, 1] and b.num_computed_tokens == 10
    assert mgr.get_computed_blocks(make_request("s", list(range(10)), ("lora", 1))) == ([], 0)
    assert mgr.prefix_cache_hits == 8
    mgr.check_integrity()


def test_unknown_algorithm_is_refused_everywhere() -> None:
    with pytest.raises(ValueError, match="prefix_caching_hash_algo must be one of"):
        get_block_hasher("md5")
    with pytest.raises(ValueError, match="'md5'"):
        KVCacheManager(4, BS, hash_algo="md5")
    with pytest.raises(ConfigError, match=r"one of \['sha256', 'xxhash', 'builtin'\], got 'md5'"):
        EngineArgs(prefix_caching_hash_algo="md5").validate()
    for algo in PREFIX_CACHING_HASH_ALGOS:
        EngineArgs(prefix_caching_hash_algo=algo).validate()


def test_cli_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["prefix_caching_hash_algo"] == "sha256"
    for algo in PREFIX_CACHING_HASH_ALGOS:
        args = parser.parse_args(["--prefix-caching-hash-algo", algo])
        assert engine_kwargs(args)["prefix_caching_hash_algo"] == algo
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefix-caching-hash-algo", "md5"])
    assert "invalid choice: 'md5'" in capsys.readouterr().err
