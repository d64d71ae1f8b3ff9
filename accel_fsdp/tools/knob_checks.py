"""The knobs `verify` proves: for each knob a recipe turns on, a short probe of the recipe with it and one without,
whose losses and gradient norms must agree within the knob's own bound (tools/verify.py runs the probes).

A knob changes how the arithmetic runs, not what it computes; its bound says how far apart that can put two runs:
  compile              inductor's kernels add the same products in other orders and round fused elementwise
                       results once where eager rounds each op: the equivalence noise model of the precision
                       (tools/noise.py: fp32 reordering; 16 bits a unit apart at each rounded output)
  activation-offload   a saved tensor is copied byte for byte: identical on CPU (deterministic kernels), within the
                       equivalence noise model on GPUs (their kernels need not be deterministic run to run)
  fp8                  not exact (model/fp8.py): every operand of a converted matrix product rounded to float8, e4m3
                       (unit roundoff 2^-4) in the forward, e5m2 (2^-3) for the gradients. A sum of same-sign terms each
                       off by at most u relative is off by at most u, so FP8_LOSS_BOUND and FP8_GRAD_BOUND per step; a
                       bug (a layer skipped in the backward, a wrong scale) moves the loss by its whole size or more.
Each is compared over 2 optimizer steps. This module must not import torch: verify's table reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from accel_fsdp.tools.noise import equivalence_tolerance

PROBE_STEPS = 2
FP8_LOSS_BOUND = 2.0**-4
"""Relative loss difference of fp8 to bf16 per optimizer step: e4m3's unit roundoff (3 mantissa bits)."""
FP8_GRAD_BOUND = 2.0**-3
"""Relative gradient-norm difference of fp8 to bf16 per optimizer step: e5m2's unit roundoff (2 mantissa bits)."""


@dataclass(frozen=True)
class Knob:
    """A recipe key that changes how the arithmetic runs: verify runs PROBE_STEPS steps of the recipe with `key=on`
    and with `key=off`, and compares their losses and gradient norms within `tolerance`."""

    check: str
    """The check's name (verify's CHECKS); its probes are <check>-on and <check>-off."""
    key: str
    tolerance: Callable
    """(recipe, precision, device) -> ({"loss": relative, "grad_norm": relative}, the bound as the table says it)."""
    on: str = "true"
    """The key's value that turns the knob on (as `--set` takes it)."""
    off: str = "false"
    """The value it is compared with: off, or the plain precision."""

    def probes(self) -> list[tuple[str, list[str]]]:
        """The probes' names and what each sets in the recipe."""
        return [(f"{self.check}-{side}", [f"{self.key}={value}", f"training.max_steps={PROBE_STEPS}"])
                for side, value in (("on", self.on), ("off", self.off))]

    def enabled(self, recipe, precision: str) -> bool:
        """The recipe turns it on (`precision`: the run's, resolved from the recipe and the accelerate config)."""
        if self.key == "training.mixed_precision":
            return precision == self.on
        section, name = self.key.split(".")
        return str(getattr(getattr(recipe, section), name)).lower() == self.on


def run_to_run(recipe, precision: str, device: str) -> tuple[dict[str, float], str]:
    """Two runs of the same global batches whose arithmetic is ordered or rounded apart: the equivalence noise model,
    every micro-step of a rank's accumulation counted (1 rank at worst)."""
    t, plain = recipe.training, "bf16" if precision == "fp8" else precision
    tol = equivalence_tolerance(plain, t.global_batch_size * recipe.data.seq_len,
                                t.global_batch_size // t.micro_batch_size, PROBE_STEPS)
    return tol, f"loss {tol['loss']:g}, grad norm {tol['grad_norm']:g} ({plain})"


def compile_tolerance(recipe, precision: str, device: str) -> tuple[dict[str, float], str]:
    return run_to_run(recipe, precision, device)


def offload_tolerance(recipe, precision: str, device: str) -> tuple[dict[str, float], str]:
    if device == "cpu":
        return {"loss": 0.0, "grad_norm": 0.0}, "identical (CPU: copies byte for byte, deterministic kernels)"
    return run_to_run(recipe, precision, device)


def fp8_tolerance(recipe, precision: str, device: str) -> tuple[dict[str, float], str]:
    tol = {"loss": PROBE_STEPS * FP8_LOSS_BOUND, "grad_norm": PROBE_STEPS * FP8_GRAD_BOUND}
    return tol, (f"loss {tol['loss']:g}, grad norm {tol['grad_norm']:g} (fp8 vs bf16: float8's unit roundoffs, "
                 f"2^-4 and 2^-3 a step)")


KNOBS = (
    Knob("compile", "training.compile", compile_tolerance),
    Knob("activation-offload", "training.activation_offload", offload_tolerance),
    Knob("fp8", "training.mixed_precision", fp8_tolerance, on="fp8", off="bf16"),
)
"""The knobs `verify` proves, each with its own probes and bound."""
