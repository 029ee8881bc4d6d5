"""The rejection sampler on synthetic distributions: whatever the drafts, the tokens it
emits are distributed as one-at-a-time sampling from the target would give them.

A verification step over k drafts d_1..d_k has k + 1 target rows p_0..p_k (p_j: the next
token after d_1..d_j). It emits its accepted drafts, then one more token, so the claim is,
for every j: among trials whose first j emitted tokens are d_1..d_j and that emit a
(j+1)-th, that token is distributed as p_j. Checked by chi-square goodness of fit over
~20000 seeded trials per case, for point-mass drafts (n-gram: q = one-hot) and for drafts
drawn per trial from a proposer distribution q (draft_probs), with targets that depend
on the drafts before them (a Markov chain over a 6-token vocabulary).

The chi-square arithmetic is in tests/chi_square.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from aioengine.sample.ops import exponential_race
from aioengine.spec_decode.rejection_sampler import VerifyRows, accept_greedy, accept_sampled

from tests.chi_square import ALPHA, chi2_sf, gof_statistic

V = 6
N_TRIALS = 20_000


# ---- synthetic verification problems -------------------------------------------------------

# Point-mass drafts: fixed drafts and rows with p(d_j) around 1/2 (so each deeper stage
# still has thousands of trials) and a zero in every row (never to be emitted).
FIXED_DRAFTS = [0, 3, 1]
FIXED_ROWS = np.array([
    [0.55, 0.15, 0.00, 0.10, 0.12, 0.08],  # p_0, d_1 = 0
    [0.05, 0.10, 0.20, 0.55, 0.00, 0.10],  # p_1, d_2 = 3
    [0.10, 0.50, 0.15, 0.00, 0.15, 0.10],  # p_2, d_3 = 1
    [0.20, 0.00, 0.30, 0.25, 0.15, 0.10],  # p_3 (the bonus row when k = 3)
])


def random_chain(rng: np.random.Generator, zeros: int) -> np.ndarray:
    """[V, V] rows of a random transition matrix: `zeros` random zeros per row, every other
    entry >= ~0.03 (so cells have expected counts well above MIN_EXPECTED)."""
    rows = rng.dirichlet(np.full(V, 1.5), size=V) + 0.03
    for row in rows:
        row[rng.choice(V, size=zeros, replace=False)] = 0.0
    return rows / rows.sum(1, keepdims=True)


def markov_problem(k: int, seed: int) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """A target p_0 [V] and tables P_j [V, V] (p_j = P_j[d_j]) for j = 1..k, and proposer
    tables Q_j [V, V] (q_j = Q_j[d_j], Q_0 repeats one row) for j = 0..k-1. Q is a mix of
    P and unrelated noise, so both p > q and p < q occur, with zeros on either side."""
    rng = np.random.default_rng(seed)
    p_tables = [random_chain(rng, 1) for _ in range(k + 1)]
    q_tables = []
    for j in range(k):
        noise = random_chain(rng, 2)
        q = 0.6 * p_tables[j] + 0.4 * noise
        q[rng.random((V, V)) < 0.1] = 0.0  # some tokens the proposer never drafts
        q[q.sum(1) == 0, 0] = 1.0
        q_tables.append(q / q.sum(1, keepdims=True))
    p0 = p_tables[0][0]
    q_tables[0] = np.repeat(q_tables[0][:1], V, axis=0)  # q_0 does not depend on anything
    return p0, p_tables[1:], q_tables


def draw(rng: np.random.Generator, rows: np.ndarray) -> np.ndarray:
    """One token per row of `rows` [N, V] (inverse CDF, vectorised)."""
    cdf = rows.cumsum(1)
    u = rng.random(len(rows))[:, None] * cdf[:, -1:]
    return np.minimum((u >= cdf).sum(1), V - 1)


def run_trials(probs: torch.Tensor, drafts: list[list[int]], draft_probs: torch.Tensor | None,
               seed: int, sampler=accept_sampled) -> list[list[int]]:
    """Trial i verifies drafts[i] over rows i*(k+1) .. i*(k+1)+k of `probs` (so every call
    after the first also exercises first_row), with one shared seeded generator."""
    k = len(drafts[0])
    gen = torch.Generator().manual_seed(seed)
    return [sampler(probs, VerifyRows(i * (k + 1), d, None,
                                      None if draft_probs is None else draft_probs[i]), gen)
            for i, d in enumerate(drafts)]


def stage_pvalues(outs: list[list[int]], drafts: np.ndarray, stage_rows: list[np.ndarray],
                  stage_groups: list[np.ndarray]) -> list[tuple[float, int]]:
    """For each stage j = 0..k: (p-value, number of trials) of the (j+1)-th emitted token
    against the target row of each trial, among trials that emitted d_1..d_j first.
    `stage_rows[j]` [G_j, V] are the possible target rows, `stage_groups[j]` [N] which row
    each trial has (trials are pooled per row; per-row statistics and dfs add up)."""
    k = drafts.shape[1]
    for out, d in zip(outs, drafts):
        assert 1 <= len(out) <= k + 1
        assert out[:-1] == d[:len(out) - 1].tolist()  # accepted drafts, then one token
    lengths = np.array([len(o) for o in outs])
    results = []
    for j in range(k + 1):
        reached = np.nonzero(lengths > j)[0]
        tokens = np.array([outs[i][j] for i in reached], dtype=np.int64)
        groups = stage_groups[j][reached]
        stat, df = 0.0, 0
        for g in np.unique(groups):
            counts = np.bincount(tokens[groups == g], minlength=V)
            s, f = gof_statistic(counts, stage_rows[j][g])
            stat, df = stat + s, df + f
        results.append((chi2_sf(stat, df) if df else 1.0, len(reached)))
    return results


def fixed_case(k: int, seed: int, sampler=accept_sampled,
               n: int = N_TRIALS) -> list[tuple[float, int]]:
    rows = torch.tensor(FIXED_ROWS[:k + 1], dtype=torch.float32)
    probs = rows.repeat(n, 1)  # [n * (k + 1), V]
    drafts = np.tile(np.array(FIXED_DRAFTS[:k]), (n, 1))
    outs = run_trials(probs, drafts.tolist(), None, seed, sampler)
    return stage_pvalues(outs, drafts, [FIXED_ROWS[j:j + 1] for j in range(k + 1)],
                         [np.zeros(n, dtype=np.int64)] * (k + 1))


def markov_case(k: int, seed: int, sampler=accept_sampled,
                n: int = N_TRIALS) -> list[tuple[float, int]]:
    p0, p_tables, q_tables = markov_problem(k, seed)
    rng = np.random.default_rng(seed + 1000)
    # The drafts themselves are drawn from q, per trial: d_1 ~ q_0, d_{j+1} ~ Q_j[d_j].
    drafts = np.zeros((n, k), dtype=np.int64)
    q_rows = np.zeros((n, k, V))
    prev = np.zeros(n, dtype=np.int64)
    for j in range(k):
        q_rows[:, j] = q_tables[j][prev]
        drafts[:, j] = prev = draw(rng, q_rows[:, j])
    assert all((q_rows[np.arange(n), j, drafts[:, j]] > 0).all() for j in range(k))
    rows = np.zeros((n, k + 1, V))
    rows[:, 0] = p0
    for j in range(1, k + 1):
        rows[:, j] = p_tables[j - 1][drafts[:, j - 1]]
    probs = torch.tensor(rows.reshape(n * (k + 1), V), dtype=torch.float32)
    draft_probs = torch.tensor(q_rows, dtype=torch.float32)
    outs = run_trials(probs, drafts.tolist(), draft_probs, seed, sampler)
    stage_rows = [p0[None]] + p_tables
    stage_groups = [np.zeros(n, dtype=np.int64)] + [drafts[:, j] for j in range(k)]
    return stage_pvalues(outs, drafts, stage_rows, stage_groups)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_point_mass_drafts_emit_the_target_distribution(k: int) -> None:
    results = fixed_case(k, seed=100 + k)
    for j, (p, n) in enumerate(results):
        assert p > ALPHA, f"stage {j}: chi-square p = {p:.2e} over {n} trials"
    assert results[-1][1] > 0.1 * N_TRIALS  # the bonus stage is well covered


@pytest.mark.parametrize("k", [1, 2, 3])
def test_drafts_drawn_from_q_emit_the_target_distribution(k: int) -> None:
    results = markov_case(k, seed=200 + k)
    for j, (p, n) in enumerate(results):
        assert p > ALPHA, f"stage {j}: chi-square p = {p:.2e} over {n} trials"
    assert results[-1][1] > 0.05 * N_TRIALS


# ---- the tests can fail: the same checks reject subtly wrong samplers ----------------------

def _residual_keeps_the_draft(probs: torch.Tensor, rows: VerifyRows,
                              generator: torch.Generator | None) -> list[int]:
    """Point-mass sampler that forgets to remove the rejected draft from p."""
    k, first = len(rows.draft_token_ids), rows.first_row
    u = torch.rand(k, generator=generator, dtype=probs.dtype)
    p_draft = probs[first:first + k].gather(
        1, torch.tensor(rows.draft_token_ids)[:, None]).squeeze(1)
    rejected = (u >= p_draft).nonzero()
    kept = int(rejected[0]) if len(rejected) else k
    token = exponential_race(probs[first + kept].clone()[None], {}, generator)
    return rows.draft_token_ids[:kept] + [int(token)]


def _residual_is_p(probs: torch.Tensor, rows: VerifyRows,
                   generator: torch.Generator | None) -> list[int]:
    """min(1, p/q) acceptance, but the token after a rejection drawn from p, not from
    max(p - q, 0): p is over-weighted where q is large."""
    k, first = len(rows.draft_token_ids), rows.first_row
    d = torch.tensor(rows.draft_token_ids)[:, None]
    u = torch.rand(k, generator=generator, dtype=probs.dtype)
    p_draft = probs[first:first + k].gather(1, d).squeeze(1)
    q_draft = rows.draft_probs.gather(1, d).squeeze(1)
    rejected = (u * q_draft >= p_draft).nonzero()
    kept = int(rejected[0]) if len(rejected) else k
    token = exponential_race(probs[first + kept].clone()[None], {}, generator)
    return rows.draft_token_ids[:kept] + [int(token)]


@pytest.mark.parametrize("case, wrong", [(fixed_case, _residual_keeps_the_draft),
                                         (markov_case, _residual_is_p)])
def test_the_checks_reject_a_wrong_residual(case, wrong) -> None:
    assert min(p for p, _ in case(2, seed=300, sampler=wrong, n=5000)) < ALPHA
    assert min(p for p, _ in case(2, seed=300, n=5000)) > ALPHA  # same trials, right sampler


# ---- determinism and generators ----------------------------------------------------------

def _sequence_of_calls(generator: torch.Generator | None, shared: torch.Generator | None,
                       draft_probs: bool) -> list[list[int]]:
    probs = torch.tensor(FIXED_ROWS, dtype=torch.float32)
    q = torch.tensor([[0.40, 0.20, 0.10, 0.10, 0.10, 0.10],
                      [0.10, 0.10, 0.10, 0.60, 0.05, 0.05],
                      [0.10, 0.70, 0.05, 0.05, 0.05, 0.05]])
    return [accept_sampled(probs, VerifyRows(0, FIXED_DRAFTS, generator,
                                             q if draft_probs else None), shared)
            for _ in range(300)]


@pytest.mark.parametrize("draft_probs", [False, True])
def test_a_seeded_generator_gives_the_same_tokens(draft_probs: bool) -> None:
    a = _sequence_of_calls(torch.Generator().manual_seed(42), None, draft_probs)
    b = _sequence_of_calls(torch.Generator().manual_seed(42), None, draft_probs)
    c = _sequence_of_calls(torch.Generator().manual_seed(43), None, draft_probs)
    assert a == b
    assert a != c
    assert len({len(x) for x in a}) > 1  # rejections at several depths: a real sequence


@pytest.mark.parametrize("draft_probs", [False, True])
def test_a_request_generator_is_used_and_the_shared_one_untouched(draft_probs: bool) -> None:
    shared = torch.Generator().manual_seed(1)
    before = shared.get_state()
    own = _sequence_of_calls(torch.Generator().manual_seed(42), shared, draft_probs)
    assert torch.equal(shared.get_state(), before)
    other_shared = torch.Generator().manual_seed(999)
    assert _sequence_of_calls(torch.Generator().manual_seed(42), other_shared,
                              draft_probs) == own
    # Without its own generator the request draws from the shared one.
    from_shared = _sequence_of_calls(None, shared, draft_probs)
    assert not torch.equal(shared.get_state(), before)
    assert from_shared == _sequence_of_calls(None, torch.Generator().manual_seed(1),
                                             draft_probs)


def test_first_row_selects_the_request_rows() -> None:
    """A request's rows packed after another's give the same tokens as alone."""
    rows = torch.tensor(FIXED_ROWS, dtype=torch.float32)
    junk = torch.softmax(torch.randn(5, V, generator=torch.Generator().manual_seed(0)), 1)
    packed = torch.cat([junk, rows])
    for seed in range(50):
        alone = accept_sampled(rows, VerifyRows(0, FIXED_DRAFTS,
                                                torch.Generator().manual_seed(seed)), None)
        after = accept_sampled(packed, VerifyRows(5, FIXED_DRAFTS,
                                                  torch.Generator().manual_seed(seed)), None)
        assert alone == after


# ---- edge cases --------------------------------------------------------------------------

def one_hot(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("draft_probs", [False, True])
def test_p_of_one_always_accepts_and_all_kept_gives_k_plus_one(k: int, draft_probs: bool) -> None:
    drafts = [4, 1, 5][:k]
    bonus = 2
    probs = one_hot(drafts + [bonus])
    # q spread over the vocabulary: p/q > 1 at the draft, accepted whatever u is.
    q = torch.full((k, V), 1.0 / V) if draft_probs else None
    gen = torch.Generator().manual_seed(3)
    for _ in range(2000):
        assert accept_sampled(probs, VerifyRows(0, drafts, None, q), gen) == drafts + [bonus]


@pytest.mark.parametrize("draft_probs", [False, True])
def test_p_of_zero_always_rejects(draft_probs: bool) -> None:
    """p_1(d_2) == 0: d_2 never kept, and the token emitted instead is never d_2 (the
    residual excludes it) but is distributed as p_1 (d_2 has no mass there anyway)."""
    rows = torch.tensor(FIXED_ROWS[:3], dtype=torch.float32)
    drafts = [0, 4]  # p_1[4] == 0
    q = None
    if draft_probs:
        q = torch.tensor([[0.6, 0.1, 0.1, 0.1, 0.05, 0.05],
                          [0.1, 0.1, 0.1, 0.1, 0.5, 0.1]])
    gen = torch.Generator().manual_seed(5)
    outs = [accept_sampled(rows, VerifyRows(0, drafts, None, q), gen)
            for _ in range(4000)]
    assert all(len(o) <= 2 for o in outs)
    second = [o[1] for o in outs if len(o) == 2]
    assert len(second) > 1000 and 4 not in second
    if not draft_probs:  # residual max(p - 1[d], 0) = p here
        stat, df = gof_statistic(np.bincount(second, minlength=V), FIXED_ROWS[1])
        assert chi2_sf(stat, df) > ALPHA


def test_q_equal_to_p_always_accepts() -> None:
    """p(d)/q(d) == 1 at every position: every draft kept, k + 1 tokens, for any u."""
    p0, p_tables, _ = markov_problem(3, seed=11)
    drafts = [int(np.argmax(p0)), 0, 0]
    drafts[1] = int(np.argmax(p_tables[0][drafts[0]]))
    drafts[2] = int(np.argmax(p_tables[1][drafts[1]]))
    probs = torch.tensor(np.stack([p0, p_tables[0][drafts[0]], p_tables[1][drafts[1]],
                                   p_tables[2][drafts[2]]]), dtype=torch.float32)
    gen = torch.Generator().manual_seed(8)
    for _ in range(2000):
        out = accept_sampled(probs, VerifyRows(0, drafts, None, probs[:3].clone()), gen)
        assert out[:3] == drafts and len(out) == 4 and probs[3, out[3]] > 0


def test_rejected_draft_never_reemitted_with_q() -> None:
    """p(d) < q(d): the token emitted after rejecting d comes from max(p - q, 0), which is
    zero at d and wherever q >= p."""
    p = torch.tensor([[0.2, 0.3, 0.1, 0.2, 0.1, 0.1], [1 / V] * V])
    q = torch.tensor([[0.6, 0.1, 0.1, 0.1, 0.05, 0.05]])
    gen = torch.Generator().manual_seed(9)
    outs = [accept_sampled(p, VerifyRows(0, [0], None, q), gen) for _ in range(4000)]
    residual = (p[0] - q[0]).clamp(min=0).numpy().astype(np.float64)
    rejected = [o[0] for o in outs if len(o) == 1]
    stat, df = gof_statistic(np.bincount(rejected, minlength=V), residual / residual.sum())
    assert chi2_sf(stat, df) > ALPHA
    # accepted w.p. p/q = 1/3
    assert abs(len(rejected) / len(outs) - 2 / 3) < 0.03


# ---- greedy ------------------------------------------------------------------------------

@pytest.mark.parametrize("argmax, drafts, first_row, expected", [
    ([5, 1, 4, 0], [5, 1, 4], 0, [5, 1, 4, 0]),  # all kept: k + 1 tokens
    ([5, 1, 4, 0], [5, 2, 4], 0, [5, 1]),  # second rejected: the target's token instead
    ([5, 1, 4, 0], [3, 1, 4], 0, [5]),  # first rejected
    ([9, 9, 2, 3], [2], 2, [2, 3]),  # another request's rows first
    ([9, 9, 2, 3], [1], 2, [2]),
    ([7, 8], [], 1, [8]),  # no drafts: just the row's argmax
])
def test_accept_greedy(argmax: list[int], drafts: list[int], first_row: int,
                       expected: list[int]) -> None:
    assert accept_greedy(argmax, drafts, first_row) == expected


def test_accept_greedy_equals_argmax_chain() -> None:
    """Against a direct definition, on random rows and drafts."""
    rng = np.random.default_rng(4)
    for _ in range(500):
        k = int(rng.integers(1, 5))
        argmax = rng.integers(0, 3, size=k + 1).tolist()
        drafts = rng.integers(0, 3, size=k).tolist()
        expected = []
        for j in range(k + 1):
            expected.append(argmax[j])
            if j == k or drafts[j] != argmax[j]:
                break
        assert accept_greedy(argmax, drafts, 0) == expected
