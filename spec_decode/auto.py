"""Speculation chosen per request and step (`speculative_config {"method": "auto"}`).

Three proposers offer a draft for each request after a step:
- suffix decoding (suffix.py): the request's own tokens and recent finished outputs, with
  a score, the tokens its trees expect to be kept;
- n-gram lookup (ngram.py) where suffix decoding has nothing;
- the draft head (eagle_proposer.py, EAGLE-3), where one was given or ships for the model.

Each request keeps running estimates of how each method's drafts fared for it (`_Track`):
for the head and n-gram a per-token acceptance a (a geometric model: a draft token is kept
with probability a once those before it were), for suffix decoding the ratio of tokens
kept to tokens its scores promised. A draft's expected gain is its expected kept tokens
less ROW_COST per draft token (each verified row costs part of a step); the best gain wins
if it is positive, else the request verifies no drafts this step. So a request whose
drafts stop paying stops drafting, one whose output repeats text takes suffix drafts, and
open chat takes the head's.

The head runs in steps of at most HEAD_MAX_BATCH requests. It catches up over every
prompt chunk and over the kept rows of the requests that take no token draft; its chain is
drafted only for the requests that take it. A request drafted by suffix decoding (which
keeps several tokens a step, each a catch-up row) skips the head for that step: the holes
this leaves in the head's KV only lower its later acceptance. Verification is exact
whatever the choice, so choosing only changes speed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from aioengine.request import Request
from aioengine.spec_decode.config import DEFAULT_HEAD_DISABLE_BY_BATCH_SIZE
from aioengine.spec_decode.eagle_proposer import EagleProposer
from aioengine.spec_decode.ngram import NgramLookup
from aioengine.spec_decode.proposer import ProposeContext, Proposer
from aioengine.spec_decode.suffix import SuffixProposer

# What a verified draft row costs, in tokens: on the CPU a step verifying 4-5 drafts a
# request costs 1.05-1.3x a plain one (issue 52), about 0.05 of a token per row; a little
# more here, so that a draft must be clearly likely to pay.
ROW_COST = 0.1
# Per-token acceptance assumed before a request has drafts of its own from a method (the
# shipped head's first-token acceptance measured 0.56 on held-out chat, docs/eagle-head.md),
# held as PRIOR_WEIGHT observations' worth.
HEAD_PRIOR = 0.55
NGRAM_PRIOR = 0.5
PRIOR_WEIGHT = 2.0
# How much of a request's past each new observation keeps (recent steps count more).
DECAY = 0.85
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

    def observe(self, drafted: int, kept: int) -> None:
        self.kept = DECAY * self.kept + kept
        self.rejected = DECAY * self.rejected + (1.0 if kept < drafted else 0.0)


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
    """One request's running estimates and what it drafted last."""

    request: Request
    head: _Acceptance = field(default_factory=lambda: _Acceptance.prior(HEAD_PRIOR))
    ngram: _Acceptance = field(default_factory=lambda: _Acceptance.prior(NGRAM_PRIOR))
    # Tokens kept / tokens promised by suffix scores (decayed, starting at one promise kept).
    suffix_kept: float = 1.0
    suffix_promised: float = 1.0
    last_method: str | None = None
    last_score: float = 0.0

    def observe(self, drafted: int, kept: int) -> None:
        """The last step's drafts were verified: `kept` of `drafted` were kept."""
        if self.last_method == "eagle3":
            self.head.observe(drafted, kept)
        elif self.last_method == "ngram":
            self.ngram.observe(drafted, kept)
        elif self.last_method == "suffix":
            self.suffix_kept = DECAY * self.suffix_kept + kept
            self.suffix_promised = DECAY * self.suffix_promised + self.last_score
        self.last_method = None


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
        # Drafts handed out per method (for tests and the bench's report).
        self.chosen = dict.fromkeys(METHODS, 0)
        self._methods: dict[str, str] = {}  # the last propose's (draft_methods)

    def draft_methods(self) -> dict[str, str]:
        return self._methods

    def propose(self, ctx: ProposeContext) -> dict[str, list[int]]:
        self._observe(ctx)
        self.retire_finished()
        offers: dict[str, _Offer] = {}
        for _, sample, tokens in ctx.samples():
            if sample.is_finished:
                continue
            offer = self._token_offer(sample, sample.all_token_ids + tokens)
            if offer is not None:
                offers[sample.request_id] = offer
        if self.head is not None and len(ctx.scheduled) <= HEAD_MAX_BATCH:
            self._head_offers(ctx, offers)
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
            track.observe(len(item.spec_token_ids), max(0, len(sampled) - 1))

    def retire_finished(self) -> None:
        """Finished requests' tracks dropped, their outputs into suffix decoding's global
        tree (a request learns it finished from the request itself, as suffix.py does)."""
        for rid in [rid for rid, t in self.tracks.items() if t.request.is_finished]:
            del self.tracks[rid]
        self.suffix.retire_finished()

    def _track(self, sample: Request) -> _Track:
        track = self.tracks.get(sample.request_id)
        if track is None or track.request is not sample:
            track = self.tracks[sample.request_id] = _Track(sample)
        return track

    def _token_offer(self, sample: Request, token_ids: list[int]) -> _Offer | None:
        """The better of suffix decoding's draft and (where it has none) n-gram lookup's."""
        track = self._track(sample)
        tokens, score = self.suffix.speculate(sample, token_ids)
        if tokens:
            kept = score * track.suffix_kept / track.suffix_promised
            return _Offer("suffix", tokens, kept - ROW_COST * len(tokens), score)
        tokens = self.ngram.propose(token_ids)
        if tokens:
            kept = expected_kept(track.ngram.rate, len(tokens))
            return _Offer("ngram", tokens, kept - ROW_COST * len(tokens))
        return None

    def _head_offers(self, ctx: ProposeContext, offers: dict[str, _Offer]) -> None:
        """The head's chains for the requests whose expected gain from them beats their
        token offer. The head catches up over every prompt chunk and over the decode rows
        of requests without a token offer; a request that takes a token draft instead
        skips the catch-up (the costly part where suffix drafts keep many tokens a step),
        leaving holes in the head's KV that only lower its later acceptance."""
        assert self.head is not None
        k = self.head.k
        wanted: dict[str, float] = {}
        skipped: set[str] = set()
        for item in ctx.scheduled:
            request = item.request
            if item.num_samples != 1 or request.is_finished:
                continue
            rid = request.request_id
            gain = expected_kept(self._track(request).head.rate, k) - ROW_COST * k
            other = offers.get(rid)
            if gain > 0 and (other is None or gain > other.gain):
                wanted[rid] = gain
            elif (other is not None and other.gain > 0
                  and item.num_computed_tokens >= request.num_prompt_tokens):
                skipped.add(rid)
        chains = self.head.propose(ctx, drafting_ids=wanted, skip_ids=skipped)
        for rid, tokens in chains.items():
            offers[rid] = _Offer("eagle3", tokens, wanted[rid])
