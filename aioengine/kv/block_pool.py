"""Physical KV cache blocks: reference counts, the LRU free queue and the prefix-cache map.

A block is in exactly one of three states:

    in use          ref_cnt > 0, not in the free queue (its hash, if any, stays cached)
    free + cached   ref_cnt == 0, in the free queue, block_hash set and in the cache map
    free            ref_cnt == 0, in the free queue, no hash

Blocks are allocated from the HEAD of the free queue and released to its TAIL, so the
queue is the eviction order: a cached block loses its hash only when it is popped for
reuse, and a cache hit on a free cached block pulls it out of the middle in O(1).
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import xxhash

# A block's chained digest: 32 bytes (sha256), 16 (xxhash) or 8 (builtin). Bytes, so it
# is a plain dict key whatever the algorithm.
BlockHash = bytes
BlockHasher = Callable[[BlockHash | None, Sequence[int], tuple | None], BlockHash]

# vLLM's --prefix-caching-hash-algo names. sha256 is the default: the cache is shared
# between tenants, so a collision an attacker can craft is a cross-request KV leak, and
# sha256 costs ~1 us per 16-token block, nothing next to a prefill (docs/architecture.md).
PREFIX_CACHING_HASH_ALGOS = ("sha256", "xxhash", "builtin")
DEFAULT_PREFIX_CACHING_HASH_ALGO = "sha256"


def _block_bytes(parent_hash: BlockHash | None, token_ids: Sequence[int],
                 extra_keys: tuple | None) -> bytes:
    """An injective, process-independent encoding of one block's hash input: a root/child
    tag, the parent digest (fixed length per algorithm), the token count and the tokens as
    little-endian uint32 / int64s (the same bytes on every machine), then the
    self-delimiting encoding of extra_keys."""
    parent = b"\x00" if parent_hash is None else b"\x01" + parent_hash
    n = len(token_ids)
    return parent + _tokens_struct(n).pack(n, *token_ids) + _encode_extra_keys(extra_keys)


@lru_cache(maxsize=64)
def _tokens_struct(num_tokens: int) -> struct.Struct:
    # Only full blocks are hashed, so one size in practice; a precompiled Struct packs a
    # block faster than array("q").tobytes() (~0.2 vs ~0.35 us) and fixes the byte order.
    return struct.Struct(f"<I{num_tokens}q")


@lru_cache(maxsize=1024)
def _encode_extra_keys(key: object) -> bytes:
    """Type-tagged, length-prefixed bytes of None / int / str / bytes / nested tuples.
    Cached: every block of a request carries the same salt (the cache keys by ==, which
    for these types agrees with the encoding: True and 1 encode alike). Other types, e.g.
    objects whose repr or pickle may vary between processes, are refused."""
    if key is None:
        return b"N"
    if isinstance(key, int):
        raw = key.to_bytes((key.bit_length() + 8) // 8, "little", signed=True)
        return b"i" + len(raw).to_bytes(2, "little") + raw
    if isinstance(key, str):
        key = key.encode()
        tag = b"s"
    elif isinstance(key, bytes):
        tag = b"b"
    elif isinstance(key, tuple):
        return b"t" + len(key).to_bytes(4, "little") + b"".join(map(_encode_extra_keys, key))
    else:
        raise TypeError(f"prefix-cache extra key of type {type(key).__name__} is not "
                        f"supported (use None, int, str, bytes or tuples of them)")
    return tag + len(key).to_bytes(4, "little") + key


def sha256_block_hash(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None) -> BlockHash:
    return hashlib.sha256(_block_bytes(parent_hash, token_ids, extra_keys)).digest()


def xxhash_block_hash(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None) -> BlockHash:
    """xxh3_128: 128 bits, so no accidental collisions, but not cryptographic (xxHash
    makes no claim against crafted collisions): for a cache only trusted clients share."""
    return xxhash.xxh3_128_digest(_block_bytes(parent_hash, token_ids, extra_keys))


def builtin_block_hash(parent_hash: BlockHash | None, token_ids: Sequence[int],
                       extra_keys: tuple | None) -> BlockHash:
    """Python's hash(): 64 bits and trivially collidable (hash(-1) == hash(-2)); opt-in
    only, for a single trusted tenant."""
    return hash((parent_hash, tuple(token_ids), extra_keys)).to_bytes(8, "little", signed=True)


_BLOCK_HASHERS: dict[str, BlockHasher] = {
    "sha256": sha256_block_hash, "xxhash": xxhash_block_hash, "builtin": builtin_block_hash,
}


def get_block_hasher(algo: str) -> BlockHasher:
    """The block hash function named by --prefix-caching-hash-algo."""
    try:
        return _BLOCK_HASHERS[algo]
    except KeyError:
        raise ValueError(f"prefix_caching_hash_algo must be one of "
                         f"{list(PREFIX_CACHING_HASH_ALGOS)}, got {algo!r}") from None


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None,
                      algo: str = DEFAULT_PREFIX_CACHING_HASH_ALGO) -> BlockHash:
    """Chained hash of one full block: since it folds in the parent block's hash, equal
    hashes mean equal whole prefixes (up to collisions of `algo`), so one lookup per block
    suffices. `extra_keys` (LoRA id, cache salt, ...) keeps otherwise equal prefixes apart."""
    return get_block_hasher(algo)(parent_hash, token_ids, extra_keys)


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block. Identity semantics (eq=False): two blocks are never "equal"."""

    block_id: int
    ref_cnt: int = 0
    # Set only while the block is full and registered in the pool's cache map.
    block_hash: BlockHash | None = None
    # Free-queue links; both None exactly when the block is not in the queue.
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)


