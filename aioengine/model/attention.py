"""Paged attention: the per-step metadata, the backend interface and the torch backend.

One step's tokens are flattened over requests, decodes (query_len == 1) first:

    request       d0   d1   p0 (chunk, 4 tokens)   p1 (2 tokens)
    tokens        t0 | t1 | t2  t3  t4  t5         | t6  t7
    query_start_loc = [0, 1, 2, 6, 8]      num_decodes = 2
    seq_lens        = context + query_len of each request

KV cache per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (0 = K, 1 = V).
Token at position p of a request lives in slot
`block_table[p // block_size] * block_size + p % block_size`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from aioengine.kernels import cpu as cpu_kernels
from aioengine.model.tree_attention import TreeKernelRows


@dataclass
class AttentionMetadata:
    num_actual_tokens: int  # T, tokens in this step (flattened over requests)
    num_reqs: int  # B
    num_decodes: int  # leading requests with query_len == 1
    query_start_loc: Tensor  # [B+1] int32, device
    seq_lens: Tensor  # [B] int32, device: context length INCLUDING this step's tokens
    block_tables: Tensor  # [B, max_blocks] int32, device (padding: block 0)
    slot_mapping: Tensor  # [T] int64, device
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_decode_seq_len: int = 0
    # Per-step scratch a backend fills on the first layer and reuses on the others
    # (e.g. the decode mask); lives here so that no per-step state is global.
    backend_cache: dict[str, Any] = field(default_factory=dict)
    # KV cache groups (kv/kv_cache_groups.py): each layer's metadata, those of a group
    # sharing its block tables and slot mapping; None: this one for every layer.
    layer_metas: tuple[AttentionMetadata, ...] | None = None
    # Tree attention (speculative tree drafts, spec_decode/tree.py): sequence i -> a bool
    # mask [query_len, R] over its last R keys (the tree's slots): its queries see every
    # key before them and, of those R, only where the mask says. Only backends with
    # SUPPORTS_TREE_MASK honour it; None: causal attention everywhere.
    tree_masks: dict[int, Tensor] | None = None
    # The same trees for the C kernel (worker/spec_tree.py), which has no mask: each node
    # row reads a table of its own whose last blocks are scratch copies of the context's
    # tail and the row's path, so it sees exactly what a chain's row would, at the same
    # positions (the same bits). None: tree steps take the torch path.
    tree_kernel: TreeKernelRows | None = None

    def for_layer(self, layer_idx: int) -> AttentionMetadata:
        """The metadata layer `layer_idx` attends with (its KV cache group's)."""
        return self if self.layer_metas is None else self.layer_metas[layer_idx]


def build_attention_metadata(query_lens: list[int], seq_lens: list[int],
                             block_tables: list[list[int]], block_size: int,
                             device: torch.device) -> tuple[AttentionMetadata, Tensor]:
    """Returns the metadata and positions[T] (int64).

    Requests with query_len == 1 should come first: `num_decodes` counts the leading run of
    them, and any later query_len == 1 request takes the (slower, still correct) prefill path.
    Vectorised with numpy: no per-token Python loop, since the engine calls this every step.
    """
    num_reqs = len(query_lens)
    if not (num_reqs == len(seq_lens) == len(block_tables)) or num_reqs == 0:
        raise ValueError("query_lens, seq_lens and block_tables must be non-empty and equally long")
    if num_reqs <= SMALL_DECODE_MAX_REQS and all(n == 1 for n in query_lens):
        return _small_decode_metadata(seq_lens, block_tables, block_size, device)
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    if (q < 1).any() or (s < q).any():
        raise ValueError(f"need 1 <= query_len <= seq_len, got {query_lens} / {seq_lens}")
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q, out=qsl[1:])
    num_tokens = int(qsl[-1])

    # positions: request i's new tokens sit at context_len_i .. seq_len_i - 1.
    req_of_token = np.repeat(np.arange(num_reqs), q)
    positions = np.arange(num_tokens) + np.repeat(s - q - qsl[:-1], q)

    table_lens = np.fromiter((len(bt) for bt in block_tables), dtype=np.int64, count=num_reqs)
    if ((table_lens * block_size) < s).any():
        raise ValueError("a block table is too short for its seq_len")
    table = np.zeros((num_reqs, max(int(table_lens.max()), 1)), dtype=np.int64)
    table[np.arange(table.shape[1]) < table_lens[:, None]] = np.fromiter(
        (b for bt in block_tables for b in bt), dtype=np.int64, count=int(table_lens.sum()))
    slots = table[req_of_token, positions // block_size] * block_size + positions % block_size

    not_decode = np.flatnonzero(q != 1)
    num_decodes = int(not_decode[0]) if len(not_decode) else num_reqs
    meta = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=num_reqs,
        num_decodes=num_decodes,
        query_start_loc=to_device(torch.from_numpy(qsl.astype(np.int32)), device),
        seq_lens=to_device(torch.from_numpy(s.astype(np.int32)), device),
        block_tables=to_device(torch.from_numpy(table.astype(np.int32)), device),
        slot_mapping=to_device(torch.from_numpy(slots), device),
        max_query_len=int(q.max()),
        max_seq_len=int(s.max()),
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=s.tolist(),
        max_decode_seq_len=int(s[:num_decodes].max()) if num_decodes else 0,
    )
    return meta, to_device(torch.from_numpy(positions), device)


