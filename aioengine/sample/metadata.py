"""Per-step sampling metadata: the batch's SamplingParams turned into tensors once.

The model runner describes each row of the logits it hands the sampler with a
`SamplingRow`; `SamplingMetadata.build` packs the rows into the few tensors the sampler
needs. Every optional field is None when no row needs it, so the sampler skips that
step entirely (an all-greedy batch without logprobs is a bare argmax).

Penalties and biases touch few (row, token) positions, so they are built as sparse
edits — O(prompt + output tokens), never a dense `[N, V]` tensor.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

from aioengine.sampling_params import SamplingParams

# Random rows whose top-k/top-p support fits in the `size` most likely tokens are sampled
# from a `topk(size)` slice, trying each size in turn, instead of a full-vocabulary sort
# (CPU only; see candidates.py).
CANDIDATE_SIZES = (256, 4096)


# float32 bounds for user numbers (issue 27). A temperature of 1e308 became inf in float32
# and masked logits -inf / inf = NaN; a repetition penalty of 5e-324 became 0 and
# -inf * 0 = NaN. NaN wins argmax, so a grammar's masked token was sampled (a 500).
# Clamped, an extreme value behaves as the limit it approaches: a huge temperature is
# uniform over the allowed tokens, a tiny penalty makes seen tokens dominate.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)
# |processed logit| bound: divided by the smallest random temperature (1e-5) it stays
# finite, so no inf - inf appears downstream.
LOGIT_BOUND = 1e30


def safe_temperature(temperature: float) -> float:
    """A temperature float32 can hold (dividing finite logits by it never overflows)."""
    return min(temperature, _FLOAT32_MAX)


def safe_repetition_penalty(penalty: float) -> float:
    """A penalty float32 holds as a positive finite number (never 0 or inf)."""
    return min(max(penalty, _FLOAT32_TINY), _FLOAT32_MAX)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's own RNG, seeded from `params.seed`; None when the request has no seed.

    The runner keeps it for the request's whole life: its state advances every step the
    request samples, so a seeded request's tokens depend only on its seed and its logits.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingRow:
    """What the runner knows about one row of the logits (one sample of one request)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens this sample generated so far (penalties, min_tokens)
    generator: torch.Generator | None = None  # None = the sampler's shared RNG


def is_plain_greedy(row: SamplingRow) -> bool:
    """A greedy row that no logits processor edits and that wants no logprobs: Sampler
    gives it the argmax of the raw logits, so a step of only such rows (and no grammar)
    may take that argmax without building a SamplingMetadata (~0.1 ms of Python a step)."""
    p = row.params
    return (p.greedy and p.logprobs is None and not p.logit_bias
            and not p.reads_output_tokens and len(row.output_token_ids) >= p.min_tokens)


@dataclass
class SparseLogitEdit:
    """Distinct (row, token) positions of the logits with one value each.

    Invariant: no position appears twice, so gather-modify-scatter edits are exact.
    """

    row_indices: Tensor  # [M] int64
    token_ids: Tensor  # [M] int64
    values: Tensor  # [M] float32


