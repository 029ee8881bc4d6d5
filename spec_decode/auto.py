"""Speculation chosen per request and step (`speculative_config {"method": "auto"}`).

Three proposers offer a draft for each request after a step:
- suffix decoding (suffix.py): the request's own tokens and recent finished outputs, with
  a score, the tokens its trees expect to be kept;
- n-gram lookup (ngram.py) where suffix decoding has nothing;
- the draft head (eagle_proposer.py, EAGLE-3), where one was given or ships for the model.

Each request keeps running estimates of how each method's drafts fared for it
(`_Estimates`): for the head and n-gram a per-token acceptance a (a geometric model: a
draft token is kept with probability a once those before it were), for suffix decoding the
ratio of tokens kept to tokens its scores promised. A new request starts from the
estimates over all requests so far (so a method that pays on this traffic is tried
first), its own observations soon outweighing them. A draft's expected gain is its expected kept tokens
less row_cost(n) per draft token (each verified row costs part of a step of n requests);
the best gain wins
if it is positive, else the request verifies no drafts this step. So a request whose
drafts stop paying stops drafting, one whose output repeats text takes suffix drafts, and
open chat takes the head's.

The head runs in steps of at most HEAD_MAX_BATCH requests. It catches up over every
prompt chunk and over the kept rows of every request but those taking a token draft
(suffix drafts on agent traffic keep several tokens a step, each a catch-up row): those
skip the head for that step, and the holes this leaves in the head's KV only lower its
later acceptance (on held-out chat, where the head's chains win most steps, acceptance
length 1.77 skipping against 1.75 not, 2026-12-07). Its chain is drafted only for the
requests that take it. Verification is exact whatever the choice, so choosing only
changes speed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from aioengine.request import Request
from aioengine.spec_decode.config import DEFAULT_HEAD_DISABLE_BY_BATCH_SIZE
from aioengine.spec_decode.eagle_proposer import EagleProposer
from aioengine.spec_decode.ngram import NgramLookup
from aioengine.spec_decode.proposer import ProposeContext, Proposer
from aioengine.spec_decode.row_cost import row_cost
from aioengine.spec_decode.suffix import SuffixProposer

# Per-token acceptance assumed before a request has drafts of its own from a method (the
# shipped head's first-token acceptance measured 0.56 on held-out chat, docs/eagle-head.md),
# held as PRIOR_WEIGHT observations' worth.
HEAD_PRIOR = 0.55
NGRAM_PRIOR = 0.5
PRIOR_WEIGHT = 2.0
# How much of a request's past each new observation keeps (recent steps count more), and
# of all requests' past (the estimates a new request starts from).
DECAY = 0.85
SHARED_DECAY = 0.98
# Steps of more requests than this run without the head (the draft-head default).
HEAD_MAX_BATCH = DEFAULT_HEAD_DISABLE_BY_BATCH_SIZE
METHODS = ("suffix", "ngram", "eagle3")  # SpeculativeConfig.draft_methods' names


@dataclass
class _Acceptance:
    """Decayed counts of kept draft tokens and of rejections (a chain stops at its first
    rejected token; a chain kept whole shows no rejection)."""

    kept: float
    rejected: float

    @classmethod
    def prior(cls, rate: float) -> _Acceptance:
        return cls(rate * PRIOR_WEIGHT, (1.0 - rate) * PRIOR_WEIGHT)

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.rejected)

    def observe(self, drafted: int, kept: int, decay: float) -> None:
        self.kept = decay * self.kept + kept
        self.rejected = decay * self.rejected + (1.0 if kept < drafted else 0.0)


@dataclass
class _SuffixRatio:
    """Decayed tokens kept of suffix drafts against the tokens their scores promised."""

    kept: float
    promised: float

    @classmethod
    def prior(cls, ratio: float) -> _SuffixRatio:
        return cls(ratio * PRIOR_WEIGHT, PRIOR_WEIGHT)

    @property
    def ratio(self) -> float:
        return self.kept / self.promised

    def observe(self, kept: int, score: float, decay: float) -> None:
        self.kept = decay * self.kept + kept
        self.promised = decay * self.promised + score


@dataclass
class _Estimates:
    """How each method's drafts fared: for one request, or for all (the shared estimates
    a new request starts from, at PRIOR_WEIGHT observations' worth)."""

    head: _Acceptance
    ngram: _Acceptance
    suffix: _SuffixRatio

    @classmethod
    def starting_from(cls, shared: _Estimates | None) -> _Estimates:
        if shared is None:
            return cls(_Acceptance.prior(HEAD_PRIOR), _Acceptance.prior(NGRAM_PRIOR),
                       _SuffixRatio.prior(1.0))
        return cls(_Acceptance.prior(shared.head.rate), _Acceptance.prior(shared.ngram.rate),
                   _SuffixRatio.prior(shared.suffix.ratio))

    def observe(self, method: str, drafted: int, kept: int, score: float,
                decay: float) -> None:
        if method == "eagle3":
            self.head.observe(drafted, kept, decay)
        elif method == "ngram":
            self.ngram.observe(drafted, kept, decay)
        elif method == "suffix":
            self.suffix.observe(kept, score, decay)


