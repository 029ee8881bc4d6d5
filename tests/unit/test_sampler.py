"""Sampler math against direct per-row NumPy computations (float64 references).

Each logits transform is checked through `compute_probs` (the exact distribution a row
samples from) and `apply_logits_processors`, against a reference written out token by
token; the statistical tests in test_sampler_stats.py check that `Sampler` really draws
from those distributions.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from aioengine.sample import (
    CANDIDATE_SIZES,
    Sampler,
    SamplingMetadata,
    SamplingRow,
    compute_probs,
    compute_prompt_logprobs,
    is_plain_greedy,
    make_generator,
)
from aioengine.sample.candidates import filter_candidates
from aioengine.sample.ops import apply_logits_processors
from aioengine.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 1000  # > CANDIDATE_SIZES[0]: rows use the first slice, the second one or the full path


def make_logits(num_rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    """Peaked rows like a language model's: a Gaussian floor plus a few strong tokens."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 2
    spikes = torch.randint(0, vocab, (num_rows, 12), generator=gen)
    return logits.scatter_add_(1, spikes, torch.rand(num_rows, 12, generator=gen) * 6 + 4)


def reference_logits(logits: np.ndarray, row: SamplingRow) -> np.ndarray:
    """Bias, min_tokens, repetition, frequency/presence: one token at a time."""
    p, out = row.params, row.output_token_ids
    x = logits.astype(np.float64).copy()
    for tok, bias in (p.logit_bias or {}).items():
        x[tok] += bias
    if len(out) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else p.all_stop_token_ids)
        for tok in banned:
            x[tok] = -np.inf
    for tok in set(row.prompt_token_ids) | set(out):
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok, count in Counter(out).items():
        x[tok] -= p.frequency_penalty * count + p.presence_penalty
    return x


def reference_probs(logits: np.ndarray, row: SamplingRow) -> np.ndarray:
    """The full pipeline for one row, written out with sorts and loops."""
    p = row.params
    x = reference_logits(logits, row)
    if p.temperature == 0:
        return np.eye(len(x))[int(np.argmax(x))]
    x = x / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    probs[probs < p.min_p * probs.max()] = 0.0
    order = np.argsort(-probs, kind="stable")
    if p.top_k > 0:
        probs[order[p.top_k:]] = 0.0
    probs /= probs.sum()
    mass = 0.0
    for tok in order if p.top_p < 1.0 else []:  # keep tokens while the mass before is < p
        if mass >= p.top_p:
            probs[tok] = 0.0
        else:
            mass += probs[tok]
    return probs / probs.sum()


def rows_for(params: list[SamplingParams], prompt_len: int = 30, output_len: int = 20,
             output_vocab: int = 50, seed: int = 0) -> list[SamplingRow]:
    rng = np.random.default_rng(seed)
    return [SamplingRow(p, rng.integers(0, V, prompt_len).tolist(),
                        rng.integers(0, output_vocab, output_len).tolist(), None) for p in params]


def check_probs(params: list[SamplingParams], *, use_candidates: bool | None = None,
                logits: torch.Tensor | None = None, rows: list[SamplingRow] | None = None) -> None:
    rows = rows or rows_for(params)
    logits = make_logits(len(rows)) if logits is None else logits
    metadata = SamplingMetadata.build(rows, logits.shape[1], CPU, use_candidates=use_candidates)
    probs = compute_probs(logits.clone(), metadata).double().numpy()
    for i, row in enumerate(rows):
        expected = reference_probs(logits[i].numpy(), row)
        np.testing.assert_array_equal(probs[i] > 0, expected > 0, err_msg=f"row {i} support")
        np.testing.assert_allclose(probs[i], expected, rtol=1e-4, atol=1e-7,
                                   err_msg=f"row {i} {row.params}")


# --- processors shared by greedy and random rows --------------------------------------

