"""The knobs `verify` proves: recipe keys that change how a run's arithmetic goes, not what it computes (or, for an
inexact knob, within a bound of its own). For each knob a recipe turns on, verify runs 2 steps of the recipe as it is
and 2 with the key at the knob's `off` value, and compares their losses and gradient norms within the knob's
tolerance (tools/verify.py `run_knob_probes`, `check_knob`). A new knob is one entry of KNOBS, its tolerance a
function of the verification here, and its check's name in verify.CHECKS."""

from __future__ import annotations

import math
from dataclasses import dataclass

from accel_fsdp.model.facts import facts_for, loss_chunk_tokens
from accel_fsdp.tools.noise import equivalence_tolerance


@dataclass(frozen=True)
class Knob:
    """A recipe key whose probes verify runs: the recipe as it is and with the key at `off`."""

    check: str
    """The check's name (CHECKS); its probes are <check>-on and <check>-off."""
    key: str
    """The recipe key, section.name."""
    tolerance: object
    """(Verification) -> ({"loss": relative, "grad_norm": relative}, the tolerance as the table says it)."""
    off: str = "false"
    """The value of the key that turns the knob off, as --set writes it (a bool key: false; a choice: its baseline,
    e.g. the precision the knob is compared with)."""

    def enabled(self, recipe) -> bool:
        section, name = self.key.split(".")
        value = getattr(getattr(recipe, section), name)
        return value not in (None, False) and str(value).lower() != self.off


def chunked_loss_tolerance(v) -> tuple[dict[str, float], str]:
    """The same products and sums as the plain path in other orders (fp32: the equivalence tolerance of the global
    batch's tokens); in 16 bits the hidden states' gradient is summed over the backward's vocabulary blocks, each
    block's share rounded once: like micro-steps, so the gradient norm's bound counts micro-steps x blocks."""
    t = v.recipe.training
    facts = facts_for(v.recipe)
    chunk = t.loss_chunk_tokens or (loss_chunk_tokens(facts.vocab) if facts else 64)
    blocks = max(1, math.ceil(t.sequences_per_micro_step() * v.recipe.data.seq_len / chunk))
    micro_steps = t.global_batch_size // t.micro_batch_size * blocks
    tol = equivalence_tolerance(v.precision, t.global_batch_size * v.recipe.data.seq_len, micro_steps, 2)
    return tol, f"loss {tol['loss']:g}, grad norm {tol['grad_norm']:g} ({v.precision})"


KNOBS = (Knob("chunked-loss", "training.chunked_loss", chunked_loss_tolerance),)
"""The knobs `verify` proves, each with its own probes and bound."""
