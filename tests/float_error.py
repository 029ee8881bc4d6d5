"""Our float32 results against a reference implementation's, judged by the exact values.

Two correct float32 computations that sum in different orders differ by their rounding, and
how much depends on the CPU's code path (MKL blocks its sums differently on Intel and AMD,
and our GEMM sums k in one sequential chain), so a fixed tolerance between the two measures
rounding luck: the same test passed on AMD EPYC and failed on an Intel Xeon. What holds on
every machine is that ours is about as close to the exact (float64) values as the
reference's own float32 run is; a real bug (a wrong scale, position, adapter or mask) is
orders of magnitude further off than that factor."""
from __future__ import annotations

import torch

ROUNDING_FACTOR = 4.0  # ours / reference float32 error seen: up to 2.7 (Intel), 2.0 (AMD)


def assert_as_exact_as(ours: torch.Tensor, ref32: torch.Tensor, exact: torch.Tensor,
                       factor: float = ROUNDING_FACTOR) -> None:
    """max |ours - exact| <= factor * max |ref32 - exact|, with a floor of a few float32
    steps of the values' scale (where the reference happens to round exactly)."""
    exact = exact.double()
    ours_err = (ours.double() - exact).abs().max().item()
    ref_err = (ref32.double() - exact).abs().max().item()
    floor = 2.0 ** -20 * max(exact.abs().max().item(), 1.0)
    assert ours_err <= max(factor * ref_err, floor), (
        f"ours is {ours_err:.3g} from the exact values, the reference's float32 run "
        f"{ref_err:.3g} (allowed: {factor}x, floor {floor:.3g})")
