"""aioengine.structured on the bundled tokenizer: compile cache, matcher state,
jump-forward, the step bitmask, the scheduler's readiness seam, and request parsing."""
from __future__ import annotations

import json
import threading
from concurrent.futures import Future

import pytest
import torch

from aioengine.config import SchedulerConfig
from aioengine.kv.kv_cache_manager import KVCacheManager
from aioengine.sched.scheduler import Scheduler
from aioengine.sched.scheduler_output import ModelRunnerOutput
from aioengine.request import Request, RequestStatus
from aioengine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputs
from aioengine.server.protocol import (ApiError, get_structured_outputs,
                                       structured_outputs_field)
from aioengine.structured import (GrammarBitmask, GrammarCompileError, StructuredOutputManager,
                                  StructuredRequestState)

VOCAB = 49152
EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"]}


@pytest.fixture(scope="module")
def manager(bundled_tokenizer) -> StructuredOutputManager:
    m = StructuredOutputManager(bundled_tokenizer, VOCAB, {EOS})
    yield m
    m.shutdown()


def state_for(manager: StructuredOutputManager, **constraint: object) -> StructuredRequestState:
    params = SamplingParams(structured_outputs=StructuredOutputs(**constraint))
    state = manager.new_request_state(params)
    assert state is not None
    state.grammar.result(timeout=30)
    return state


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ---- StructuredOutputs ---------------------------------------------------------------------

@pytest.mark.parametrize("fields", [{}, {"regex": "a", "choice": ["a"]},
                                    {"json": SCHEMA, "json_object": True}])
def test_exactly_one_constraint(fields: dict) -> None:
    with pytest.raises(SamplingParamsError, match="exactly one") as e:
        StructuredOutputs(**fields)
    assert e.value.param == "structured_outputs"


@pytest.mark.parametrize("fields,match", [
    ({"json": "{not json"}, "not valid JSON"), ({"json": [1]}, "must be a JSON object"),
    ({"structural_tag": "[1]"}, "must be a JSON object"),
    ({"choice": []}, "non-empty list"), ({"choice": "yes"}, "list"),
    ({"choice": ["a", ""]}, "list"),
    ({"regex": 5}, "non-empty string"), ({"grammar": 3}, "non-empty string")])
def test_malformed_constraints(fields: dict, match: str) -> None:
    with pytest.raises(SamplingParamsError, match=match):
        StructuredOutputs(**fields)


def test_key_ignores_json_text_and_key_order() -> None:
    a = StructuredOutputs(json='{"type": "object", "required": ["x"]}')
    b = StructuredOutputs(json={"required": ["x"], "type": "object"})
    assert a.key == b.key and a.json == b.json
    assert StructuredOutputs(choice=["a", "b"]).key == ("choice", ("a", "b"))
    assert StructuredOutputs(regex="a").key != StructuredOutputs(grammar="a").key


# ---- compile cache -------------------------------------------------------------------------

def test_compile_is_cached_by_constraint(manager: StructuredOutputManager) -> None:
    before = len(manager.compiler.compile_seconds)
    c = StructuredOutputs(regex=r"[0-9]{2}-cache")
    f1 = manager.compiler.submit(c)
    f2 = manager.compiler.submit(StructuredOutputs(regex=r"[0-9]{2}-cache"))
    assert f1 is f2
    manager.compile(c)
    assert len(manager.compiler.compile_seconds) == before + 1


@pytest.mark.parametrize("fields,match", [
    ({"regex": "(abc"}, "invalid regex: .*parenthesis"),
    ({"json": {"type": 5}}, "invalid JSON schema: "),
    ({"grammar": 'root ::= "a" | '}, "invalid grammar: .*EBNF"),
    ({"grammar": "root ::= undefined_rule"}, "invalid grammar: .*not defined"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}},
     "invalid structural tag: ")])
def test_invalid_constraints_fail_to_compile(manager: StructuredOutputManager, fields: dict,
                                             match: str) -> None:
    with pytest.raises(GrammarCompileError, match=match) as e:
        manager.compile(StructuredOutputs(**fields))
    assert e.value.param == "structured_outputs"
    assert "/project/" not in str(e.value)  # xgrammar's source location is stripped


async def test_compile_async_raises_the_same_error(manager: StructuredOutputManager) -> None:
    await manager.compile_async(StructuredOutputs(regex="[ab]+"))
    with pytest.raises(GrammarCompileError):
        await manager.compile_async(StructuredOutputs(regex="[ab"))


# ---- matcher state -------------------------------------------------------------------------