PROCESSOR_PARAMS = [
    SamplingParams(logit_bias={3: 5.0, 7: -100.0, 999: 0.5}),
    SamplingParams(min_tokens=5, stop_token_ids=[11, 12], all_stop_token_ids={2, 11, 12}),
    SamplingParams(min_tokens=5, stop_token_ids=[11], ignore_eos=True, all_stop_token_ids={2}),
    SamplingParams(min_tokens=4, stop_token_ids=[11], all_stop_token_ids={2, 11}),  # reached
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7),
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(presence_penalty=-1.5),
    SamplingParams(frequency_penalty=0.4, presence_penalty=1.0, repetition_penalty=1.2,
                   logit_bias={5: 2.0}, min_tokens=30, max_tokens=50, all_stop_token_ids={5}),
    SamplingParams(),  # untouched
]


def test_processors_match_per_token_reference() -> None:
    # 4 output tokens out of 6 ids: min_tokens=5 still bans, repeats count for penalties.
    rows = rows_for(PROCESSOR_PARAMS, output_len=4, output_vocab=6)
    logits = make_logits(len(rows))
    metadata = SamplingMetadata.build(rows, V, CPU)
    processed = apply_logits_processors(logits.clone(), metadata).double().numpy()
    for i, row in enumerate(rows):
        np.testing.assert_allclose(processed[i], reference_logits(logits[i].numpy(), row),
                                   rtol=1e-6, err_msg=str(row.params))
    np.testing.assert_array_equal(processed[-1], logits[-1].numpy())  # bit-exact when unused


def test_min_tokens_bans_exactly_the_stop_ids() -> None:
    rows = rows_for(PROCESSOR_PARAMS[1:4], output_len=4)
    processed = apply_logits_processors(make_logits(3), SamplingMetadata.build(rows, V, CPU))
    assert set(torch.nonzero(processed[0] == float("-inf")).flatten().tolist()) == {2, 11, 12}
    # ignore_eos: EOS does not stop the request, so only the explicit stop id is banned.
    assert set(torch.nonzero(processed[1] == float("-inf")).flatten().tolist()) == {11}
    assert not torch.isinf(processed[2]).any()  # 4 outputs, min_tokens=4: ban lifted


def test_repetition_penalty_uses_prompt_and_output_frequency_only_output() -> None:
    logits = torch.full((2, V), 2.0)
    logits[:, 1] = -2.0
    prompt, output = [1, 5], [5, 5, 9]
    rows = [SamplingRow(SamplingParams(repetition_penalty=2.0), prompt, output),
            SamplingRow(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
                        prompt, output)]
    out = apply_logits_processors(logits, SamplingMetadata.build(rows, V, CPU))
    assert out[0, [1, 5, 9, 0]].tolist() == [-4.0, 1.0, 1.0, 2.0]
    # frequency counts occurrences (5 twice), presence once per token; prompt-only 1 untouched
    assert out[1, [1, 5, 9, 0]].tolist() == [-2.0, 2.0 - 1.0 - 0.25, 2.0 - 0.5 - 0.25, 2.0]


# --- the distribution random rows sample from ------------------------------------------

FILTER_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7),
    SamplingParams(top_k=1),
    SamplingParams(top_k=40, temperature=0.8),
    SamplingParams(top_k=CANDIDATE_SIZES[0]),
    SamplingParams(top_k=CANDIDATE_SIZES[0] + 50),  # beyond the first slice
    SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.3, temperature=1.3),
    SamplingParams(top_p=0.95, top_k=20),
    SamplingParams(min_p=0.05),
    SamplingParams(min_p=0.2, top_k=10, top_p=0.8, temperature=0.9),
    SamplingParams(top_p=0.9, temperature=6.0),  # flat: the nucleus overflows the slice
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, repetition_penalty=1.5, frequency_penalty=1.0,
                   logit_bias={0: 3.0}, top_p=0.9),
]


@pytest.mark.parametrize("use_candidates", [True, False])
def test_filtered_distribution_matches_reference(use_candidates: bool) -> None:
    check_probs(FILTER_PARAMS, use_candidates=use_candidates)


def test_each_parameter_alone_matches_reference() -> None:
    # One row per batch: a parameter's effect cannot hide behind other rows' columns.
    for params in FILTER_PARAMS:
        check_probs([params])