def expected_kept(rate: float, length: int) -> float:
    """Expected kept tokens of a chain of `length` drafts at per-token acceptance `rate`:
    rate + rate^2 + ... + rate^length."""
    total, p = 0.0, 1.0
    for _ in range(length):
        p *= rate
        total += p
    return total


@dataclass
class _Track:
    """One request's estimates and what it drafted last."""

    request: Request
    estimates: _Estimates = field(default_factory=lambda: _Estimates.starting_from(None))
    last_method: str | None = None
    last_score: float = 0.0


@dataclass
class _Offer:
    method: str
    tokens: list[int]
    gain: float
    score: float = 0.0


class AutoProposer(Proposer):
    def __init__(self, suffix: SuffixProposer, ngram: NgramLookup,
                 head: EagleProposer | None) -> None:
        self.suffix = suffix
        self.ngram = ngram
        self.head = head
        self.tracks: dict[str, _Track] = {}
        self.shared = _Estimates.starting_from(None)
        # Drafts handed out per method (what the tests check the choice by).
        self.chosen = dict.fromkeys(METHODS, 0)
        self._methods: dict[str, str] = {}  # the last propose's (draft_methods)

    def draft_methods(self) -> dict[str, str]:
        return self._methods

    def propose(self, ctx: ProposeContext) -> dict[str, list[int]]:
        self._observe(ctx)
        self.retire_finished()
        offers: dict[str, _Offer] = {}
        cost = row_cost(len(ctx.scheduled))
        for _, sample, tokens in ctx.samples():
            if sample.is_finished:
                continue
            offer = self._token_offer(sample, sample.all_token_ids + tokens, cost)
            if offer is not None:
                offers[sample.request_id] = offer
        if self.head is not None and len(ctx.scheduled) <= HEAD_MAX_BATCH:
            self._head_offers(ctx, offers, cost)
        drafts, self._methods = {}, {}
        for rid, offer in offers.items():
            if offer.gain > 0 and offer.tokens:
                drafts[rid] = offer.tokens
                self._methods[rid] = offer.method
                track = self.tracks[rid]
                track.last_method, track.last_score = offer.method, offer.score
                self.chosen[offer.method] += 1
        return drafts

    def _observe(self, ctx: ProposeContext) -> None:
        """What the step kept of the drafts it verified, into their requests' tracks."""
        for item in ctx.scheduled:
            track = self.tracks.get(item.request.request_id)
            if track is None or track.last_method is None or not item.spec_token_ids:
                continue
            sampled = ctx.sampled_token_ids.get(item.request.request_id) or []
            drafted, kept = len(item.spec_token_ids), max(0, len(sampled) - 1)
            for estimates, decay in ((track.estimates, DECAY), (self.shared, SHARED_DECAY)):
                estimates.observe(track.last_method, drafted, kept, track.last_score, decay)
            track.last_method = None

    def retire_finished(self) -> None:
        """Finished requests' tracks dropped, their outputs into suffix decoding's global
        tree (a request learns it finished from the request itself, as suffix.py does)."""
        for rid in [rid for rid, t in self.tracks.items() if t.request.is_finished]:
            del self.tracks[rid]
        self.suffix.retire_finished()

    def _track(self, sample: Request) -> _Track:
        track = self.tracks.get(sample.request_id)
        if track is None or track.request is not sample:
            track = self.tracks[sample.request_id] = _Track(
                sample, _Estimates.starting_from(self.shared))
        return track

    def _token_offer(self, sample: Request, token_ids: list[int],
                     cost: float) -> _Offer | None:
        """Suffix decoding's draft, or where it has none n-gram lookup's, its gain at
        `cost` tokens a row."""
        track = self._track(sample)
        tokens, score = self.suffix.speculate(sample, token_ids)
        if tokens:
            kept = score * track.estimates.suffix.ratio
            return _Offer("suffix", tokens, kept - cost * len(tokens), score)
        tokens = self.ngram.propose(token_ids)
        if tokens:
            kept = expected_kept(track.estimates.ngram.rate, len(tokens))
            return _Offer("ngram", tokens, kept - cost * len(tokens))
        return None

    def _head_offers(self, ctx: ProposeContext, offers: dict[str, _Offer],
                     cost: float) -> None:
        """The head's chains for the requests whose expected gain from them beats their
        token offer. The head catches up over every prompt chunk and every request but
        those taking a token draft: those skip the catch-up, the costly part where suffix
        drafts keep many tokens a step, leaving holes in the head's KV that only lower
        its later acceptance."""
        assert self.head is not None
        k = self.head.k
        wanted: dict[str, float] = {}
        skipped: set[str] = set()
        for item in ctx.scheduled:
            request = item.request
            if item.num_samples != 1 or request.is_finished:
                continue
            rid, track = request.request_id, self._track(request)
            gain = expected_kept(track.estimates.head.rate, k) - cost * k
            other = offers.get(rid)
            if gain > 0 and (other is None or gain > other.gain):
                wanted[rid] = gain
            elif (other is not None and other.gain > 0
                  and item.num_computed_tokens >= request.num_prompt_tokens):
                skipped.add(rid)
        chains = self.head.propose(ctx, drafting_ids=wanted, skip_ids=skipped)
        for rid, tokens in chains.items():
            offers[rid] = _Offer("eagle3", tokens, wanted[rid])
