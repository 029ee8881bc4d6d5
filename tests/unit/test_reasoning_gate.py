"""The structured feature's reasoning gate on a real thinking tokenizer and real compiled
grammars: before the output's first `</think>` every token is allowed and none reaches the
matcher; after it the grammar constrains the answer from its first token (with the forced
tokens jumped forward); drafts across the boundary are validated and masked alike."""
from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from aioengine.request import Request, RequestStatus
from aioengine.sampling_params import SamplingParams, StructuredOutputs
from aioengine.structured import StructuredOutputManager, StructuredRequestState, StructuredStats
from thinking_models import VOCAB_SIZE, thinking_tokenizer

EOS = 2
REGEX = r'\{"a": [0-9]\}'


@pytest.fixture(scope="module")
def tok():
    return thinking_tokenizer("qwen3")


@pytest.fixture(scope="module")
def manager(tok) -> StructuredOutputManager:
    m = StructuredOutputManager(tok, VOCAB_SIZE, {EOS})
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def think(tok) -> tuple[int, int]:
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    return start, end


def state_for(manager: StructuredOutputManager, end: int | None = None,
              start: int | None = None, jump_forward: bool = True,
              regex: str = REGEX) -> StructuredRequestState:
    constraint = StructuredOutputs(regex=regex, reasoning_end_token_id=end,
                                   reasoning_start_token_id=start)
    state = manager.new_request_state(SamplingParams(structured_outputs=constraint))
    assert state is not None
    state.grammar.result(timeout=60)
    state.jump_forward = jump_forward
    state.stats = StructuredStats()  # its own counters (the manager's are shared)
    return state


def mask_of(state: StructuredRequestState, drafts: tuple[int, ...] = ()) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    bitmask.zero_()  # what a filled row must set is set by the fill itself
    state.fill_bitmask(bitmask, 0, drafts)
    return bitmask[0]


def allowed(row: torch.Tensor, token_id: int) -> bool:
    return bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_reasoning_is_free_then_the_grammar_takes_the_answer(tok, manager, think) -> None:
    _, end = think
    state = state_for(manager, end=end)
    request = Request("r", [1, 2, 3], SamplingParams())
    words = ids(tok, "Hmm, letters first")
    assert bool((mask_of(state) == -1).all())  # everything allowed, the bit-31 words too
    for token_id in words:
        assert state.advance(request, token_id, max_extra=8) == []
    assert state.stats.num_tokens_accepted == 0 and not state.is_terminated
    forced = state.advance(request, end, max_extra=8)  # the answer's forced start follows
    assert tok.decode(forced) == '{"a": '
    row = mask_of(state)
    assert allowed(row, ids(tok, "7")[0]) and not allowed(row, words[0])
    assert not allowed(row, end)
    state.advance(request, ids(tok, "7")[0], 8)
    state.advance(request, ids(tok, "}")[0], 8)
    state.advance(request, EOS, 8)
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_without_a_gate_the_grammar_starts_at_once(tok, manager) -> None:
    state = state_for(manager)
    row = mask_of(state)
    assert allowed(row, ids(tok, "{")[0]) and not allowed(row, ids(tok, "Hmm")[0])


def test_either_the_output_opens_reasoning_or_the_grammar_starts(tok, manager, think) -> None:
    start, end = think
    row = mask_of(state_for(manager, end=end, start=start))
    brace, word = ids(tok, "{")[0], ids(tok, "Hmm")[0]
    assert allowed(row, start) and allowed(row, brace) and not allowed(row, word)
    request = Request("r", [1], SamplingParams())
    opened = state_for(manager, end=end, start=start)
    assert opened.advance(request, start, 8) == []
    assert allowed(mask_of(opened), word)  # inside the reasoning now
    answered = state_for(manager, end=end, start=start, jump_forward=False)
    answered.advance(request, brace, 8)  # the answer's first token: the matcher took it
    assert answered.stats.num_tokens_accepted == 1 and not allowed(mask_of(answered), start)


def test_drafts_across_the_end_of_reasoning(tok, manager, think) -> None:
    _, end = think
    state = state_for(manager, end=end, jump_forward=False)
    reasoning, answer = ids(tok, "so"), ids(tok, '{"a"')
    drafts = [*reasoning, end, *answer, *ids(tok, "x")]
    assert state.num_valid_drafts(drafts) == len(reasoning) + 1 + len(answer)
    assert state.num_valid_drafts(reasoning) == len(reasoning)
    # With jump-forward the answer's forced start (`{"a": `) follows `</think>`: the
    # drafts stop before it.
    assert state_for(manager, end=end).num_valid_drafts(drafts) == len(reasoning)
    # The mask after drafts equals the mask of a state that took them, and the state
    # itself is unchanged (still in the reasoning, matcher untouched).
    row = mask_of(state, tuple(drafts[:-1]))
    taken = state_for(manager, end=end, jump_forward=False)
    request = Request("r", [1], SamplingParams())
    for token_id in drafts[:-1]:
        taken.advance(request, token_id, 0)
    assert torch.equal(row, mask_of(taken))
    assert not state.in_answer and state.stats.num_tokens_accepted == 0
    assert bool((mask_of(state) == -1).all())


def test_drafts_that_complete_the_answer_with_its_stop_token(tok, manager) -> None:
    """A draft chain may end with the stop token that completes the grammar (suffix and
    n-gram drafts copy it from earlier text): the row after it allows only the stop tokens
    (xgrammar refuses to fill a mask past a stop token, which failed the step), and the
    matcher is left where it was."""
    state = state_for(manager, jump_forward=False)
    drafts = tuple(ids(tok, '{"a": 7}')) + (EOS,)
    assert state.num_valid_drafts(drafts) == len(drafts)
    before = mask_of(state)
    after = mask_of(state, drafts)
    assert allowed(after, EOS) and int(after.count_nonzero()) == 1
    assert not allowed(mask_of(state, drafts[:-1]), drafts[0])  # inside: the grammar's mask
    assert allowed(mask_of(state, drafts[:-1]), EOS)
    assert torch.equal(mask_of(state), before)


def test_drafts_stop_before_a_token_that_forced_tokens_follow(tok, manager) -> None:
    """The step after a draft that jump-forward tokens follow ends the request's run
    there, and a seeded request would draw for the rows after it where sampling without
    drafts appends the forced tokens undrawn: the drafts stop before that token. The
    room left decides, as it decides the jump itself."""
    regex = r"[a-z][a-z]=ok"
    drafts = ids(tok, "q") + ids(tok, "r") + ids(tok, "=ok")
    free = state_for(manager, regex=regex, jump_forward=False)
    assert free.num_valid_drafts(drafts) == len(drafts)
    state = state_for(manager, regex=regex)
    assert state.num_valid_drafts(drafts) == 1  # "r" is followed by the forced "=ok"
    assert state.num_valid_drafts(drafts, room=3) == 1  # a token fits after "r": it jumps
    # None does (the request ends at "r"): nothing is forced, every draft is valid (the
    # scheduler keeps no more drafts than the room anyway).
    assert state.num_valid_drafts(drafts, room=2) == len(drafts)
    request = Request("r", [1], SamplingParams())
    assert state.advance(request, drafts[0], 8) == []
    assert state.advance(request, drafts[1], 8) == drafts[2:]  # what the draft was cut for