def test_top_p_nucleus_boundary() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).repeat(6, 1)
    logits = probs.log()
    cases = {0.49: {0}, 0.51: {0, 1}, 0.79: {0, 1}, 0.81: {0, 1, 2}, 0.96: {0, 1, 2, 3},
             1.0: {0, 1, 2, 3}}
    params = [SamplingParams(top_p=p) for p in cases]
    rows = [SamplingRow(p, [], []) for p in params]
    for use_candidates in (True, False):
        metadata = SamplingMetadata.build(rows, 4, CPU, use_candidates=use_candidates)
        got = compute_probs(logits.clone(), metadata)
        for i, keep in enumerate(cases.values()):
            assert set(torch.nonzero(got[i]).flatten().tolist()) == keep
            expected = probs[0] * torch.tensor([t in keep for t in range(4)])
            torch.testing.assert_close(got[i], expected / expected.sum())


def test_top_k_keeps_ties_at_the_kth_value() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    rows = [SamplingRow(SamplingParams(top_k=2), [], [])]
    for use_candidates in (True, False):
        metadata = SamplingMetadata.build(rows, 5, CPU, use_candidates=use_candidates)
        got = compute_probs(logits.clone(), metadata)
        assert torch.nonzero(got[0]).flatten().tolist() == [0, 2, 3]


def test_filter_candidates_reports_a_nucleus_past_the_slice() -> None:
    logits = torch.linspace(0.0, -0.5, 1024).repeat(2, 1)  # nearly flat
    top_p = torch.tensor([[0.5], [0.05]])
    _, _, fits = filter_candidates(logits, None, top_p, CANDIDATE_SIZES[0])
    assert fits is not None and fits.tolist() == [False, True]
    _, _, fits = filter_candidates(logits, None, top_p, CANDIDATE_SIZES[1])
    assert fits is not None and fits.tolist() == [True, True]


@pytest.mark.parametrize("vocab", [CANDIDATE_SIZES[0] * 4, CANDIDATE_SIZES[-1] * 2])
def test_top_p_overflowing_the_candidates_falls_back_exactly(vocab: int) -> None:
    logits = torch.zeros(1, vocab)  # uniform: the nucleus is 90% of the vocab
    rows = [SamplingRow(SamplingParams(top_p=0.9), [], [])]
    metadata = SamplingMetadata.build(rows, logits.shape[1], CPU)
    assert metadata.candidate_rows == [0]
    probs = compute_probs(logits, metadata)
    assert int((probs > 0).sum()) == int(np.ceil(0.9 * vocab - 1e-3))
    kept = probs[probs > 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / kept.numel()))


# --- greedy, batching, logprobs ---------------------------------------------------------

def test_greedy_is_argmax_of_processed_logits() -> None:
    logits = make_logits(3)
    rows = [SamplingRow(SamplingParams(temperature=0.0), [], []),
            SamplingRow(SamplingParams(temperature=0.0, logit_bias={17: 100.0}), [], []),
            SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=100.0),
                        [int(logits[2].argmax())], [])]
    out = Sampler()(logits.clone(), SamplingMetadata.build(rows, V, CPU))
    assert out.sampled_token_ids[0] == logits[0].argmax()
    assert out.sampled_token_ids[1] == 17
    assert out.sampled_token_ids[2] == logits[2].topk(2).indices[1]
    assert out.logprobs is None and out.logprob_token_ids is None


def test_plain_greedy_rows_are_exactly_those_the_sampler_gives_the_raw_argmax() -> None:
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, min_tokens=1),
             SamplingParams(temperature=0.0, top_p=0.5, top_k=3, seed=4)]
    rows = [SamplingRow(p, [1, 2], [5]) for p in plain]
    assert all(is_plain_greedy(r) for r in rows)
    logits = make_logits(len(rows))
    out = Sampler()(logits.clone(), SamplingMetadata.build(rows, V, CPU))
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=1).tolist()
    not_plain = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0, logprobs=0),
                 SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
                 SamplingParams(temperature=0.0, min_tokens=2),
                 SamplingParams(temperature=0.0, repetition_penalty=1.1),
                 SamplingParams(temperature=0.0, frequency_penalty=0.1),
                 SamplingParams(temperature=0.0, presence_penalty=0.1)]
    assert not any(is_plain_greedy(SamplingRow(p, [1, 2], [5])) for p in not_plain)