# Decode steps of up to this many requests take plain Python lists instead of numpy: for
# one request the numpy path cost ~0.23 ms inside the engine, a fiftieth of a decode step.
SMALL_DECODE_MAX_REQS = 8


def _small_decode_metadata(seq_lens: list[int], block_tables: list[list[int]],
                           block_size: int, device: torch.device,
                           ) -> tuple[AttentionMetadata, Tensor]:
    """build_attention_metadata for a step of single-token requests, without numpy."""
    if min(seq_lens) < 1:
        raise ValueError(f"need 1 <= query_len <= seq_len, got 1s / {seq_lens}")
    if any(len(bt) * block_size < n for bt, n in zip(block_tables, seq_lens)):
        raise ValueError("a block table is too short for its seq_len")
    num_reqs = len(seq_lens)
    positions = [n - 1 for n in seq_lens]
    slots = [bt[p // block_size] * block_size + p % block_size
             for bt, p in zip(block_tables, positions)]
    width = max(len(bt) for bt in block_tables)
    table = [bt + [0] * (width - len(bt)) for bt in block_tables]
    qsl = list(range(num_reqs + 1))
    max_seq_len = max(seq_lens)
    meta = AttentionMetadata(
        num_actual_tokens=num_reqs,
        num_reqs=num_reqs,
        num_decodes=num_reqs,
        query_start_loc=to_device(torch.tensor(qsl, dtype=torch.int32), device),
        seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32), device),
        block_tables=to_device(torch.tensor(table, dtype=torch.int32), device),
        slot_mapping=to_device(torch.tensor(slots, dtype=torch.int64), device),
        max_query_len=1,
        max_seq_len=max_seq_len,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
        max_decode_seq_len=max_seq_len,
    )
    return meta, to_device(torch.tensor(positions, dtype=torch.int64), device)


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device`: on CUDA through a pinned staging copy and a non_blocking
    copy on the current stream (torch's caching host allocator reuses the pinned block once
    the copy's event has completed); the tensor itself elsewhere."""
    if device.type != "cuda":
        return t if t.device == device else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class AttentionBackend(abc.ABC):
    """Writes this step's K/V into the paged cache, then attends over each request's context.

    SUPPORTED_FEATURES: the attention-side LayerSpec options (layer_spec.py) the backend
    implements; a model refuses a backend that lacks one its layers use."""

    SUPPORTED_FEATURES: frozenset[str] = frozenset({"qk_norm", "attention_bias"})
    # Whether it honours AttentionMetadata.tree_masks (speculative tree drafts); a tree
    # draft config is refused with a backend that does not.
    SUPPORTS_TREE_MASK: bool = False

    @abc.abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], kv_cache [2, blocks, block_size, Hkv, D] -> [T, Hq, D].
        sliding_window: each query attends to the last `sliding_window` positions only (its
        own included); None = full causal attention."""


def write_to_kv_cache(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatters the new tokens' K/V to their slots (vLLM's reshape_and_cache): the C kernel
    where it applies, else two index_copy_."""
    if cpu_kernels.reshape_and_cache(k, v, kv_cache, slot_mapping):
        return
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class TorchAttentionBackend(AttentionBackend):
    """Torch backend (SDPA), the one used on CPU.

    With `use_cpu_kernel`, float32 q and a float32 or bf16 KV cache on the CPU: every decode
    and prefill token of the step in one call of the C kernel (`kernels/cpu.py`
    paged_attention), one row per token with its own seq_len, K/V read in place. The kernel
    splits each token's context at fixed absolute positions, so a token's attention has the
    same bits whether it is decoded, prefilled fresh, prefilled after a cached prefix or in
    another chunk (issue 29); with a sliding window each row starts at its window's oldest
    position (still split at the same absolute positions).

    Torch path (the reference, and the fallback where the kernel does not apply: other
    dtypes, the kernel not built), correct but not
    bit-deterministic across step shapes. Decodes: one batched SDPA over all of them, keys
    gathered block-wise and padded to the longest decode, padding masked; with a window
    narrower than a context, each decode gathers only the blocks of its window (and a
    prefill chunk only from the block holding its first query's oldest key), so the cost
    is bounded by the window and released blocks (NULL_BLOCK entries) are never read. GQA is handled by
    folding the query heads of a KV group into SDPA's query-length axis, so K/V are never
    repeated. Prefill chunks: one SDPA per request, causal mask shifted by the context
    length.
    """

    SUPPORTED_FEATURES = AttentionBackend.SUPPORTED_FEATURES | {"sliding_window"}
    # AttentionMetadata.tree_masks: torch SDPA per sequence, or the C kernel through
    # AttentionMetadata.tree_kernel's tables.
    SUPPORTS_TREE_MASK = True

    def __init__(self, use_cpu_kernel: bool = True) -> None:
        self.use_cpu_kernel = use_cpu_kernel

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> Tensor:
        num_tokens = meta.num_actual_tokens
        # Write first: a request may read blocks another request wrote in this very step.
        write_to_kv_cache(k[:num_tokens], v[:num_tokens], kv_cache, meta.slot_mapping)
        if ((meta.tree_masks is None or meta.tree_kernel is not None)
                and self._kernel_applies(q, kv_cache)):
            out = self._kernel_rows(q, kv_cache, meta, scale, sliding_window)
            if out is not None:
                return out
        if kv_cache.dtype != q.dtype:
            # A cache in lower precision (kv_cache_dtype): the torch path attends to the
            # fresh K/V as the cache holds them, so a prefix-cache hit sees what a recompute
            # would (the C kernel reads them back from the cache).
            k, v = k.to(kv_cache.dtype).to(q.dtype), v.to(kv_cache.dtype).to(q.dtype)
        # With tree masks every sequence attends on its own (the batched decode has none).
        nd = meta.num_decodes if meta.tree_masks is None else 0
        if nd == meta.num_reqs:  # a decode-only step
            return self._decode(q, kv_cache, meta, scale, sliding_window)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale, sliding_window)
        for i in range(nd, meta.num_reqs):
            start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            out[start:end] = self._prefill(i, q[start:end], k[start:end], v[start:end],
                                           kv_cache, meta, scale, sliding_window)
        return out

    def _kernel_applies(self, q: Tensor, kv_cache: Tensor) -> bool:
        """Whether the C kernel attends for the step (every request, a window included:
        it starts each row at its window's oldest position): dtypes and device."""
        return (self.use_cpu_kernel and q.dtype == torch.float32
                and kv_cache.dtype in cpu_kernels.KV_CACHE_DTYPES and q.device.type == "cpu")

    def _kernel_rows(self, q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
                     sliding_window: int | None) -> Tensor | None:
        """The kernel's output for every token of the step, in one call; None, computing
        nothing, when the kernel is not built."""
        tables = meta.block_tables
        if meta.tree_kernel is not None:
            tree = meta.tree_kernel
            tree.fill_scratch(kv_cache)
            tables, row_to_req, row_seq_lens = (tree.block_tables, tree.row_to_req,
                                                tree.row_seq_lens)
        else:
            plan = meta.backend_cache.get("kernel_rows")
            if plan is None:
                plan = meta.backend_cache["kernel_rows"] = kernel_rows_plan(meta)
            row_to_req, row_seq_lens = plan
        num_tokens = meta.num_actual_tokens
        q_rows = q[:num_tokens].contiguous()
        o = torch.empty_like(q_rows)
        if not cpu_kernels.paged_attention(o, q_rows, kv_cache, tables, row_to_req,
                                           row_seq_lens, scale, sliding_window=sliding_window):
            return None
        if q.shape[0] == num_tokens:
            return o
        out = torch.empty_like(q)
        out[:num_tokens] = o
        return out

    def _decode(self, q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> Tensor:
        nd, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        group = num_heads // num_kv_heads
        key = ("decode_keys", sliding_window)
        plan = meta.backend_cache.get(key)
        if plan is None:
            plan = meta.backend_cache[key] = _decode_plan(meta, nd, block_size, sliding_window)
        tables, mask = plan
        # [nd, nb, bs, Hkv, D] -> [nd, Hkv, L, D]
        keys = kv_cache[0][tables].view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = kv_cache[1][tables].view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        # Query heads are grouped by KV head: head h uses KV head h // group.
        qg = q.view(nd, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        return o.reshape(nd, num_heads, head_dim)

    def _prefill(self, i: int, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor,
                 meta: AttentionMetadata, scale: float,
                 sliding_window: int | None = None) -> Tensor:
        query_len = q.shape[0]
        seq_len = meta.seq_lens_cpu[i]
        context_len = seq_len - query_len
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Tq, D]
        tree_mask = None if meta.tree_masks is None else meta.tree_masks.get(i)
        if (context_len == 0 and tree_mask is None
                and (sliding_window is None or seq_len <= sliding_window)):
            # The whole sequence is in this step: attend to the fresh K/V directly.
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                               enable_gqa=True)
            return o.squeeze(0).transpose(0, 1)
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_blocks = -(-seq_len // block_size)
        # With a window, the first query (at context_len) reads nothing before
        # context_len - W + 1: the blocks wholly before it are skipped (maybe released).
        first = 0 if sliding_window is None else max(
            0, (context_len - sliding_window + 1) // block_size)
        table = meta.block_tables[i, first:num_blocks]
        start = first * block_size
        kh = kv_cache[0][table].view(-1, num_kv_heads, head_dim)[:seq_len - start]
        vh = kv_cache[1][table].view(-1, num_kv_heads, head_dim)[:seq_len - start]
        kh, vh = kh.transpose(0, 1).to(q.dtype), vh.transpose(0, 1).to(q.dtype)
        # Query j sits at position context_len + j and sees keys 0 .. context_len + j (the
        # last sliding_window of them).
        q_pos = torch.arange(context_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(start, seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if tree_mask is not None:  # the tree's slots: only ancestors and itself
            mask[:, mask.shape[1] - tree_mask.shape[1]:] = tree_mask
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        o = F.scaled_dot_product_attention(qh, kh.unsqueeze(0), vh.unsqueeze(0), attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)


def kernel_rows_plan(meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
    """(row_to_req, row_seq_lens) [T] int32 of the kernel's rows, one per token of the step
    (row j of a request with context_len cached positions sees context_len + j + 1).
    Vectorised with numpy, and a decode-only step without it (its rows are its requests)."""
    nd, num_reqs = meta.num_decodes, meta.num_reqs
    if nd == num_reqs:
        return torch.arange(num_reqs, dtype=torch.int32), meta.seq_lens.cpu()
    qsl = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
    seq = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
    query_lens = np.diff(qsl)
    row_to_req = np.repeat(np.arange(num_reqs), query_lens)
    # token t of request i sits at position seq_i - query_len_i + (t - qsl_i)
    row_seq_lens = (np.arange(meta.num_actual_tokens) + 1
                    + np.repeat(seq - query_lens - qsl[:-1], query_lens))
    return (torch.from_numpy(row_to_req.astype(np.int32)),
            torch.from_numpy(row_seq_lens.astype(np.int32)))


def _decode_plan(meta: AttentionMetadata, nd: int, block_size: int,
                 sliding_window: int | None) -> tuple[Tensor, Tensor]:
    """(tables [nd, nb], mask [nd, 1, 1, nb * block_size]) of a step's decodes: the blocks
    each reads and which of their keys it sees. Full attention: the first blocks up to the
    longest decode, keys inside the sequence. With a window narrower than some decode's
    context: per decode the cdiv(W, bs) + 1 blocks from the one holding position
    seq_len - W (the oldest key the query at seq_len - 1 sees), so the cost is bounded by
    the window, not the length (the blocks before it may have been released)."""
    device = meta.block_tables.device
    seq_lens = meta.seq_lens[:nd, None].long()
    if sliding_window is None or meta.max_decode_seq_len <= sliding_window:
        num_blocks = -(-meta.max_decode_seq_len // block_size)
        pos = torch.arange(num_blocks * block_size, device=device)[None, :]
        return meta.block_tables[:nd, :num_blocks], (pos < seq_lens).view(nd, 1, 1, -1)
    num_blocks = -(-sliding_window // block_size) + 1
    first = (seq_lens - sliding_window).clamp_(min=0) // block_size  # [nd, 1]
    index = first + torch.arange(num_blocks, device=device)[None, :]
    # Past the table's width only padding would be read: clamp, the mask hides it.
    index = index.clamp_(max=meta.block_tables.shape[1] - 1)
    tables = meta.block_tables[:nd].gather(1, index)
    pos = (first * block_size
           + torch.arange(num_blocks * block_size, device=device)[None, :])
    mask = (pos < seq_lens) & (pos >= seq_lens - sliding_window)
    return tables, mask.view(nd, 1, 1, -1)
