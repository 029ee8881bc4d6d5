"""EAGLE-2 tree drafting (spec_decode/eagle_tree.py) against the head run one path at a
time: every expanded node's children are the top_k of the head's distribution after the
node's path (its chain of head steps over the paged cache, decode row by decode row), with
the path's summed log-probabilities as scores; the tree is the num_nodes best nodes,
parents first."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from eagle_heads import make_random_eagle_head_dir
from tiny_models import make_tiny_config

from aioengine.model.arch import ModelArchConfig
from aioengine.model.attention import build_attention_metadata
from aioengine.model.layers import Linear
from aioengine.spec_decode.eagle import load_eagle_head
from aioengine.spec_decode.eagle_tree import draft_trees, num_head_scratch_blocks
from aioengine.spec_decode.tree import TreeConfig, node_depths, node_paths

CPU = torch.device("cpu")
H, VOCAB, BS = 64, 49152, 4
CTX = 9  # the head's caught-up rows: positions 0 .. CTX - 1
TABLE = [5, 0, 7, 2, 6, 1, 3]  # room for the tree rows from position CTX on


class Target(torch.nn.Module):
    """What the head shares with the target: its embedding and LM head."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.embed_tokens = Linear(H, VOCAB, False, dtype=torch.float32, device=CPU)
        self.embed_tokens.weight.copy_(0.2 * torch.randn(VOCAB, H, generator=gen))
        self.lm_head = self.embed_tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    target_dir = tmp_path_factory.mktemp("target")
    make_tiny_config("llama", num_hidden_layers=4).save_pretrained(target_dir)
    arch = ModelArchConfig.from_hf_config(make_tiny_config("llama", num_hidden_layers=4))
    path = make_random_eagle_head_dir(target_dir, tmp_path_factory.mktemp("head"), "eagle3",
                                      seed=3, draft_vocab_size=50)
    head = load_eagle_head(str(path), "eagle3", arch, torch.float32, CPU)
    gen = torch.Generator().manual_seed(0)
    target = Target(gen)
    tokens = torch.randint(VOCAB, (CTX,), generator=gen)
    aux = torch.randn(CTX, head.input_hidden_size, generator=gen)
    return head, target, tokens, aux


def caught_up(head, target, tokens, aux, scratch: int = 0):
    """A fresh head cache (8 blocks, then `scratch` more) with the catch-up prefill
    written; its last row's outputs."""
    kv_cache = head.make_kv_cache(num_blocks=8 + scratch, block_size=BS)
    meta, positions = build_attention_metadata([CTX], [CTX], [TABLE], BS, CPU)
    logits_hidden, next_hidden = head(tokens, aux, positions, kv_cache, meta,
                                      target.embed_tokens)
    return kv_cache, logits_hidden[-1:], next_hidden[-1:]


def path_topk(head, target, tokens, aux, path: list[int], k: int):
    """The head's top_k after `path`, one decode row per path token (the chain's way)."""
    kv_cache, logits_hidden, hidden = caught_up(head, target, tokens, aux)
    for d, token in enumerate(path):
        pos = torch.tensor([CTX + d])
        meta, _ = build_attention_metadata([1], [CTX + d + 1], [TABLE], BS, CPU)
        logits_hidden, hidden = head(torch.tensor([token]), hidden, pos, kv_cache, meta,
                                     target.embed_tokens)
    logp, ids = head.draft_topk(logits_hidden, target.lm_head, k)
    return logp[0], ids[0].tolist()


@torch.inference_mode()
@pytest.mark.parametrize("config", [TreeConfig(depth=3, top_k=2, num_nodes=10),
                                    TreeConfig(depth=4, top_k=3, num_nodes=12)])
@pytest.mark.parametrize("kernel_rows", [False, True], ids=["masks", "kernel-rows"])
def test_tree_nodes_are_the_heads_top_k_along_their_paths(setup, config: TreeConfig,
                                                          kernel_rows: bool,
                                                          fused_calls) -> None:
    """With the masks (torch SDPA) and with the C attention's own rows (scratch blocks
    given: the fused head step runs each depth's rows in one call)."""
    head, target, tokens, aux = setup
    scratch = num_head_scratch_blocks(config, BS) if kernel_rows else 0
    kv_cache, logits_hidden, next_hidden = caught_up(head, target, tokens, aux, scratch)
    fused_calls.clear()
    tree, = draft_trees(head, target, kv_cache, config, logits_hidden, next_hidden,
                        torch.tensor([CTX - 1]), [TABLE], BS, list(range(8, 8 + scratch)))
    assert fused_calls == ([config.top_k] * (config.depth - 1) if kernel_rows else [])
    n = len(tree.tokens)
    assert n == config.num_nodes
    assert all(p < i for i, p in enumerate(tree.parents))  # parents first
    depths = node_depths(tree.parents)
    assert max(depths) <= config.depth and max(depths) >= 2
    paths = node_paths(tree.tokens, tree.parents)[1:]
    scores = []
    for i, p in enumerate(tree.parents):
        logp, top = path_topk(head, target, tokens, aux, paths[p] if p >= 0 else [],
                              config.top_k)
        assert tree.tokens[i] in top, (i, paths[i], top)
        scores.append((scores[p] if p >= 0 else 0.0) + float(logp[top.index(tree.tokens[i])]))
    # Listed best first: the scores along the list never rise.
    assert all(a >= b - 1e-4 for a, b in zip(scores, scores[1:])), scores
    # A node with children among the kept ones has them in the order of its top_k.
    for i in range(n):
        kids = [tree.tokens[c] for c in range(n) if tree.parents[c] == i]
        _, top = path_topk(head, target, tokens, aux, paths[i], config.top_k) if kids \
            else (None, [])
        assert kids == [t for t in top if t in kids]