def test_choice_grammar_accepts_exactly_the_choices(manager: StructuredOutputManager) -> None:
    choices = ['say "hi"', "back\\slash", "yes"]
    for text in choices + ["ye", 'say "hi"!', "no"]:
        m = state_for(manager, choice=choices).matcher
        ok = m.accept_string(text) and m.is_completed()
        assert ok == (text in choices), text


def test_jump_forward_then_complete_with_eos(manager: StructuredOutputManager,
                                             bundled_tokenizer) -> None:
    state = state_for(manager, json=SCHEMA)
    request = Request("r", [1, 2], SamplingParams(max_tokens=50),
                      feature_state={manager.name: state})
    jumped = state.jump_forward_tokens(max_tokens=50)
    assert bundled_tokenizer.decode(jumped) == '{"name": "'
    for token in encode(bundled_tokenizer, 'Al'):
        assert state.advance(request, token, 50) == []  # free text: nothing forced
    quote = encode(bundled_tokenizer, '"')[0]
    forced = state.advance(request, quote, 50)
    assert bundled_tokenizer.decode(forced) == ', "ok": '
    for token in encode(bundled_tokenizer, 'true'):
        forced = state.advance(request, token, 50)
    assert bundled_tokenizer.decode(forced) == "}"
    assert not state.is_terminated and request.status == RequestStatus.WAITING
    assert state.advance(request, EOS, 50) == []
    assert state.is_terminated and request.status == RequestStatus.FINISHED_STOPPED
    assert state.stats.num_jump_forward_tokens >= len(jumped) + 2


def test_jump_forward_respects_the_limit_and_switch(manager: StructuredOutputManager) -> None:
    state = state_for(manager, json=SCHEMA)
    assert len(state.jump_forward_tokens(max_tokens=1)) == 1
    state = state_for(manager, json=SCHEMA)
    state.jump_forward = False
    assert state.jump_forward_tokens(max_tokens=50) == []


def test_rejected_token_fails_the_request(manager: StructuredOutputManager,
                                          bundled_tokenizer) -> None:
    state = state_for(manager, regex="[0-9]+")
    request = Request("r", [1], SamplingParams(), feature_state={manager.name: state})
    state.advance(request, encode(bundled_tokenizer, "x")[0], 10)
    assert request.status == RequestStatus.FINISHED_ERROR
    assert "does not match" in request.error


def test_logprobs_requests_get_no_jump_forward(manager: StructuredOutputManager) -> None:
    so = StructuredOutputs(json=SCHEMA)
    assert manager.new_request_state(SamplingParams(structured_outputs=so)).jump_forward
    assert not manager.new_request_state(
        SamplingParams(structured_outputs=so, logprobs=0)).jump_forward
    assert manager.new_request_state(SamplingParams()) is None


# ---- bitmask -------------------------------------------------------------------------------

def test_bitmask_masks_only_constrained_rows(manager: StructuredOutputManager,
                                             bundled_tokenizer) -> None:
    digits = state_for(manager, regex="[0-9]")
    yes_no = state_for(manager, choice=["yes", "no"])
    bitmask = GrammarBitmask([digits, None, yes_no], VOCAB)
    bitmask.fill()
    logits = torch.randn(3, VOCAB)
    original = logits.clone()
    bitmask.apply(logits)
    allowed = [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]
    assert {bundled_tokenizer.decode([t]) for t in allowed[0]} == set("0123456789")
    assert torch.equal(logits[1], original[1])
    texts = {bundled_tokenizer.decode([t]) for t in allowed[2]}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    for row in (0, 2):  # allowed logits are untouched
        idx = sorted(allowed[row])
        assert torch.equal(logits[row, idx], original[row, idx])


def test_eos_only_where_the_grammar_may_end(manager: StructuredOutputManager,
                                            bundled_tokenizer) -> None:
    state = state_for(manager, regex="[0-9]{2}")
    request = Request("r", [1], SamplingParams())
    for text, eos_allowed in (("", False), ("4", False), ("2", True)):
        if text:
            state.advance(request, encode(bundled_tokenizer, text)[0], 0)
        bitmask = GrammarBitmask([state], VOCAB)
        bitmask.fill()
        logits = torch.zeros(1, VOCAB)
        bitmask.apply(logits)
        assert (logits[0, EOS] == 0) == eos_allowed


def test_apply_waits_for_fill_from_another_thread(manager: StructuredOutputManager) -> None:
    bitmask = GrammarBitmask([state_for(manager, regex="[0-9]")], VOCAB)
    logits = torch.zeros(1, VOCAB)
    done = threading.Event()

    def worker() -> None:
        bitmask.apply(logits)
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    assert not done.wait(0.2)  # the worker is blocked until the loop fills the mask
    bitmask.fill()
    thread.join(10)
    assert done.is_set() and int((logits[0] == 0).sum()) >= 10


