"""The knobs `verify` proves: recipe keys that change how a run's arithmetic goes, not what it computes (or, for an
inexact knob, only within a bound of its own). For each knob a recipe turns on, verify runs PROBE_STEPS steps of the
recipe as it is (<check>-on) and as many with the key at the knob's `off` value (<check>-off), and their losses and
gradient norms must agree within the knob's tolerance (tools/verify.py runs the probes and reports `Knob.judge`).
A new knob is one entry of KNOBS: its key, its off value, its tolerance; verify's CHECKS take their names from here.

Each bound says how far the knob can put two runs apart:
  chunked-loss         the same products and sums as the full logits in other orders: the equivalence noise model
                       (tools/noise.py); in 16 bits the hidden states' gradient is summed over the backward's
                       vocabulary blocks, each block's share rounded once: like micro-steps, so micro-steps x blocks
  compile              inductor's kernels add the same products in other orders and round fused elementwise
                       results once where eager rounds each op: the equivalence noise model of the precision
  activation-offload   a saved tensor is copied byte for byte: identical on CPU (deterministic kernels), within the
                       equivalence noise model on GPUs (their kernels need not be deterministic run to run)
  fp8                  not exact (model/fp8.py): every operand of a converted matrix product rounded to float8, e4m3
                       (unit roundoff 2^-4) in the forward, e5m2 (2^-3) for the gradients. A sum of same-sign terms each
                       off by at most u relative is off by at most u, so FP8_LOSS_BOUND and FP8_GRAD_BOUND per step; a
                       bug (a layer skipped in the backward, a wrong scale) moves the loss by its whole size or more.
  quantize             not exact (model/quantize.py): the base's block projections in NF4 against the same LoRA on
                       the 16-bit base. NF4 moves a normally distributed weight by NF4_RMS_ERROR of the weights' rms
                       (QLoRA's premise: pretrained weights are normal; the 16 levels and blocks of 64 fix it). Such
                       errors, zero-mean and independent of a product's input, move its output by the same fraction;
                       a block's two products in sequence (attention's input projections then its output one; the
                       MLP's in, then out) by sqrt(2) of it, and the blocks' updates add to the residual stream
                       independently, so the logits, and the activations the adapters' gradients are made of, move
                       by sqrt(2) x NF4_RMS_ERROR whatever the depth; the loss and the gradient norm by as much
                       (first order), per step: QUANTIZE_BOUND a step. A scrambled code or scale moves a weight by its
                       whole size.
The exact knobs of an fp8 recipe are held to bf16's noise model, the precision of everything outside the blocks'
float8 products; that a float8 rounding downstream can widen a bf16 unit of difference is not modelled.

This module must not import torch: verify's table reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from accel_fsdp.config.precision import FP8
from accel_fsdp.model.facts import facts_for, loss_chunk_tokens
from accel_fsdp.tools.noise import FLOAT8_ROUNDOFF, compare_rows, equivalence_tolerance

PROBE_STEPS = 2
FP8_LOSS_BOUND = FLOAT8_ROUNDOFF["e4m3"]
"""Relative loss difference of fp8 to bf16 per optimizer step: e4m3's unit roundoff (3 mantissa bits)."""
FP8_GRAD_BOUND = FLOAT8_ROUNDOFF["e5m2"]
"""Relative gradient-norm difference of fp8 to bf16 per optimizer step: e5m2's unit roundoff (2 mantissa bits)."""
FP8_BASELINE = "bf16"
"""The precision fp8 computes in outside the blocks' float8 products (config/precision.py), and is compared with."""

NF4_RMS_ERROR = 0.1
"""Relative rms error of NF4 on normally distributed weights: 0.092 for blocks of 64 with torchao's levels and
double-quantized scales (tests/test_knob_checks.py quantizes normal weights with torchao and holds it under 0.1); a
property of the format, not of a machine."""
QUANTIZE_BOUND = math.sqrt(2) * NF4_RMS_ERROR
"""Relative loss and gradient-norm difference of a 4-bit base to the 16-bit one per optimizer step (the module
docstring derives it)."""


