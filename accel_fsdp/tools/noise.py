"""The numeric noise model: how far two computations of the same numbers may drift apart by rounding alone.

Every float tolerance of `verify`'s checks, of the tests (tests/conftest.py) and of the benchmarks follows from it,
with the reason it applies where it is used; never from one machine's run: machines differ in kernels, so in the order
they add numbers up. docs/VERIFY.md says what it rests on.

Plain arithmetic: this module must never import torch or anything of the package.
"""

from __future__ import annotations

import math

ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
"""Unit roundoff of each compute precision (24, 8, 11 significant bits): one rounding moves a value by at most this
fraction of it. The numeric checks' tolerances follow from it, never from one machine's run: machines differ in
kernels, so in the order they add numbers up."""
FLOAT8_ROUNDOFF = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
"""Unit roundoffs of the float8 formats (3 and 2 mantissa bits). fp8 training (model/fp8.py) rounds the forward's
matrix operands to e4m3 and the backward's gradients to e5m2, each tensor on a grid scaled to its own absolute
maximum; everything else computes in bf16."""
SIGMAS = 7.0
"""Rounding errors add up like independent zero-mean draws (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019): n of
them stay within SIGMAS x sqrt(n) roundoffs, except with probability below 2n exp(-SIGMAS^2 / 2), about 5e-11 n."""


def reordered(terms: int, precision: str = "fp32") -> float:
    """Largest relative difference of two computations of one sum of `terms` terms added in different orders (relative
    to the sum where the terms share a sign, as the token losses of a batch, or do not cancel, as a gradient's large
    elements): each is within SIGMAS x sqrt(terms) roundoffs of the exact sum."""
    return 2 * SIGMAS * math.sqrt(terms) * ROUNDOFF[precision]


def adam_step_bound(beta1: float, beta2: float, steps: int) -> float:
    """The farthest bias-corrected Adam can move an element in one of its first `steps` steps, in units of lr, whatever
    the gradients: |m| / sqrt(v) <= sqrt(sum a_i^2 / b_i) over the moments' weights a and b (Cauchy-Schwarz); 1.0 for
    the first 3 steps with betas (0.9, 0.95). A gradient at the rounding floor can get this step either way."""
    worst = 0.0
    for t in range(1, steps + 1):
        a = [(1 - beta1) * beta1 ** (t - i) / (1 - beta1**t) for i in range(1, t + 1)]
        b = [(1 - beta2) * beta2 ** (t - i) / (1 - beta2**t) for i in range(1, t + 1)]
        if any(y == 0 for x, y in zip(a, b) if x):
            return math.inf
        worst = max(worst, math.sqrt(sum(x * x / y for x, y in zip(a, b) if x)))
    return worst


def equivalence_tolerance(precision: str, tokens: int, micro_steps: int, steps: int) -> dict[str, float]:
    """Relative tolerance of the losses and gradient norms of two runs that add up the same global batches differently
    (another split into micro-steps, fewer ranks, recomputed activations, nondeterministic GPU kernels) over `steps`
    optimizer steps; a step's difference carries into the next one's weights, so they add up. fp32: each step sums
    `tokens` token losses, and as many products in each gradient element, in other orders. bf16, fp16: products still
    add in fp32, but every matmul's output is rounded to the format, a unit apart at most in the two runs: a token's
    loss once, a gradient element once per micro-step it accumulates over (independent, so sqrt(micro_steps) units).
    fp8: each operand's scale is set by the largest element of the tensor a micro-step holds, so two splits round
    every operand on other grids, each within a unit of the exact value: a token's loss (a sum of same-sign terms each
    off by at most u relative is off by at most u) within 2 e4m3 units, a gradient element within 2 e5m2 units per
    micro-step. Loose (12.5% a step): the loop's exactness is best proven at bf16 (docs/VERIFY.md)."""
    if precision == "fp32":
        loss = norm = reordered(tokens)
    elif precision == "fp8":
        loss, norm = 2 * FLOAT8_ROUNDOFF["e4m3"], 2 * math.sqrt(micro_steps) * FLOAT8_ROUNDOFF["e5m2"]
    else:
        loss, norm = 2 * ROUNDOFF[precision], 2 * math.sqrt(micro_steps) * ROUNDOFF[precision]
    return {"loss": steps * loss, "grad_norm": steps * norm}


def compare_rows(a: list, b: list, tol: dict, steps: int) -> tuple[bool, float, float]:
    """Whether two runs agree within `tol`, and the largest relative differences of their losses and gradient norms
    over the first `steps` training rows (any objects with `loss` and `grad_norm`)."""
    worst = {"loss": 0.0, "grad_norm": 0.0}
    for ra, rb in zip(a[:steps], b[:steps]):
        for key in worst:
            x, y = getattr(ra, key), getattr(rb, key)
            worst[key] = max(worst[key], abs(x - y) / max(abs(y), 1e-12))
    ok = len(a) >= steps and len(b) >= steps and all(worst[k] <= tol[k] for k in worst)
    return ok, worst["loss"], worst["grad_norm"]