def test_a_failed_fill_fails_the_step_not_the_loop() -> None:
    broken: Future = Future()
    broken.set_exception(RuntimeError("no grammar"))
    state = StructuredRequestState(grammar=broken, encode=lambda s: [], jump_forward=False)
    bitmask = GrammarBitmask([state], VOCAB)
    bitmask.fill()  # never raises on the loop
    with pytest.raises(RuntimeError, match="filling the grammar bitmask failed"):
        bitmask.apply(torch.zeros(1, VOCAB))


# ---- scheduler seam ------------------------------------------------------------------------

def make_request(rid: str, structured: StructuredRequestState | None = None,
                 arrival: float = 0.0) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    params.all_stop_token_ids = {EOS}
    state = {} if structured is None else {StructuredOutputManager.name: structured}
    return Request(rid, [10, 11, 12], params, arrival_time=arrival, feature_state=state)


def test_scheduler_skips_a_request_whose_grammar_is_compiling(
        manager: StructuredOutputManager) -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=128),
                          KVCacheManager(16, 4), (manager,))
    pending: Future = Future()
    state = StructuredRequestState(grammar=pending, encode=lambda s: [], jump_forward=False)
    scheduler.add_request(make_request("slow", state, arrival=0.0))
    scheduler.add_request(make_request("plain", arrival=1.0))
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["plain"]
    assert [r.request_id for r in scheduler.waiting] == ["slow"]
    scheduler.update_from_output(out, ModelRunnerOutput({"plain": [7]}))
    pending.set_exception(GrammarCompileError("invalid regex: x", "structured_outputs"))
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["plain"]
    assert [r.request_id for r in scheduler.newly_failed] == ["slow"]
    failed = scheduler.newly_failed[0]
    assert failed.status == RequestStatus.FINISHED_ERROR and "invalid regex" in failed.error
    scheduler.kv_cache_manager.check_integrity()


def test_scheduler_appends_jump_forward_tokens_as_one_chunk(manager: StructuredOutputManager,
                                                             bundled_tokenizer) -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=128),
                          KVCacheManager(32, 4), (manager,))
    request = make_request("j", state_for(manager, json=SCHEMA))
    request.sampling_params.max_tokens = 40
    scheduler.add_request(request)
    out = scheduler.schedule()
    brace = encode(bundled_tokenizer, "{")[0]
    outputs = scheduler.update_from_output(out, ModelRunnerOutput({"j": [brace]}))
    assert bundled_tokenizer.decode(outputs[0].new_token_ids) == '{"name": "'
    assert request.output_token_ids == outputs[0].new_token_ids
    out = scheduler.schedule()
    assert out.scheduled[0].num_new_tokens == len(outputs[0].new_token_ids)


# ---- request parsing (server) --------------------------------------------------------------

@pytest.mark.parametrize("body,expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                  "strict": True}}},
     StructuredOutputs(json=SCHEMA)),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputs(regex="[a-z]+")),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputs(json=SCHEMA)),
    ({"guided_choice": ["a", "b"]}, StructuredOutputs(choice=["a", "b"])),
    ({"guided_regex": "x+"}, StructuredOutputs(regex="x+")),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputs(grammar='root ::= "a"')),
    ({}, None)])
def test_request_fields_map_to_one_constraint(body: dict, expected) -> None:
    assert get_structured_outputs(body) == expected


@pytest.mark.parametrize("body,param,match", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "one output constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "one output constraint"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be 'text'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_choice": "a"}, "guided_choice", "list of strings"),
    ({"structured_outputs": {"grammar_lark": "start: x"}}, "structured_outputs",
     "not supported"),
    ({"structured_outputs": {"structural_tag": "{oops"}}, "structured_outputs",
     "not valid JSON")])
def test_bad_request_fields_are_400s(body: dict, param: str, match: str) -> None:
    with pytest.raises(ApiError, match=match) as e:
        get_structured_outputs(body)
    assert e.value.status == 400 and e.value.param == param


def test_the_field_named_in_compile_errors() -> None:
    assert structured_outputs_field({"response_format": {"type": "text"},
                                     "guided_regex": "("}) == "guided_regex"
    assert structured_outputs_field({"response_format": {"type": "json_object"}}) == \
        "response_format"
    assert structured_outputs_field({"temperature": 0}) is None