# The table entry of a block that fell out of a sliding window (kv_cache_manager.py): block
# id 0 for the kernels (they read it masked out; every block's contents are finite), owned
# by no pool, never freed.
NULL_BLOCK = KVCacheBlock(block_id=0)


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    Two sentinels (`_head`, `_tail`, block_id -1) remove every empty/end special case;
    every operation except `get_all_free_blocks` is O(1) per block.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks to pop")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head (next to be evicted) to tail (most recently freed)."""
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out

    def check_integrity(self) -> None:
        """Forward and backward walks agree and match `num_free_blocks`."""
        forward = self.get_all_free_blocks()
        assert len(forward) == self.num_free_blocks, (
            f"free queue holds {len(forward)} blocks but num_free_blocks={self.num_free_blocks}")
        backward: list[KVCacheBlock] = []
        block = self._tail.prev_free_block
        while block is not None and block is not self._head:
            backward.append(block)
            block = block.prev_free_block
        assert block is self._head, "free queue backward walk does not reach the head"
        assert backward[::-1] == forward, "free queue prev/next links disagree"
        assert len({id(b) for b in forward}) == len(forward), "a block is in the free queue twice"


class BlockPool:
    """Owns all `num_blocks` blocks, their ref counts, the free queue and the cache map.

    Invariants (checked by `check_integrity`):
      * the free queue holds exactly the blocks with ref_cnt == 0; ref_cnt is never < 0;
      * `cached_block_hash_to_block[h].block_hash == h`, and every block with a hash is the
        one the map names for it (so one block per hash: duplicates stay uncached);
      * with caching disabled no block ever has a hash.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops `num_blocks` from the head (least recently freed first), evicting their
        cached hashes: their contents are about to be overwritten."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._evict_cached_block(block)
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on each block (a prefix-cache hit or a fork). A free cached
        block leaves the free queue, so it can no longer be evicted."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock],
                    discard_cache: bool = False) -> None:
        """Drops one reference per block; those reaching 0 join the free queue's tail in
        the given order (the first one will be evicted first). `discard_cache` also drops
        their hashes: their KV may never have been written (a failed forward)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if discard_cache:
                    self._evict_cached_block(block)
                self.free_block_queue.append(block)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Registers a full block under `block_hash`; returns whether it is now cached.

        If another block already holds this hash (two requests computed the same prefix
        at once), the existing one stays canonical and this block stays uncached: it is
        still valid for its owner, and freeing it later just returns a plain block.
        """
        if not self.enable_caching:
            return False
        if block.block_hash is not None:
            assert block.block_hash == block_hash, (
                f"block {block.block_id} is cached as {block.block_hash}, "
                f"re-cached as {block_hash}")
            return True
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0); free cached blocks count as free."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash. Refused (returns False) while any block is in use:
        running requests would otherwise lose the hashes of blocks they still extend."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        cached = self.cached_block_hash_to_block.pop(block.block_hash, None)
        assert cached is block, f"cache map does not point at block {block.block_id}"
        block.block_hash = None

    def check_integrity(self) -> None:
        """Raises AssertionError naming the first broken invariant."""
        queue = self.free_block_queue
        queue.check_integrity()
        in_queue = {b.block_id for b in queue.get_all_free_blocks()}
        for block in queue.get_all_free_blocks():
            assert self.owns(block), f"free queue holds foreign block {block.block_id}"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            if block.ref_cnt == 0:
                assert block.block_id in in_queue, (
                    f"block {block.block_id} has ref_cnt 0 but is not in the free queue")
            else:
                assert block.block_id not in in_queue, (
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but is in the free queue")
                assert block.prev_free_block is None and block.next_free_block is None, (
                    f"block {block.block_id} is in use but still has free-queue links")
            if block.block_hash is not None:
                assert self.enable_caching, f"block {block.block_id} hashed with caching off"
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"block {block.block_id} has a hash the cache map does not point back to")
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, (
                f"cache map entry {block_hash} points at block {block.block_id} "
                f"carrying hash {block.block_hash}")
            assert self.owns(block), f"cache map holds foreign block {block.block_id}"

    def owns(self, block: KVCacheBlock) -> bool:
        """Whether `block` is one of this pool's blocks (not a copy or a sentinel)."""
        return 0 <= block.block_id < self.num_blocks and self.blocks[block.block_id] is block
