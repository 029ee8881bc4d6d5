"""Tree verification steps (EAGLE-2 drafts, worker/spec_tree.py) in the fused decode
executor: the kernel copies the step's K/V into the node rows' scratch slots between a
layer's K/V write and its attention, so it runs the step in one call with the layer path's
bits, and each node row has the bits of a chain's row along its path."""
from __future__ import annotations

import random

import pytest
import torch

from aioengine.sched.scheduler_output import ScheduledRequest
from aioengine.model.attention import build_attention_metadata
from aioengine.model.llama import make_kv_caches
from aioengine.model.loader import load_model
from aioengine.worker.spec_tree import apply_tree_layout, num_tree_scratch_blocks
from aioengine.worker.step_layout import step_layout
from aioengine.spec_decode.tree import TreeConfig, node_index_paths

CPU = torch.device("cpu")
BLOCK_SIZE = 4
VOCAB = 49152
# Two trees of depth 3 (7 nodes: 3 at depth 1, 3 at depth 2, 1 at depth 3) and 4 nodes.
PARENTS = ([-1, -1, -1, 0, 0, 1, 3], [-1, 0, -1, 1])
TREE = TreeConfig(depth=3, top_k=3, num_nodes=7)


# Qwen3: its per-head q/k norms run through the same row kernel on both paths.
@pytest.fixture(scope="module", params=[("llama", torch.float32), ("qwen2", torch.float32),
                                        ("qwen3", torch.float32), ("llama", torch.bfloat16)],
                ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}")
def model(request, tiny_model_dirs):
    arch, dtype = request.param
    loaded = load_model(str(tiny_model_dirs[arch]), dtype, CPU, None).model
    assert loaded.layers[0].qkv_proj.is_packed  # the any-M GEMM: one arithmetic for every M
    return loaded


class Step:
    """KV caches holding random contexts (layer path prefill) on shuffled blocks, then a
    step of a plain decode and two trees, laid out as the runner lays it out."""

    def __init__(self, model, contexts: list[int], kv_dtype: torch.dtype, seed: int = 0,
                 scratch: int | None = None) -> None:
        rng = random.Random(seed)
        extra = max(len(p) for p in PARENTS) + 1
        pool = sum(-(-(c + extra) // BLOCK_SIZE) for c in contexts) + 2
        if scratch is None:
            scratch = num_tree_scratch_blocks(TREE, BLOCK_SIZE)
        self.caches = make_kv_caches(model.arch, pool + scratch, BLOCK_SIZE, kv_dtype, CPU)
        self.scratch = list(range(pool, pool + scratch))
        free = list(range(pool))
        rng.shuffle(free)
        self.tables = [[free.pop() for _ in range(-(-(c + extra) // BLOCK_SIZE))]
                       for c in contexts]
        self.prompts = [[rng.randrange(3, VOCAB) for _ in range(c + 1)] for c in contexts]
        self.contexts = contexts
        self.drafts = [[rng.randrange(3, VOCAB) for _ in p] for p in PARENTS]
        with torch.inference_mode():
            meta, positions = build_attention_metadata(
                contexts, contexts, self.tables, BLOCK_SIZE, CPU)
            model(torch.tensor([t for p in self.prompts for t in p[:-1]]), positions,
                  self.caches, meta)

    def item(self, i: int, drafts: list[int], parents: list[int] | None) -> ScheduledRequest:
        return ScheduledRequest(
            request=None, num_computed_tokens=self.contexts[i],
            token_ids=[self.prompts[i][-1]] + drafts, block_ids=self.tables[i],
            num_samples=1, spec_token_ids=list(drafts), spec_tree_parents=parents)

    def trees(self) -> list[ScheduledRequest]:
        """Request 0 decodes, requests 1 and 2 verify the trees."""
        return [self.item(0, [], None)] + [self.item(1 + j, self.drafts[j], PARENTS[j])
                                           for j in range(2)]

    def run(self, model, scheduled: list[ScheduledRequest], fused: bool):
        """(hidden states, caches after, the executor that ran, the metadata)."""
        query_lens, seq_lens, tables, starts = step_layout(scheduled)
        meta, positions = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE,
                                                   CPU)
        positions = apply_tree_layout(scheduled, starts, meta, positions, self.scratch,
                                      BLOCK_SIZE)
        ids = torch.tensor([t for s in scheduled for t in s.token_ids])
        caches = [c.clone() for c in self.caches]
        model.use_fused_decode = fused
        try:
            with torch.inference_mode():
                hidden = model(ids, positions, caches, meta)
        finally:
            model.use_fused_decode = True
        return hidden, caches, model.last_executor, meta


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16],
                         ids=["kv-float32", "kv-bf16"])
def test_fused_tree_step_has_the_layer_paths_bits(model, kv_dtype) -> None:
    step = Step(model, [5, 9, 14], kv_dtype)
    scheduled = step.trees()
    fused, fused_caches, executor, meta = step.run(model, scheduled, fused=True)
    assert meta.tree_kernel is not None and executor == "fused_cpu_decode"
    layer, layer_caches, executor, _ = step.run(model, scheduled, fused=False)
    assert executor == "layerwise"
    assert torch.equal(fused, layer)
    for a, b in zip(fused_caches, layer_caches):  # the node slots and the scratch copies
        assert torch.equal(a, b)


def test_a_node_row_has_the_bits_of_a_chain_row_along_its_path(model) -> None:
    """Node i's row (the tree's row 1 + i) equals the last row of a chain verification of
    its path, run by the same fused executor as decode rows."""
    step = Step(model, [5, 9, 14], torch.float32, seed=1)
    tree, _, executor, _ = step.run(model, step.trees(), fused=True)
    assert executor == "fused_cpu_decode"
    first_row = 1 + 1 + len(PARENTS[0])  # the decode, then request 2's root
    for node, path in enumerate(node_index_paths(PARENTS[1])):
        drafts = [step.drafts[1][n] for n in path]
        chain, _, executor, _ = step.run(model, [step.item(2, drafts, None)], fused=True)
        assert executor == "fused_cpu_decode"
        assert torch.equal(tree[first_row + 1 + node], chain[-1]), path


def test_trees_without_the_kernels_rows_take_the_layer_path(model) -> None:
    """Fail closed: a step whose trees got no scratch blocks (tree_kernel None: the torch
    masks attend) runs layerwise, and so does a tree beside a prompt chunk."""
    step = Step(model, [5, 9, 14], torch.float32, scratch=0)
    _, _, executor, meta = step.run(model, step.trees(), fused=True)
    assert meta.tree_masks and meta.tree_kernel is None and executor == "layerwise"
    step = Step(model, [5, 9, 14], torch.float32)
    chunk = ScheduledRequest(request=None, num_computed_tokens=0, token_ids=list(range(3, 40)),
                             block_ids=list(range(10)), num_samples=0)
    _, _, executor, meta = step.run(model, step.trees()[1:] + [chunk], fused=True)
    assert meta.tree_kernel is not None and executor == "layerwise"
