"""Tree drafts (spec_decode/tree.py) on synthetic problems: their shape helpers, the greedy
walk, the tree attention mask against per-path causal attention, and recursive rejection
sampling, whose emitted tokens must be distributed as one-at-a-time sampling.

The sampled claim, for a tree whose rows are target distributions p_row: the first emitted
token is distributed as p_root; among trials that emitted node c's token first and then
another token, that token is distributed as p_c (and so on down the tree). Checked by
chi-square goodness of fit (tests/chi_square.py) over seeded trials; a subtly wrong
sampler (one that forgets to remove a rejected child from p) fails the same check.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from aioengine.sched.scheduler_output import ScheduledRequest
from aioengine.kernels import cpu as cpu_kernels
from aioengine.model.attention import TorchAttentionBackend, build_attention_metadata
from aioengine.sample.ops import exponential_race
from aioengine.spec_decode.tree import (TreeVerdict, accepted_slot_moves, node_depths,
                                        node_index_paths, node_paths, tree_attention_mask,
                                        verify_tree_greedy, verify_tree_sampled)
from aioengine.worker.spec_tree import apply_tree_layout

from tests.chi_square import ALPHA, chi2_sf, gof_statistic

# root -> a(0), b(1);  a -> c(2), d(3);  b -> e(4);  c -> f(5)
TOKENS = [0, 3, 1, 4, 2, 5]
PARENTS = [-1, -1, 0, 0, 1, 2]


def test_shape_helpers() -> None:
    assert node_depths(PARENTS) == [1, 1, 2, 2, 2, 3]
    assert node_paths(TOKENS, PARENTS) == [[], [0], [3], [0, 1], [0, 4], [3, 2], [0, 1, 5]]
    mask = tree_attention_mask(PARENTS, torch.device("cpu")).int().tolist()
    assert mask == [[0, 0, 0, 0, 0, 0],
                    [1, 0, 0, 0, 0, 0],
                    [0, 1, 0, 0, 0, 0],
                    [1, 0, 1, 0, 0, 0],
                    [1, 0, 0, 1, 0, 0],
                    [0, 1, 0, 0, 1, 0],
                    [1, 0, 1, 0, 0, 1]]
    # f (node 5, depth 3) under c (2) under a (0): a stays, c moves 3 -> 2, f 6 -> 3.
    assert accepted_slot_moves([0, 2, 5], root_position=10) == [(13, 12), (16, 13)]


def test_greedy_walk() -> None:
    # Rows: the root, then node i at 1 + i; two rows of another item first (first_row 2).
    # The root's argmax 0 is a; a's row says 1: c; c's row says 2, not f's 5: stop there.
    argmax = [9, 9, 0, 1, 7, 2, 7, 7, 7]
    assert verify_tree_greedy(argmax, 2, TOKENS, PARENTS) == TreeVerdict([0, 1, 2], [0, 2])
    argmax = [0, 1, 7, 5, 7, 7, 3]  # ... c's row says 5: f, a leaf: its row's bonus 3
    assert verify_tree_greedy(argmax, 0, TOKENS, PARENTS) == TreeVerdict([0, 1, 5, 3],
                                                                         [0, 2, 5])
    assert verify_tree_greedy([4] + [0] * 6, 0, TOKENS, PARENTS) == TreeVerdict([4], [])
    assert TreeVerdict([0, 1, 5, 3], [0, 2, 5]).rows == [0, 1, 3, 6]


def test_tree_mask_attends_like_each_path_alone() -> None:
    """Each tree row's attention output equals the last row of a causal prefill of its
    path (the context, then the path's nodes at consecutive slots)."""
    torch.manual_seed(0)
    heads, kv_heads, dim, bs, ctx = 4, 2, 8, 4, 7  # ctx: the root's position
    n = len(PARENTS)
    backend = TorchAttentionBackend(use_cpu_kernel=False)
    context_k = torch.randn(ctx, kv_heads, dim)
    context_v = torch.randn(ctx, kv_heads, dim)
    q = torch.randn(n + 1, heads, dim)
    k = torch.randn(n + 1, kv_heads, dim)
    v = torch.randn(n + 1, kv_heads, dim)
    table = [3, 0, 5, 1]

    def fresh_cache() -> torch.Tensor:
        cache = torch.zeros(2, 6, bs, kv_heads, dim)
        meta, _ = build_attention_metadata([ctx], [ctx], [table], bs, torch.device("cpu"))
        backend.forward(torch.randn(ctx, heads, dim), context_k, context_v, cache, meta, 0.5)
        return cache

    cache = fresh_cache()
    meta, _ = build_attention_metadata([n + 1], [ctx + n + 1], [table], bs, torch.device("cpu"))
    meta.tree_masks = {0: tree_attention_mask(PARENTS, torch.device("cpu"))}
    tree_out = backend.forward(q, k, v, cache, meta, 0.5)
    for row, path in enumerate([[]] + node_index_paths(PARENTS)):
        rows = [0] + [i + 1 for i in path]  # the root, then the path's nodes
        cache = fresh_cache()
        meta, _ = build_attention_metadata([len(rows)], [ctx + len(rows)], [table], bs,
                                           torch.device("cpu"))
        chain_out = backend.forward(q[rows], k[rows], v[rows], cache, meta, 0.5)
        torch.testing.assert_close(tree_out[row], chain_out[-1])


@pytest.mark.skipif(cpu_kernels.load() is None, reason="C kernels not built")
@pytest.mark.parametrize("ctx", [7, 14, 21])
def test_kernel_tree_rows_have_the_bits_of_chain_rows(ctx: int) -> None:
    """With worker/spec_tree's scratch tables the C kernel gives each tree row exactly
    the bits it gives the last row of a chain of the row's path (the same keys at the same
    positions), so greedy tokens cannot depend on whether a path came in a tree."""
    torch.manual_seed(1)
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    n, num_blocks = len(PARENTS), 16
    cpu = torch.device("cpu")
    backend = TorchAttentionBackend(use_cpu_kernel=True)
    context_k = torch.randn(ctx, kv_heads, dim)
    context_v = torch.randn(ctx, kv_heads, dim)
    q, k, v = torch.randn(n + 1, heads, dim), torch.randn(n + 1, kv_heads, dim), \
        torch.randn(n + 1, kv_heads, dim)
    table = [9, 2, 4, 0, 7, 1, 3, 5][:-(-(ctx + n + 1) // bs)]

    def fresh_cache() -> torch.Tensor:
        cache = torch.zeros(2, num_blocks + 16, bs, kv_heads, dim)
        meta, _ = build_attention_metadata([ctx], [ctx], [table], bs, cpu)
        backend.forward(torch.randn(ctx, heads, dim), context_k, context_v, cache, meta, 0.5)
        return cache

    item = ScheduledRequest(request=None, num_computed_tokens=ctx, token_ids=[1] * (n + 1),
                            block_ids=table, num_samples=1, spec_token_ids=TOKENS,
                            spec_tree_parents=PARENTS)
    meta, positions = build_attention_metadata([n + 1], [ctx + n + 1], [table], bs, cpu)
    apply_tree_layout([item], [0, n + 1], meta, positions, list(range(num_blocks, num_blocks + 16)),
                      bs)
    assert meta.tree_kernel is not None
    tree_out = backend.forward(q, k, v, fresh_cache(), meta, 0.5)
    for row, path in enumerate([[]] + node_index_paths(PARENTS)):
        rows = [0] + [i + 1 for i in path]
        meta, _ = build_attention_metadata([len(rows)], [ctx + len(rows)], [table], bs, cpu)
        chain_out = backend.forward(q[rows], k[rows], v[rows], fresh_cache(), meta, 0.5)
        assert torch.equal(tree_out[row], chain_out[-1]), row




# ---- sampling ---------------------------------------------------------------------------

V = 6
N_TRIALS = 20_000
# A target row per tree row (root, a, b, c, d, e, f): each row's children's tokens have
# sizeable mass, and every row has a zero (never to be emitted).
ROWS = np.array([
    [0.30, 0.10, 0.05, 0.35, 0.20, 0.00],  # root: children a = 0, b = 3
    [0.10, 0.40, 0.00, 0.05, 0.30, 0.15],  # a: children c = 1, d = 4
    [0.20, 0.10, 0.45, 0.00, 0.10, 0.15],  # b: child e = 2
    [0.15, 0.05, 0.10, 0.00, 0.20, 0.50],  # c: child f = 5
    [0.25, 0.25, 0.25, 0.00, 0.25, 0.00],  # d (leaf)
    [0.00, 0.30, 0.30, 0.20, 0.10, 0.10],  # e (leaf)
    [0.40, 0.00, 0.20, 0.20, 0.10, 0.10],  # f (leaf)
])


def _forgets_rejected_children(probs, first_row, tokens, parents, generator, shared):
    """Wrong: tries children with p(c) against the whole p, never removing rejected ones."""
    children = [[i for i, p in enumerate(parents) if p == r - 1] for r in range(len(parents) + 1)]
    accepted, row = [], 0
    while True:
        p = probs[first_row + row]
        match = next((c for c in children[row]
                      if torch.rand((), generator=shared) < p[tokens[c]]), None)
        if match is None:
            token = exponential_race(p.clone()[None], {}, shared)
            return TreeVerdict([tokens[n] for n in accepted] + [int(token)], accepted)
        accepted.append(match)
        row = match + 1


def stage_pvalues(sampler, n: int = N_TRIALS, seed: int = 5) -> list[tuple[float, int]]:
    """(p-value, trials) of the emitted token at each tree row the trials reached: the
    token after reaching row r (its path emitted) against ROWS[r]."""
    probs = torch.tensor(ROWS, dtype=torch.float32).repeat(n, 1)
    gen = torch.Generator().manual_seed(seed)
    by_row: dict[int, list[int]] = {}
    paths = node_paths(TOKENS, PARENTS)
    for i in range(n):
        verdict = sampler(probs, i * len(ROWS), TOKENS, PARENTS, None, gen)
        rows = verdict.rows
        assert verdict.tokens[:-1] == paths[rows[-1]]  # accepted nodes' tokens, then one
        by_row.setdefault(rows[-1], []).append(verdict.tokens[-1])
        for r, token in zip(rows[:-1], verdict.tokens):  # each accepted node came out of
            by_row.setdefault(r, []).append(token)  # its parent row's distribution too
    out = []
    for r, tokens in sorted(by_row.items()):
        stat, df = gof_statistic(np.bincount(tokens, minlength=V), ROWS[r])
        out.append((chi2_sf(stat, df) if df else 1.0, len(tokens)))
    return out


def test_recursive_rejection_sampling_keeps_the_target_distribution() -> None:
    results = stage_pvalues(verify_tree_sampled)
    assert len(results) == len(ROWS)  # every row reached, leaves included
    for r, (p, n) in enumerate(results):
        assert p > ALPHA, f"row {r}: chi-square p = {p:.2e} over {n} trials"
    assert min(n for _, n in results) > 300


def test_the_check_rejects_a_sampler_that_keeps_rejected_children() -> None:
    assert min(p for p, _ in stage_pvalues(_forgets_rejected_children, n=5000)) < ALPHA
    assert min(p for p, _ in stage_pvalues(verify_tree_sampled, n=5000)) > ALPHA


def test_seeded_draws_depend_only_on_the_request() -> None:
    probs = torch.tensor(ROWS, dtype=torch.float32)
    outs = [verify_tree_sampled(probs, 0, TOKENS, PARENTS,
                                torch.Generator().manual_seed(7), shared)
            for shared in (torch.Generator().manual_seed(1), torch.Generator().manual_seed(2))]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("first_row", [0, 3])
def test_greedy_rows_of_a_one_hot_distribution(first_row: int) -> None:
    """A greedy request in a sampled step has one-hot rows: the walk and the sampler agree."""
    argmax = [0] * first_row + [3, 1, 2, 5, 0, 1, 4]
    probs = torch.nn.functional.one_hot(torch.tensor(argmax), V).float()
    gen = torch.Generator().manual_seed(0)
    assert (verify_tree_sampled(probs, first_row, TOKENS, PARENTS, None, gen)
            == verify_tree_greedy(argmax, first_row, TOKENS, PARENTS))


# ---- configuration ---------------------------------------------------------------------

def test_tree_config_and_its_lookahead() -> None:
    from aioengine.bench.spec import parse_spec
    from aioengine.config import ConfigError
    from aioengine.spec_decode import num_lookahead_tokens
    from aioengine.spec_decode.config import SpeculativeConfig
    from aioengine.spec_decode.tree import TreeConfig

    spec = SpeculativeConfig.parse(parse_spec("eagle3tree:4:3:10", None))
    assert spec.tree == TreeConfig(depth=4, top_k=3, num_nodes=10)
    assert spec.num_speculative_tokens == 4  # the depth: the longest run of drafts
    assert num_lookahead_tokens(spec) == 4 + 3 * 3  # the accepted run, then the head rows
    with pytest.raises(ConfigError, match="tree.depth"):
        SpeculativeConfig.parse({"method": "eagle3", "num_speculative_tokens": 3,
                                 "tree": {"depth": 4, "top_k": 2, "num_nodes": 8}})
    with pytest.raises(ConfigError, match="tree.top_k"):
        SpeculativeConfig.parse({"method": "eagle3",
                                 "tree": {"depth": 4, "top_k": True, "num_nodes": 8}})
