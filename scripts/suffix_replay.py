"""Suffix decoding replayed offline over a set's greedy outputs: how many tokens a step
chains (the engine's own proposer) or trees (best-first over the matched node's children)
would keep, without timing anything.

Greedy outputs do not depend on drafts, so one plain run of the warm-up and timed prompts
of an agentic set (`bench spec`'s seeds) fixes every step: at each position the proposer
sees the prompt and the output so far, the draft is checked against the output, and the
step moves past the kept tokens and one more. Finished outputs enter the global tree in
order, as in the engine.

    .venv/bin/python scripts/suffix_replay.py --prompts extraction --warmup 50 --num-prompts 10
"""
from __future__ import annotations

import argparse
import asyncio
import heapq
import json
from pathlib import Path
from types import SimpleNamespace

from aioengine.spec_decode.suffix import SuffixParams, SuffixProposer
from aioengine.spec_decode.suffix_tree import SuffixTree

# vLLM's suffix defaults, as spec_decode/config.py's.
PARAMS = SuffixParams(num_speculative_tokens=8, max_tree_depth=24, max_cached_requests=10000,
                      max_spec_factor=1.0, min_token_prob=0.1, max_cached_bytes=256 * 2**20)
Node = tuple[int, int, float]  # (token, parent index or -1, path probability)


async def dump(prompts: str, warmup: int, num_prompts: int, output_len: int) -> list[dict]:
    """Each warm-up, then timed, prompt's token ids and greedy output (speculation off)."""
    from aioengine import AsyncEngine
    from aioengine.bench.agentic import chat_set
    from aioengine.bench.spec import TIMED_SEED, WARMUP_SEED
    from aioengine.sampling_params import SamplingParams

    engine = await AsyncEngine.create(None, speculative_config=None)
    records = []
    try:
        for kind, seed, n in (("warm", WARMUP_SEED, warmup), ("timed", TIMED_SEED, num_prompts)):
            for chat in chat_set(prompts, n, seed):
                ids: list[int] = []
                prompt: list[int] = []
                params = SamplingParams(temperature=0.0, max_tokens=output_len)
                async for out in engine.generate(chat, params):
                    prompt = list(out.prompt_token_ids)
                    ids.extend(out.outputs[0].token_ids)
                records.append({"kind": kind, "prompt": prompt, "output": ids})
    finally:
        await engine.shutdown()
    return records


def tree_from(tree: SuffixTree, start: int, depth: int, budget: int, min_prob: float,
              ) -> list[Node]:
    """Up to `budget` nodes below `start`, most probable path first, `depth` deep at most;
    a node's parent comes before it."""
    frontier: list[tuple[float, int, int, int, int]] = []
    order = 0

    def push(node: int, parent: int, prob: float, d: int) -> None:
        nonlocal order
        if d >= depth:
            return
        for c in tree.children(node):
            p = prob * tree.count[c] / tree.count[node]
            if p >= min_prob:
                order += 1
                heapq.heappush(frontier, (-p, order, c, parent, d + 1))

    nodes: list[Node] = []
    push(start, -1, 1.0, 0)
    while frontier and len(nodes) < budget:
        neg_p, _, c, parent, d = heapq.heappop(frontier)
        nodes.append((tree.token[c], parent, -neg_p))
        push(c, len(nodes) - 1, -neg_p, d)
    return nodes


def tree_draft(tree: SuffixTree, cursor: list[int], budget: int, min_prob: float) -> list[Node]:
    """The best-scored tree over the matched suffixes (as SuffixTree.speculate scores
    chains: the sum of the nodes' probabilities)."""
    best: list[Node] = []
    best_score = 0.0
    for m in range(len(cursor) - 1, 0, -1):
        depth = min(PARAMS.num_speculative_tokens, int(m * PARAMS.max_spec_factor + 1e-6))
        if depth <= best_score:
            break
        nodes = tree_from(tree, cursor[m], depth, budget, min_prob)
        score = sum(p for _, _, p in nodes)
        if score > best_score:
            best, best_score = nodes, score
    return best


def kept_by_tree(nodes: list[Node], truth: list[int]) -> int:
    """The longest root path of `nodes` that `truth` starts with."""
    depth: dict[int, int] = {}
    longest = 0
    for i, (token, parent, _) in enumerate(nodes):
        d = 0 if parent < 0 else depth.get(parent, -1)
        if d >= 0 and d < len(truth) and truth[d] == token:
            depth[i] = d + 1
            longest = max(longest, d + 1)
    return longest


def step_draft(proposer: SuffixProposer, sample, ids: list[int], truth: list[int],
               tree_nodes: int, min_prob: float) -> tuple[int, int]:
    """(tokens kept, rows verified) of one step: a chain, or with tree_nodes > 0 a tree."""
    if tree_nodes <= 0:
        draft, _ = proposer.speculate(sample, ids)
        kept = 0
        while kept < len(draft) and kept < len(truth) and draft[kept] == truth[kept]:
            kept += 1
        return kept, len(draft)
    options = [tree_draft(tree, cursor, tree_nodes, min_prob)
               for tree, cursor in proposer.matches(sample, ids)]
    nodes = max(options, key=lambda n: sum(p for _, _, p in n))
    return kept_by_tree(nodes, truth), len(nodes)


def replay(records: list[dict], tree_nodes: int = 0, min_prob: float = 0.1) -> dict:
    """Tokens and rows a step over the timed records."""
    proposer = SuffixProposer(PARAMS)
    steps = tokens = rows = 0
    for n, rec in enumerate(records):
        out = rec["output"]
        sample = SimpleNamespace(request_id=str(n), draft_pool=None, is_finished=False,
                                 output_token_ids=out)
        i = 0
        while i < len(out):
            kept, verified = step_draft(proposer, sample, rec["prompt"] + out[:i], out[i:],
                                        tree_nodes, min_prob)
            if rec["kind"] == "timed":
                steps, tokens, rows = steps + 1, tokens + min(kept + 1, len(out) - i), \
                    rows + verified
            i += kept + 1
        sample.is_finished = True
        proposer.retire_finished()
    return {"steps": steps, "tokens_per_step": tokens / max(1, steps),
            "rows_per_step": rows / max(1, steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default="extraction")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dump", default=None, help="JSON of the outputs: read if it exists, "
                   "else written")
    args = p.parse_args()
    path = Path(args.dump) if args.dump else None
    if path is not None and path.exists():
        records = json.loads(path.read_text())
    else:
        records = asyncio.run(dump(args.prompts, args.warmup, args.num_prompts,
                                   args.output_len))
        if path is not None:
            path.write_text(json.dumps(records))
    print(f"chains: {replay(records)}")
    for nodes in (8, 12, 16):
        for min_prob in (0.1, 0.05):
            print(f"trees of {nodes} nodes, cut at {min_prob}: "
                  f"{replay(records, nodes, min_prob)}")


if __name__ == "__main__":
    main()
