"""Auto's proposer prices its offers by row_cost (spec_decode/auto.py), and the scheduler's
part rests the proposer only where rows cost enough (spec_decode/step.py): a module of its
own, so that the scheduler does not import the proposers."""
from __future__ import annotations

# What a verified draft row costs, in tokens, in a step of n requests. A decode step of n
# rows takes about t1 + c (n - 1): the weights read once, then c per row. One more row costs
# c, a token of such a step (t1 + c (n - 1)) / n: so c n / (t1 + c (n - 1)), which is
# n / (STEP_FIXED_ROWS + n - 1) with STEP_FIXED_ROWS = t1 / c. Alone a row is 1/20 of a
# token (a step verifying 4-5 drafts costs 1.05-1.3x a plain one, issue 52); with 32
# requests, 0.63: there a draft must be kept more often than not to pay for its row.
STEP_FIXED_ROWS = 20.0


def row_cost(num_requests: int) -> float:
    """A verified draft row's cost, in tokens, in a step of `num_requests` requests."""
    n = max(1, num_requests)
    return n / (STEP_FIXED_ROWS + n - 1)
