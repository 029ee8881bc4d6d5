"""SamplingParams' facts that other modules decide by: `reads_output_tokens` (the scheduler's
steps ahead and the sampler's argmax shortcut both follow it)."""
from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from aioengine.sample import SamplingMetadata, SamplingRow, compute_probs, is_plain_greedy
from aioengine.sampling_params import SamplingParams, StructuredOutputs

CPU = torch.device("cpu")
V = 1000

# A value other than the default for every SamplingParams field. A new field fails
# test_every_field_has_a_probe until it gets one here, and then the test below checks
# whether the sampler reads the output tokens under it.
PROBES = {
    "n": 2,
    "temperature": 0.0,
    "top_p": 0.5,
    "top_k": 5,
    "min_p": 0.05,
    "presence_penalty": 1.5,
    "frequency_penalty": 1.5,
    "repetition_penalty": 1.5,
    "logit_bias": {3: 5.0},
    "seed": 7,
    "max_tokens": 8,
    "min_tokens": 8,  # counts the output tokens, which both histories below have as many of
    "stop": ["x"],
    "stop_token_ids": [9],
    "ignore_eos": True,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "logprobs": 2,
    "prompt_logprobs": 2,
    # The grammar reads the output through its feature (allows_schedule_ahead), not the sampler.
    "structured_outputs": StructuredOutputs(regex="a+"),
    "all_stop_token_ids": {9, 10},
}


def test_every_field_has_a_probe() -> None:
    assert set(PROBES) == {f.name for f in fields(SamplingParams)}


def _peaked_logits() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=gen) * 2
    spikes = torch.randint(0, V, (12,), generator=gen)
    return logits.scatter_add_(0, spikes, torch.rand(12, generator=gen) * 6 + 4)


@pytest.mark.parametrize("name", sorted(PROBES))
def test_reads_output_tokens_is_what_the_sampler_reads(name: str) -> None:
    """Two rows alike but for which tokens they generated (as many each, among the likely
    ones): the sampler's distributions differ exactly when reads_output_tokens says so."""
    params = SamplingParams(**{name: PROBES[name]})
    logits = _peaked_logits()
    ranked = logits.argsort(descending=True).tolist()
    prompt = ranked[20:23]
    histories = (ranked[0:3] + ranked[0:1], ranked[3:6] + ranked[3:4])
    rows = [SamplingRow(params, prompt, list(h)) for h in histories]
    metadata = SamplingMetadata.build(rows, V, CPU)
    probs = compute_probs(logits.repeat(2, 1), metadata)
    assert (not torch.allclose(probs[0], probs[1], atol=1e-6)) == params.reads_output_tokens
    if params.reads_output_tokens:
        greedy = SamplingParams(**{name: PROBES[name], "temperature": 0.0})
        assert not is_plain_greedy(SamplingRow(greedy, prompt, list(histories[0])))


def test_no_penalty_reads_nothing() -> None:
    assert not SamplingParams().reads_output_tokens
    assert not SamplingParams(temperature=0.0, logit_bias={1: 2.0}, min_tokens=4,
                              max_tokens=8).reads_output_tokens