@dataclass(frozen=True)
class Knob:
    """A recipe key whose probes verify runs: the recipe as it is, and with `key=off`, PROBE_STEPS steps each."""

    check: str
    """The check's name (verify's CHECKS); its probes are <check>-on and <check>-off."""
    key: str
    """The recipe key, section.name."""
    tolerance: Callable
    """(recipe, precision, device) -> ({"loss": relative, "grad_norm": relative}, the bound as the table says it)."""
    off: str = "false"
    """The key's value the recipe is compared with, as `--set` writes it: false for a switch, the baseline for a
    choice (fp8: bf16, the precision it replaces)."""
    on: str | None = None
    """The value that turns the knob on; None: any value but `off` (and but null)."""

    def value(self, recipe, precision: str) -> str:
        """The key's value in the recipe, as `--set` writes it. training.mixed_precision: the run's (`precision`,
        resolved from the recipe and the accelerate config: config/settings.py), whoever named it."""
        if self.key == "training.mixed_precision":
            return precision
        section, name = self.key.split(".")
        value = getattr(getattr(recipe, section), name)
        return "null" if value is None else str(value).lower()

    def enabled(self, recipe, precision: str) -> bool:
        """The recipe turns the knob on."""
        value = self.value(recipe, precision)
        return value == self.on if self.on is not None else value not in ("null", "false", self.off)

    def probes(self, recipe, precision: str) -> list[tuple[str, list[str]]]:
        """The probes' names and what each sets in the recipe: none when the recipe leaves the knob off."""
        if not self.enabled(recipe, precision):
            return []
        steps = f"training.max_steps={PROBE_STEPS}"
        return [(f"{self.check}-on", [steps]), (f"{self.check}-off", [f"{self.key}={self.off}", steps])]

    def judge(self, on_rows: list, off_rows: list, recipe, precision: str, device: str) -> tuple:
        """(status, measured, tolerance, data) of verify's Check for the two probes' training rows."""
        tol, stated = self.tolerance(recipe, precision, device)
        same, dl, dg = compare_rows(on_rows, off_rows, tol, PROBE_STEPS)
        return ("PASS" if same else "FAIL",
                f"{self.key}={self.value(recipe, precision)} vs {self.off} over {PROBE_STEPS} steps: loss {dl:.1e}, "
                f"grad norm {dg:.1e} relative difference", stated, {"loss_rel": dl, "grad_norm_rel": dg})


def run_to_run(recipe, precision: str, micro_steps_each: int = 1) -> tuple[dict[str, float], str]:
    """Two runs of the same global batches whose arithmetic is ordered or rounded apart: the equivalence noise model,
    every micro-step of a rank's accumulation counted (1 rank at worst), each `micro_steps_each` times."""
    t, plain = recipe.training, FP8_BASELINE if precision == FP8 else precision
    tol = equivalence_tolerance(plain, t.global_batch_size * recipe.data.seq_len,
                                t.global_batch_size // t.micro_batch_size * micro_steps_each, PROBE_STEPS)
    return tol, f"loss {tol['loss']:g}, grad norm {tol['grad_norm']:g} ({plain})"


def chunked_loss_tolerance(recipe, precision: str, device: str) -> tuple[dict[str, float], str]:
    t = recipe.training
    facts = facts_for(recipe)
    chunk = t.loss_chunk_tokens or (loss_chunk_tokens(facts.vocab) if facts else 64)
    blocks = max(1, math.ceil(t.sequences_per_micro_step() * recipe.data.seq_len / chunk))
    return run_to_run(recipe, precision, blocks)


def compile_tolerance(recipe, precision: str, device: str) -> tuple[dict[str, float], str]:
    return run_to_run(recipe, precision)


def offload_tolerance(recipe, precision: str, device: str) -> tuple[dict[str, float], str]:
    if device == "cpu":
        return {"loss": 0.0, "grad_norm": 0.0}, "identical (CPU: copies byte for byte, deterministic kernels)"
    return run_to_run(recipe, precision)


def fp8_tolerance(recipe, precision: str, device: str) -> tuple[dict[str, float], str]:
    tol = {"loss": PROBE_STEPS * FP8_LOSS_BOUND, "grad_norm": PROBE_STEPS * FP8_GRAD_BOUND}
    return tol, (f"loss {tol['loss']:g}, grad norm {tol['grad_norm']:g} (fp8 vs bf16: float8's unit roundoffs, "
                 f"2^-4 and 2^-3 a step)")


def quantize_tolerance(recipe, precision: str, device: str) -> tuple[dict[str, float], str]:
    bound = PROBE_STEPS * QUANTIZE_BOUND
    return {"loss": bound, "grad_norm": bound}, (f"loss and grad norm {bound:.2g} (NF4 vs the 16-bit base: sqrt(2) x "
                                                 f"NF4's relative rms error {NF4_RMS_ERROR:g} a step)")


KNOBS = (
    Knob("chunked-loss", "training.chunked_loss", chunked_loss_tolerance),
    Knob("compile", "training.compile", compile_tolerance),
    Knob("activation-offload", "training.activation_offload", offload_tolerance),
    Knob("fp8", "training.mixed_precision", fp8_tolerance, off=FP8_BASELINE, on=FP8),
    Knob("quantize", "model.quantize", quantize_tolerance, off="null"),
)
"""The knobs `verify` proves, each with its own probes and bound, in the order its table shows them."""