def test_mixed_batch_rows_keep_their_own_semantics() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1),
              SamplingParams(temperature=0.0, seed=3), SamplingParams(top_p=0.9, seed=4),
              SamplingParams(temperature=0.0, top_k=5, top_p=0.1)]
    rows = rows_for(params)
    logits = make_logits(len(rows), seed=7)
    check_probs(params, rows=rows, logits=logits)
    rows = rows_for(params)
    out = Sampler()(logits.clone(), SamplingMetadata.build(rows, V, CPU))
    processed = torch.tensor(np.stack([reference_logits(logits[i].numpy(), r)
                                       for i, r in enumerate(rows)]))
    for i in (0, 1, 2, 4):  # greedy and top_k=1 rows are deterministic
        assert out.sampled_token_ids[i] == processed[i].argmax()


def test_logprobs_come_from_raw_logits_with_the_sampled_token_first() -> None:
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={5: 50.0}),
              SamplingParams(temperature=2.0, logprobs=1, repetition_penalty=2.0, seed=1),
              SamplingParams(temperature=0.0)]  # asked for none: still gets K+1 columns
    rows = rows_for(params)
    logits = make_logits(3)
    out = Sampler()(logits.clone(), SamplingMetadata.build(rows, V, CPU))
    assert out.logprob_token_ids is not None and out.logprobs is not None
    assert out.sampled_token_ranks is not None
    assert out.logprob_token_ids.shape == out.logprobs.shape == (3, 4)  # K = 3
    raw = torch.log_softmax(logits.double(), dim=1)
    for i in range(3):
        sampled = int(out.sampled_token_ids[i])
        order = torch.argsort(raw[i], descending=True).tolist()
        assert out.logprob_token_ids[i].tolist() == [sampled] + order[:3]
        torch.testing.assert_close(out.logprobs[i].double(),
                                   raw[i, out.logprob_token_ids[i]], rtol=0, atol=1e-5)
        assert int(out.sampled_token_ranks[i]) == order.index(sampled) + 1
    assert int(out.sampled_token_ids[0]) == 5 and int(out.sampled_token_ranks[0]) > 1


def test_prompt_logprobs_layout_and_values() -> None:
    logits = make_logits(6)
    targets = torch.tensor([0, 1, 2, int(logits[3].argmax()), 4, 5])
    raw = torch.log_softmax(logits.double(), dim=1)
    ids, logprobs, ranks = compute_prompt_logprobs(logits, targets, 2)
    assert ids.shape == logprobs.shape == (6, 3) and ranks.shape == (6,)
    assert ids[:, 0].tolist() == targets.tolist()
    assert ids[:, 1:].tolist() == raw.topk(2, dim=1).indices.tolist()
    torch.testing.assert_close(logprobs.double(), raw.gather(1, ids), rtol=0, atol=1e-5)
    expected_ranks = [int((raw[i] > raw[i, t]).sum()) + 1 for i, t in enumerate(targets)]
    assert ranks.tolist() == expected_ranks and ranks[3] == 1
    ids0, logprobs0, _ = compute_prompt_logprobs(logits, targets, 0)
    assert ids0.shape == logprobs0.shape == (6, 1)


def test_logits_shape_must_match_metadata() -> None:
    metadata = SamplingMetadata.build(rows_for([SamplingParams()]), V, CPU)
    with pytest.raises(ValueError, match="does not match"):
        Sampler()(torch.zeros(2, V), metadata)


def test_metadata_skips_what_no_row_needs() -> None:
    metadata = SamplingMetadata.build(rows_for([SamplingParams(temperature=0.0)] * 3), V, CPU)
    assert metadata.all_greedy and metadata.temperature is None and metadata.top_p is None
    assert metadata.repetition_penalty is None and metadata.output_penalty is None
    assert metadata.max_num_logprobs is None and metadata.logit_bias is None
    metadata = SamplingMetadata.build(rows_for([SamplingParams(top_k=5, seed=1)]), V, CPU)
    assert metadata.all_random and metadata.top_k is not None and metadata.top_p is None
    assert list(metadata.generators) == [] and metadata.candidate_rows == [0]


def test_make_generator() -> None:
    assert make_generator(None, CPU) is None
    a, b = make_generator(5, CPU), make_generator(5, "cpu")
    assert a is not None and b is not None
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
