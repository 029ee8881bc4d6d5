"""The engine's features through one protocol (aioengine.engine.features): which features an
engine has and in what order, that admission loops over them (typed state in
Request.feature_state), that the runner runs every feature's worker hooks around each
forward (also a failing one), and that stats() is the features' numbers and the
speculative step's."""
from __future__ import annotations

from pathlib import Path

import pytest

from aioengine.engine.features import EngineFeature, feature_stats
from aioengine.engine.llm import LLM
from aioengine.lora.manager import LoRAManager
from aioengine.request import RequestStatus
from aioengine.sampling_params import SamplingParams, StructuredOutputs
from aioengine.structured import StructuredOutputManager, structured_state

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


class Recorder(EngineFeature):
    """Records the worker hooks it is given, and can fail its begin_execute."""
    name = "recorder"

    def __init__(self, log: list[tuple[str, str, int]], fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def begin_execute(self, scheduler_output) -> None:
        self.log.append((self.name, "begin", scheduler_output.step_id))
        if self.fail:
            raise RuntimeError("begin failed")

    def end_execute(self, scheduler_output) -> None:
        self.log.append((self.name, "end", scheduler_output.step_id))

    def get_stats(self) -> dict[str, float]:
        return {"recorder_entries": len(self.log)}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, enable_lora=True,
               max_lora_rank=8, speculative_config=NGRAM)


def test_features_in_order_and_their_stats(llm: LLM) -> None:
    core = llm.core
    assert [type(f) for f in core.features] == [StructuredOutputManager, LoRAManager]
    assert core.features[1] is core.lora and core.runner.features == core.features
    assert core.spec_decode.enabled  # part of the step, not a feature
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], GREEDY)
    stats = core.stats()
    by_feature = feature_stats(core.features)
    assert {k: stats[k] for k in by_feature} == by_feature
    assert {"structured_requests", "lora_num_registered"} <= by_feature.keys()
    assert "spec_decode_num_drafts" in stats
    # The speculative step reports the scheduler's live counters.
    assert core.scheduler.spec_decode.counters is core.spec_decode.counters
    before = core.stats()["spec_decode_num_accepted_tokens_per_pos_0"]
    core.scheduler.spec_decode.observe(2, 1)
    assert core.stats()["spec_decode_num_accepted_tokens_per_pos_0"] == before + 1


def test_admission_loops_over_the_features(llm: LLM) -> None:
    """Each sample gets every applying feature's state under its name, and the features
    decide whether it may be drafted as a tree."""
    core = llm.core
    regex = SamplingParams(max_tokens=2, temperature=0.0, n=2,
                           structured_outputs=StructuredOutputs(regex="[0-9]+"))
    constrained = core.add_request("c", [3, 4, 5], regex)
    plain = core.add_request("p", [3, 4, 5], GREEDY)
    try:
        states = [structured_state(s) for s in constrained]
        assert all(s is not None for s in states) and states[0] is not states[1]
        assert [set(s.feature_state) for s in constrained] == [{"structured"}] * 2
        assert not any(s.allows_tree_drafts for s in constrained)
        assert plain[0].feature_state == {} and plain[0].allows_tree_drafts
    finally:
        core.finish_requests(constrained + plain, RequestStatus.FINISHED_ABORTED)


def test_runner_runs_the_worker_hooks_around_each_forward(llm: LLM) -> None:
    runner, log = llm.core.runner, []
    runner.features = (*llm.core.features, Recorder(log))
    try:
        llm.generate([[9, 8, 7]], GREEDY)
    finally:
        runner.features = llm.core.features
    steps = [step for _, _, step in log[::2]]
    assert steps and log == [e for s in steps for e in (("recorder", "begin", s),
                                                        ("recorder", "end", s))]


def test_a_failing_hook_ends_only_the_features_begun(llm: LLM, monkeypatch) -> None:
    """A feature whose begin_execute raises fails the step: those begun before it are
    ended (LoRA's slots cleared), those after it never begin; the forward does not run."""
    core, log = llm.core, []
    first, failing, last = Recorder(log), Recorder(log, fail=True), Recorder(log)
    first.name, failing.name, last.name = "first", "failing", "last"
    ran = []
    monkeypatch.setattr(core.runner, "_execute", lambda *a: ran.append(a))
    core.runner.features = (first, failing, last)
    try:
        samples = core.add_request("r", [3, 4, 5], GREEDY)
        output = core.schedule()
        with pytest.raises(RuntimeError, match="begin failed"):
            core.execute(output)
    finally:
        core.runner.features = core.features
        core.finish_requests(samples, RequestStatus.FINISHED_ABORTED)
    step = output.step_id
    assert log == [("first", "begin", step), ("failing", "begin", step),
                   ("first", "end", step)]
    assert ran == []
