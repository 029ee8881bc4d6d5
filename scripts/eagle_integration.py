"""Integration losses of an EAGLE-3 head: the engine's acceptance against the trainer's
teacher-forced matches on the same sequences (issue 32).

1. The engine without speculation answers N held-out chat prompts greedily: the sequences.
2. The engine with the head answers them again for each k (drafting at any batch size),
   its tokens checked equal to the plain run's: drafts, verifications and acceptances as
   the engine runs the head (aux states from chunked prefill and decode steps, the head's
   KV written while catching up and by its chain, the fused C layer, bf16).
3. The trainer's own code (`trainer.step_losses`, training-time test over k steps) on the
   same sequences: the head's exported weights in `TrainableEagle3`, aux states from one
   prefill of each whole sequence (`make_recorder`), whether draft step j's argmax is
   right at each origin. The engine's greedy loop is replayed over those matches (a chain
   whose first n drafts are right brings the target's token after them; the next chain
   starts there), giving the counts the engine should see.

Equal counts (within bf16 noise) mean no integration loss: positions, aux-state norms and
the KV the chain sees match training.

    .venv/bin/python scripts/eagle_integration.py --head DIR [--num-prompts 65] \\
        [--max-tokens 320] [--k 1,4] [--head-quantization none|int8]
"""
from __future__ import annotations

import argparse

import torch

from aioengine import LLM, SamplingParams, cpu_info
from aioengine.metrics import spec_decode_delta
from aioengine.model.default import bundled_model_path
from aioengine.spec_decode.train.dataset import Dataset, make_batches, pad
from aioengine.spec_decode.train.data import make_recorder
from aioengine.spec_decode.train.head import load_exported_head
from aioengine.spec_decode.train.prompts import split_prompts
from aioengine.spec_decode.train.trainer import load_target_tables, step_losses


def engine_runs(head: str, chats: list, max_tokens: int, dtype: str, ks: list[int],
                quantization: str,
                ) -> tuple[list[list[int]], list[list[int]], dict[int, dict], bool]:
    """(prompt ids, greedy responses, each k's spec-decode delta, every run's tokens equal
    the plain run's)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    plain = LLM(dtype=dtype).chat(chats, greedy, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in plain]
    deltas, same = {}, True
    for k in ks:
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k,
                "disable_by_batch_size": None, "quantization": quantization}
        llm = LLM(dtype=dtype, speculative_config=spec)
        before = llm.stats()
        drafted = llm.chat(chats, greedy, use_tqdm=False)
        deltas[k] = spec_decode_delta(before, llm.stats())
        same = same and [o.outputs[0].token_ids for o in drafted] == tokens
        del llm
    return ([list(o.prompt_token_ids) for o in plain], [list(t) for t in tokens], deltas,
            same)


def teacher_forced_matches(head: str, prompts: list[list[int]], responses: list[list[int]],
                           dtype: str, num_steps: int) -> list[dict[int, list[bool]]]:
    """Per sequence, {origin t: whether draft step j's argmax equals the token at t + 2 + j,
    for j = 0, 1, ... while that token exists}, from the trainer's own code (step_losses:
    training-time test, aux states and labels from one prefill of the whole sequence)."""
    arch, embed, lm_head, _ = load_target_tables(None)
    model, t2d = load_exported_head(head, arch, embed, lm_head)
    seqs = [p + r for p, r in zip(prompts, responses)]
    starts = [0]
    for s in seqs[:-1]:
        starts.append(starts[-1] + len(s))
    data = Dataset(torch.tensor([t for s in seqs for t in s]), None, None, None, starts,
                   [len(s) for s in seqs], [len(p) for p in prompts], [True] * len(seqs))
    recorder = make_recorder(bundled_model_path(), dtype, model.aux_layer_ids, 8)
    out: list[dict[int, list[bool]]] = [{} for _ in seqs]
    bf16 = cpu_info.has_bf16_compute()
    with torch.no_grad():
        for group in make_batches(data, 4096, 0, 0, shuffle=False):
            batch = pad(data, group, recorder)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                _, matches, origins = step_losses(model, batch, t2d, num_steps)
            width = batch.input_ids.shape[1]
            for step_matches, step_origins in zip(matches, origins):  # step j, in order
                for hit, origin in zip(step_matches.tolist(), step_origins.tolist()):
                    out[group[origin // width]].setdefault(origin % width, []).append(hit)
    return out


def simulate(matches: dict[int, list[bool]], prompt_len: int, max_tokens: int,
             k: int) -> tuple[int, int, int]:
    """(accepted, draft tokens, verifications) the engine's greedy loop with k drafts would
    count given these matches: the first chain starts at origin prompt_len - 1 (it predicts
    the second response token); a chain whose first n drafts are right brings the target's
    token after them, so the next starts at origin t + n + 1; no more drafts than
    max_tokens leaves room for after the step's own token (usable_drafts)."""
    accepted = drafted = verifications = 0
    t = prompt_len - 1
    while t in matches:
        room = max_tokens - (t + 2 - prompt_len) - 1
        n_drafts = min(k, room)
        if n_drafts <= 0:
            break
        chain = matches[t][:n_drafts]
        n = next((j for j, hit in enumerate(chain) if not hit), len(chain))
        accepted += n
        drafted += n_drafts
        verifications += 1
        t += n + 1
    return accepted, drafted, verifications


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True, help="the exported head's directory")
    p.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (all)")
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--k", default="1,4", help="draft lengths to check")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--head-quantization", default="none", choices=("none", "int8"),
                   help="the engine's head weights: none (the trainer's, in --dtype: the "
                        "integration check) or int8 (the engine's default on the CPU)")
    args = p.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    held = split_prompts()[1][:args.num_prompts]
    chats = [[{"role": "user", "content": q}] for q in held]
    prompts, responses, deltas, same = engine_runs(args.head, chats, args.max_tokens,
                                                   args.dtype, ks, args.head_quantization)
    matches = teacher_forced_matches(args.head, prompts, responses, args.dtype, max(ks))
    print(f"CPU: {cpu_info.cpu_model()}; flags: {' '.join(cpu_info.relevant_flags())}")
    print(f"{len(chats)} held-out prompts, {sum(map(len, responses))} greedy response "
          f"tokens; every speculative run's tokens equal the plain run's: {same}")
    print("k | side | verifications | draft tokens | accepted | acceptance rate | "
          "mean acceptance length")
    for k in ks:
        d = deltas[k]
        sim = [simulate(m, len(pr), args.max_tokens, k) for m, pr in zip(matches, prompts)]
        acc, drafted, steps = (sum(x[i] for x in sim) for i in range(3))
        for side, (a, n, v) in (("engine", (d["num_accepted_tokens"],
                                            d["num_draft_tokens"], d["num_drafts"])),
                                ("trainer replay", (acc, drafted, steps))):
            print(f"{k} | {side} | {v} | {n} | {a} | {a / max(n, 1):.4f} | "
                  f"{1 + a / max(v, 1):.3f}")
    rows = sum(len(m) for m in matches)
    first = sum(m[0] for seq in matches for m in seq.values()) / max(rows, 1)
    print(f"trainer, step 0 at every response position: {first:.4f} over {rows} rows")


if __name__ == "__main__":
    main()