@dataclass
class SamplingMetadata:
    """The batch's sampling state as tensors on the logits' device, built once per step.

    Rows are either greedy (temperature < 1e-5) or random. The `[R, 1]` columns
    (temperature, log_min_p, top_k, top_p) cover the R random rows only, in
    `random_row_indices` order; `generators`, `candidate_rows` and `full_rows` use the
    same local random-row numbering. Neutral values (temperature 1, top_k 0, top_p 1,
    log_min_p -inf) make a step a no-op for rows that do not use it. A seeded greedy row
    never advances its RNG.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    random_row_indices: Tensor | None  # [R]; None unless the batch is mixed
    temperature: Tensor | None  # [R, 1] float32; None when all exactly 1.0
    log_min_p: Tensor | None  # [R, 1] float32; None when no row uses min_p
    top_k: Tensor | None  # [R, 1] int64, 0 = off; None when no row uses top-k
    top_p: Tensor | None  # [R, 1] float32, 1 = off; None when no row uses top-p
    # Python copies of the top_k / top_p columns: routing decisions need no device sync.
    top_k_list: list[int] = field(default_factory=list)
    top_p_list: list[float] = field(default_factory=list)
    # Random rows sampled from a top-candidates slice (top-k <= CANDIDATE_SIZES[-1], or
    # top-p alone, falling back to the full path when the nucleus does not fit)...
    candidate_rows: list[int] = field(default_factory=list)
    # ...and those sampled over the whole vocabulary.
    full_rows: list[int] = field(default_factory=list)
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None  # K; None = no row wants logprobs
    logit_bias: SparseLogitEdit | None = None  # added
    min_tokens_mask: SparseLogitEdit | None = None  # set to -inf
    repetition_penalty: SparseLogitEdit | None = None  # prompt+output tokens; the factor
    output_penalty: SparseLogitEdit | None = None  # output tokens; -(freq*count + presence)

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device, *,
              use_candidates: bool | None = None) -> SamplingMetadata:
        """`use_candidates` (default: on CPU only) routes top-k/top-p rows through a
        top-candidates slice; elsewhere a full sort is cheap and needs no device sync."""
        if use_candidates is None:
            use_candidates = torch.device(device).type == "cpu"
        greedy = [row.params.greedy for row in rows]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        mixed = 0 < len(random_rows) < len(rows)
        logprob_asks = [row.params.logprobs for row in rows if row.params.logprobs is not None]
        metadata = cls(
            num_rows=len(rows), vocab_size=vocab_size,
            all_greedy=not random_rows, all_random=len(random_rows) == len(rows),
            random_row_indices=(torch.tensor(random_rows, dtype=torch.int64, device=device)
                                if mixed else None),
            temperature=None, log_min_p=None, top_k=None, top_p=None,
            max_num_logprobs=max(logprob_asks) if logprob_asks else None,
            logit_bias=_build_logit_bias(rows, device),
            min_tokens_mask=_build_min_tokens_mask(rows, device),
            repetition_penalty=_build_repetition_penalty(rows, device),
            output_penalty=_build_output_penalty(rows, device),
        )
        metadata._fill_random_columns([rows[i] for i in random_rows], device, use_candidates)
        return metadata

    def _fill_random_columns(self, rows: list[SamplingRow], device: torch.device,
                             use_candidates: bool) -> None:
        params = [row.params for row in rows]
        top_ks = [p.top_k if p.top_k < self.vocab_size else 0 for p in params]

        def column(values: list, neutral: float, dtype: torch.dtype) -> Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

        self.temperature = column([safe_temperature(p.temperature) for p in params], 1.0,
                                  torch.float32)
        min_p = column([p.min_p for p in params], 0.0, torch.float32)
        self.log_min_p = None if min_p is None else min_p.log()
        self.top_k = column(top_ks, 0, torch.int64)
        self.top_p = column([p.top_p for p in params], 1.0, torch.float32)
        self.top_k_list = top_ks
        self.top_p_list = [p.top_p for p in params]
        self.generators = {i: row.generator for i, row in enumerate(rows)
                           if row.generator is not None}
        for i, (p, k) in enumerate(zip(params, top_ks)):
            bounded = 0 < k <= CANDIDATE_SIZES[-1] or (k == 0 and p.top_p < 1.0)
            (self.candidate_rows if use_candidates and bounded else self.full_rows).append(i)


class _SparseBuilder:
    """Collects sparse logit edits as flat lists (cheaper than per-entry tuples)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.tokens: list[int] = []
        self.values: list[float] = []

    def add(self, row: int, tokens: list[int], values: list[float]) -> None:
        self.rows.extend([row] * len(tokens))
        self.tokens.extend(tokens)
        self.values.extend(values)

    def build(self, device: torch.device) -> SparseLogitEdit | None:
        if not self.rows:
            return None
        return SparseLogitEdit(
            row_indices=torch.tensor(self.rows, dtype=torch.int64, device=device),
            token_ids=torch.tensor(self.tokens, dtype=torch.int64, device=device),
            values=torch.tensor(self.values, dtype=torch.float32, device=device))


def _build_logit_bias(rows: list[SamplingRow], device: torch.device) -> SparseLogitEdit | None:
    edits = _SparseBuilder()
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            edits.add(i, list(row.params.logit_bias), list(row.params.logit_bias.values()))
    return edits.build(device)


def min_tokens_stop_ids(params: SamplingParams) -> set[int]:
    """Token ids that would end the request, hence are banned until min_tokens is reached.

    With `ignore_eos` EOS does not stop the request, so only explicit stop_token_ids
    are banned; otherwise EOS ids (in `all_stop_token_ids`) and stop_token_ids are.
    """
    explicit = set(params.stop_token_ids or ())
    if params.ignore_eos:
        return explicit
    return explicit | params.all_stop_token_ids


def _build_min_tokens_mask(rows: list[SamplingRow],
                           device: torch.device) -> SparseLogitEdit | None:
    edits = _SparseBuilder()
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            banned = sorted(min_tokens_stop_ids(row.params))
            edits.add(i, banned, [float("-inf")] * len(banned))
    return edits.build(device)


def _build_repetition_penalty(rows: list[SamplingRow],
                              device: torch.device) -> SparseLogitEdit | None:
    """HF semantics: every distinct token of prompt + output gets the row's factor."""
    edits = _SparseBuilder()
    for i, row in enumerate(rows):
        penalty = safe_repetition_penalty(row.params.repetition_penalty)
        if penalty != 1.0:
            seen = set(row.prompt_token_ids)
            seen.update(row.output_token_ids)
            edits.add(i, list(seen), [penalty] * len(seen))
    return edits.build(device)


def _build_output_penalty(rows: list[SamplingRow],
                          device: torch.device) -> SparseLogitEdit | None:
    """OpenAI semantics over output tokens only: `logit -= freq * count + presence`."""
    edits = _SparseBuilder()
    for i, row in enumerate(rows):
        freq, presence = row.params.frequency_penalty, row.params.presence_penalty
        if freq != 0.0 or presence != 0.0:
            counts = Counter(row.output_token_ids)
            edits.add(i, list(counts), [-(freq * n + presence) for n in counts.values()])
    return edits.build(device)
