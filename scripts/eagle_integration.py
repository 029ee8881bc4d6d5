"""Integration losses of an EAGLE-3 head: the engine's acceptance against the trainer's
teacher-forced accuracy on the same sequences (issue 32).

1. The engine without speculation answers N held-out chat prompts greedily: the sequences.
2. The engine with the head at k = 1 answers them again (drafting at any batch size):
   every step drafts one token after the verified context, so its acceptance rate is the
   head's first-draft accuracy as the engine runs it (aux states from chunked prefill and
   decode steps, the head's KV written while catching up, the fused C layer, bf16).
3. The trainer's own code (`trainer.step_losses`, step 0) on the same sequences: the head's
   exported weights in `TrainableEagle3`, aux states from one prefill of each whole
   sequence (`make_recorder`), whether its argmax is right at every response position.
   At k = 1 the engine drafts only some positions (after an accepted draft the target's
   own next token comes free, undrafted), so the k = 1 loop is replayed over those
   matches: the drafts it would make and accept.

Equal counts (within bf16 noise) mean no integration loss: positions, aux-state norms and
the KV the chain sees match training. Also checks that the speculative run's tokens equal
the plain run's.

    .venv/bin/python scripts/eagle_integration.py --head DIR [--num-prompts 65] \\
        [--max-tokens 320]
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


def engine_runs(head: str, chats: list, max_tokens: int, dtype: str,
                ) -> tuple[list[list[int]], list[list[int]], dict, bool]:
    """(prompt ids, greedy responses, the k = 1 run's spec-decode delta, tokens equal)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    plain = LLM(dtype=dtype).chat(chats, greedy, use_tqdm=False)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 1,
            "disable_by_batch_size": None}
    llm = LLM(dtype=dtype, speculative_config=spec)
    before = llm.stats()
    drafted = llm.chat(chats, greedy, use_tqdm=False)
    delta = spec_decode_delta(before, llm.stats())
    same = [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    return ([list(o.prompt_token_ids) for o in plain],
            [list(o.outputs[0].token_ids) for o in plain], delta, same)


def teacher_forced_matches(head: str, prompts: list[list[int]], responses: list[list[int]],
                           dtype: str) -> list[dict[int, bool]]:
    """Per sequence, {predicted position q: the head's step-0 argmax equals the token
    there}, from the trainer's own code (step_losses: origin q - 2, aux states and labels
    from one prefill of the whole sequence)."""
    arch, embed, lm_head, _ = load_target_tables(None)
    model, t2d = load_exported_head(head, arch, embed, lm_head)
    seqs = [p + r for p, r in zip(prompts, responses)]
    starts = [0]
    for s in seqs[:-1]:
        starts.append(starts[-1] + len(s))
    data = Dataset(torch.tensor([t for s in seqs for t in s]), None, None, None, starts,
                   [len(s) for s in seqs], [len(p) for p in prompts], [True] * len(seqs))
    recorder = make_recorder(bundled_model_path(), dtype, model.aux_layer_ids, 8)
    out: list[dict[int, bool]] = [{} for _ in seqs]
    bf16 = cpu_info.has_bf16_compute()
    with torch.no_grad():
        for group in make_batches(data, 4096, 0, 0, shuffle=False):
            batch = pad(data, group, recorder)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                _, matches, origins = step_losses(model, batch, t2d, 1)
            width = batch.input_ids.shape[1]
            for hit, origin in zip(matches[0].tolist(), origins[0].tolist()):
                out[group[origin // width]][origin % width + 2] = bool(hit)
    return out


def simulate_k1(matches: dict[int, bool], prompt_len: int, max_tokens: int) -> tuple[int, int]:
    """(accepted, drafts) the engine's k = 1 loop would count with these matches: the first
    draft predicts the second response token; an accepted draft at q brings the target's
    token at q + 1, so the next draft predicts q + 2, a rejected one q + 1; no draft for
    the last token max_tokens allows (usable_drafts)."""
    accepted = drafts = 0
    q = prompt_len + 1
    while q in matches and q - prompt_len <= max_tokens - 2:
        drafts += 1
        accepted += matches[q]
        q += 2 if matches[q] else 1
    return accepted, drafts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True, help="the exported head's directory")
    p.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (all)")
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    held = split_prompts()[1][:args.num_prompts]
    chats = [[{"role": "user", "content": q}] for q in held]
    prompts, responses, delta, same = engine_runs(args.head, chats, args.max_tokens,
                                                  args.dtype)
    matches = teacher_forced_matches(args.head, prompts, responses, args.dtype)
    rows = sum(len(m) for m in matches)
    accuracy = sum(sum(m.values()) for m in matches) / max(rows, 1)
    sim = [simulate_k1(m, len(p), args.max_tokens) for m, p in zip(matches, prompts)]
    sim_accepted, sim_drafts = sum(a for a, _ in sim), sum(d for _, d in sim)
    print(f"CPU: {cpu_info.cpu_model()}; flags: {' '.join(cpu_info.relevant_flags())}")
    print(f"{len(chats)} held-out prompts, {sum(map(len, responses))} greedy response "
          f"tokens; speculative tokens equal plain: {same}")
    print(f"engine, k=1: accepted {delta['num_accepted_tokens']} of {delta['num_drafts']} "
          f"drafts: {delta['acceptance_rate']:.4f}")
    print(f"trainer, step 0 teacher-forced, the engine's rows (simulated k=1 loop): "
          f"accepted {sim_accepted} of {sim_drafts} drafts: "
          f"{sim_accepted / max(sim_drafts, 1):.4f}")
    print(f"trainer, step 0 teacher-forced, every response row: {accuracy:.4f} over "
          f"{rows} rows")


if __name__ == "__main__":
    main()
