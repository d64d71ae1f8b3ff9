"""The knobs of the memory formulas: what a recipe's knobs set in them (`recipe_settings`, read by the dry run,
`estimate` and `verify`), and which knobs would make a recipe that does not fit its GPUs fit: `estimate` and the dry
run ask each knob the recipe leaves off for its effect (planning/memory.py holds every term; this module only turns
them on), one at a time, then together, and name those that bring the peak under the GPU's memory.

This module must not import torch: `estimate` and `recipe run --dry-run` read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from accel_fsdp.config.methods import METHODS
from accel_fsdp.config.precision import FP8
from accel_fsdp.model.facts import ModelFacts
from accel_fsdp.model.quantize import quantized_terms
from accel_fsdp.planning.memory import MemoryInputs, compute_bytes, estimate, gib


@dataclass(frozen=True)
class MemoryKnob:
    """A recipe key that lowers the peak, and the memory inputs with it on."""

    setting: str
    """As the user writes it (`key: value`)."""
    is_on: Callable[[MemoryInputs], bool]
    turned_on: Callable[[MemoryInputs], MemoryInputs]
    only_for: Callable[[MemoryInputs], str | None] = lambda m: None
    """Why it cannot help this model (then it is not offered), or None."""


def _fp8_only_for(m: MemoryInputs) -> str | None:
    # Llama-family blocks (gated MLP) have torch Linear layers; GPT-2's are Conv1D (model/fp8.py)
    return None if m.shape is not None and m.shape.gated_mlp and m.precision != "fp32" else "not this model"


def _quantize_only_for(m: MemoryInputs) -> str | None:
    # 4 bits for a frozen base under LoRA, of a model whose blocks we know (model/quantize.py)
    return None if m.shape is not None and m.trainable < m.params else "a LoRA recipe's base only"


def _quantized(m: MemoryInputs) -> MemoryInputs:
    """The memory inputs with the base's block projections in NF4 (model/quantize.py quantized_terms, from the
    model's shape)."""
    facts = ModelFacts("llama" if m.shape.gated_mlp else "gpt2", layers=m.shape.layers, hidden=m.shape.hidden,
                       heads=m.shape.heads, kv_heads=m.shape.kv_heads, head_dim=m.shape.hidden // m.shape.heads,
                       intermediate=m.shape.intermediate, vocab=m.shape.vocab, context=0, tied=False)
    return replace(m, quantized=quantized_terms(facts, compute_bytes(m.precision)))


def recipe_settings(recipe, run_precision: str) -> dict:
    """The MemoryInputs fields a recipe's knobs and its loss set (`run_precision`: the run's, resolved from the recipe
    and the accelerate config). The one place they are read from a recipe."""
    t = recipe.training
    return dict(chunked_loss=t.chunked_loss, loss_chunk_tokens=t.loss_chunk_tokens, pairs=METHODS[t.method].pairs,
                activation_offload=t.activation_offload, fp8=run_precision == FP8)


MEMORY_KNOBS = (
    MemoryKnob("training.chunked_loss: true", lambda m: m.chunked_loss, lambda m: replace(m, chunked_loss=True)),
    MemoryKnob("model.activation_checkpointing: true", lambda m: m.activation_checkpointing,
               lambda m: replace(m, activation_checkpointing=True)),
    MemoryKnob("training.activation_offload: true", lambda m: m.activation_offload,
               lambda m: replace(m, activation_offload=True)),
    MemoryKnob("training.mixed_precision: fp8 (GPUs of compute capability 8.9+)", lambda m: m.fp8,
               lambda m: replace(m, fp8=True), _fp8_only_for),
    MemoryKnob("model.quantize: nf4", lambda m: m.quantized is not None, _quantized, _quantize_only_for),
)
"""The knobs the advice may name, cheapest in speed first (the chunked loss: a third more head work on text, at most;
docs/PERFORMANCE.md); the 4-bit base last, the one that changes the numbers (verify's quantize check bounds how
far)."""


def fitting_knobs(m: MemoryInputs, limit: float) -> tuple[list[tuple[str, float]], tuple[list[str], float] | None]:
    """([(setting, GPU total)] of each knob that alone brings the peak to `limit` bytes or under, (all the knobs
    offered, their GPU total together) when none does alone, or None when nothing is left to offer."""
    offered = [k for k in MEMORY_KNOBS if not k.is_on(m) and k.only_for(m) is None]
    alone = [(k.setting, estimate(k.turned_on(m)).total) for k in offered]
    fitting = [(setting, total) for setting, total in alone if total <= limit]
    if fitting or not offered:
        return fitting, None
    together = m
    for k in offered:
        together = k.turned_on(together)
    return [], ([k.setting for k in offered], estimate(together).total)


def advice(m: MemoryInputs, limit: float) -> list[str]:
    """The lines `estimate` and the dry run print under a peak over `limit` bytes."""
    fitting, together = fitting_knobs(m, limit)
    if fitting:
        return [f"  fits with {setting} ({gib(total)} GiB)" for setting, total in fitting]
    if together is None:
        return []
    settings, total = together
    verdict = "fits" if total <= limit else "still does not fit"
    return [f"  with {' and '.join(settings)} together: {gib(total)} GiB, {verdict}"]
