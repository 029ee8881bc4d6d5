"""Sampler draws: frequencies vs the reference distribution, and per-request seeds.

Each statistical test draws many samples in ONE step (many identical rows) from a seeded
shared generator, so it is deterministic; the chi-square threshold (p > 1e-4) would
still hold for almost every seed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from aioengine.sample import (
    CANDIDATE_SIZES,
    Sampler,
    SamplingMetadata,
    SamplingRow,
    make_generator,
)
from aioengine.sampling_params import SamplingParams
# tests/unit is on sys.path (pytest "prepend" import mode: no __init__.py here).
from test_sampler import make_logits, reference_probs

CPU = torch.device("cpu")


def chi_square_p_value(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """P(chi2 >= observed) over the tokens with nonzero expected probability."""
    support = expected_probs > 0
    expected = expected_probs[support] * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def draw(logits_row: torch.Tensor, params: SamplingParams, num_draws: int,
         use_candidates: bool | None = None, seed: int = 0) -> np.ndarray:
    """Token counts of `num_draws` samples of one row, all drawn in one step."""
    vocab = logits_row.shape[0]
    rows = [SamplingRow(params, [], []) for _ in range(num_draws)]
    metadata = SamplingMetadata.build(rows, vocab, CPU, use_candidates=use_candidates)
    sampler = Sampler(torch.Generator().manual_seed(seed))
    tokens = sampler(logits_row.expand(num_draws, vocab).clone(), metadata).sampled_token_ids
    return np.bincount(tokens.numpy(), minlength=vocab)


SMALL_VOCAB_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.8),
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.7),
    SamplingParams(min_p=0.15),
    SamplingParams(top_k=5, top_p=0.9, min_p=0.05, temperature=1.3),
    SamplingParams(presence_penalty=1.0, logit_bias={7: 4.0}),
], ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
@pytest.mark.parametrize("use_candidates", [True, False])
def test_small_vocab_frequencies_match_reference(params: SamplingParams,
                                                 use_candidates: bool) -> None:
    expected = reference_probs(SMALL_VOCAB_LOGITS.numpy(), SamplingRow(params, [], []))
    counts = draw(SMALL_VOCAB_LOGITS, params, 20_000, use_candidates)
    assert (counts[expected == 0] == 0).all(), "sampled a filtered-out token"
    assert chi_square_p_value(counts, expected) > 1e-4


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=6, temperature=0.8),  # first slice
    SamplingParams(top_p=0.8, temperature=1.5),  # a slice, top-p alone
    SamplingParams(top_k=CANDIDATE_SIZES[0] + 1, temperature=0.3),  # second slice
    SamplingParams(top_k=CANDIDATE_SIZES[-1] + 1, temperature=0.3),  # full path, topk
    SamplingParams(temperature=0.5),  # full path, no filter
])
def test_large_vocab_frequencies_match_reference(params: SamplingParams) -> None:
    logits = make_logits(1, vocab=2 * CANDIDATE_SIZES[-1], seed=3)[0]
    expected = reference_probs(logits.numpy(), SamplingRow(params, [], []))
    counts = draw(logits, params, 2000)
    assert (counts[expected == 0] == 0).all()
    # Pool the unlikely tokens into one bin so every expected count is large enough.
    likely = expected * counts.sum() >= 5
    pooled_counts = np.append(counts[likely], counts[~likely].sum())
    pooled_expected = np.append(expected[likely], expected[~likely].sum())
    assert chi_square_p_value(pooled_counts, pooled_expected) > 1e-4


@pytest.mark.parametrize("vocab", [1024, 2 * CANDIDATE_SIZES[-1]])
def test_nucleus_overflowing_candidates_samples_the_tail(vocab: int) -> None:
    # Nearly flat: the 0.6-nucleus holds ~60% of the vocabulary, past the first slice
    # (vocab 1024: caught by the second) or past every slice (full path).
    logits = torch.linspace(0.0, -0.5, vocab)
    params = SamplingParams(top_p=0.6)
    expected = reference_probs(logits.numpy(), SamplingRow(params, [], []))
    counts = draw(logits, params, 1000)
    assert (counts[expected == 0] == 0).all()
    assert counts[CANDIDATE_SIZES[0]:].sum() > 0.3 * counts.sum()  # the tail past a slice
    bins = np.arange(0, vocab, vocab // 16)  # 16 coarse bins
    pooled = np.add.reduceat(counts, bins), np.add.reduceat(expected, bins)
    assert chi_square_p_value(*pooled) > 1e-4


# --- per-request seeds -----------------------------------------------------------------

SEEDED = [SamplingParams(seed=42), SamplingParams(seed=42, top_p=0.9, temperature=1.5),
          SamplingParams(seed=42, top_k=20), SamplingParams(seed=42, min_p=0.01, top_p=0.99)]


def run_steps(batches: list[list[SamplingRow]], logits: list[torch.Tensor],
              shared_seed: int = 0) -> list[list[int]]:
    sampler = Sampler(torch.Generator().manual_seed(shared_seed))
    out = []
    for rows, step_logits in zip(batches, logits):
        metadata = SamplingMetadata.build(rows, step_logits.shape[1], CPU)
        out.append(sampler(step_logits.clone(), metadata).sampled_token_ids.tolist())
    return out


@pytest.mark.parametrize("params", SEEDED, ids=["plain", "top_p", "top_k", "min_p"])
def test_seeded_row_is_independent_of_the_batch(params: SamplingParams) -> None:
    steps = 4
    flat = make_logits(steps, seed=1) / 4  # flat enough that every draw matters
    alone_gen = make_generator(params.seed, CPU)
    alone = run_steps([[SamplingRow(params, [1], [], alone_gen)] for _ in range(steps)],
                      [flat[s:s + 1] for s in range(steps)])

    batch_gen = make_generator(params.seed, CPU)
    others = [SamplingParams(), SamplingParams(temperature=0.0, seed=7),
              SamplingParams(seed=8, top_p=0.5), SamplingParams(top_k=3)]
    batches, logits = [], []
    for s in range(steps):  # the seeded row moves around among different rows
        rows = [SamplingRow(p, [2], [], make_generator(p.seed, CPU)) for p in others]
        rows.insert(s % 5, SamplingRow(params, [1], [], batch_gen))
        noise = make_logits(5, seed=100 + s)
        noise[s % 5] = flat[s]
        batches.append(rows)
        logits.append(noise)
    in_batch = run_steps(batches, logits, shared_seed=123)
    assert [step[0] for step in alone] == [step[s % 5] for s, step in enumerate(in_batch)]


def test_different_seeds_give_different_tokens_and_same_seed_repeats() -> None:
    flat = torch.zeros(1, 5000)

    def tokens(seed: int) -> list[int]:
        gen = make_generator(seed, CPU)
        rows = [SamplingRow(SamplingParams(seed=seed), [], [], gen)]
        return [t[0] for t in run_steps([rows] * 6, [flat] * 6, shared_seed=seed + 1)]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)
    assert len(set(tokens(1))) > 1  # the generator advances between steps


def test_unseeded_rows_use_the_shared_generator() -> None:
    logits = torch.zeros(3, 5000)
    rows = [SamplingRow(SamplingParams(), [], []) for _ in range(3)]
    assert run_steps([rows], [logits], shared_seed=5) == run_steps([rows], [logits], 5)
    assert run_steps([rows], [logits], shared_seed=5) != run_steps([rows], [logits], 6)


def test_greedy_row_does_not_advance_its_generator() -> None:
    gen = make_generator(9, CPU)
    assert gen is not None
    state = gen.get_state()
    rows = [SamplingRow(SamplingParams(temperature=0.0, seed=9), [], [], gen),
            SamplingRow(SamplingParams(), [], [])]
    run_steps([rows], [make_logits(2)])
    assert torch.equal(gen.get_state(), state)
