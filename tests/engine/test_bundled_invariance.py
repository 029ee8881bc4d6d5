"""Greedy output of the bundled model does not depend on how its steps were formed, in
every weight storage (issue 29: bf16 greedy output used to change with prefix caching,
"Name three colors." giving two answers). The shipped prompts, "Name three colors." first,
each alone with prefix caching off as the reference, against batched, prefix-cached,
16-token-chunked, 6-token-chunked (decode rows) and n-gram-speculative runs. scripts/greedy_invariance.py runs the same
over 100+ prompts."""
from __future__ import annotations

import pytest

from aioengine.bench.invariance import MODES, differing, shipped_prompts

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("storage", [dict(dtype="bfloat16"), dict(quantization="int8"),
                                     dict(quantization="w8a8")],
                         ids=["bfloat16", "int8", "w8a8"])
def test_greedy_output_is_the_same_however_steps_are_formed(storage: dict) -> None:
    prompts = shipped_prompts(24)
    result = differing(prompts, storage, list(MODES), max_tokens=24)
    assert result == {mode: [] for mode in MODES}
