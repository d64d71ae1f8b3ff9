"""One precision vocabulary, and one translation table for each library that names precisions its own way.

Ours is the recipe's: `bf16` (bf16 compute, fp32 master weights), `fp32`, `fp16` (a GPU and a grad scaler);
`training.mixed_precision`, `checkpoint.export_dtype`, fsdp_settings.json and every message use it. Training also
knows `fp8`: the linear layers of the blocks multiply in float8 (torchao, model/fp8.py), everything else is bf16, so
the libraries see bf16 (Accelerate's own fp8 path is never used). Code that hands a precision to Accelerate, torch,
transformers or the memory model translates it here, by lookup.

This module must never import torch at import time: `recipe list` and the other quick commands read it.
"""

from __future__ import annotations

PRECISIONS = ("bf16", "fp32", "fp16")
"""The dtypes we store and compute in: `checkpoint.export_dtype`, `checkpoint consolidate --dtype`."""
FP8 = "fp8"
TRAINING = (*PRECISIONS, FP8)
"""`training.mixed_precision`: the dtypes above, and fp8 (float8 linear layers in the blocks, the rest bf16)."""
DEFAULT = "bf16"
"""When neither the recipe nor the accelerate config names one."""

ACCELERATE = {"bf16": "bf16", "fp16": "fp16", "fp32": "no", FP8: "bf16"}
"""Accelerate's `mixed_precision` (config file key, `Accelerator(mixed_precision=...)`)."""
FROM_ACCELERATE = {theirs: ours for ours, theirs in ACCELERATE.items() if ours in PRECISIONS}
"""Reading an accelerate config: its `mixed_precision` in our words."""

TORCH = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", FP8: "bfloat16"}
"""The torch dtype of the compute, by name (`torch.<name>`; `str(dtype)` is `torch.<name>`); fp8's outside its
float8 matrix products."""
TRANSFORMERS = {p: TORCH[p] for p in PRECISIONS}
"""transformers' `dtype` in a model's config.json: the torch dtype's name."""

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, FP8: 2}
"""Bytes per element of the compute dtype (fp8: of what is not float8; planning/memory.py counts the float8
weights)."""

MEMORY = {"bf16": "bf16-mixed", "fp16": "bf16-mixed", "fp32": "fp32", FP8: "bf16-mixed"}
"""The memory model's (planning/memory.py): fp32, or bf16-mixed (2-byte compute copies, fp32 master weights,
the same bytes for fp16)."""
MEMORY_CHOICES = (MEMORY["fp32"], MEMORY["bf16"])
"""`accel-fsdp estimate --precision`."""


def compute_dtype(precision: str):
    """The torch dtype that `precision` computes in (LoRA keeps its frozen base weights in it)."""
    import torch

    return getattr(torch, TORCH[precision])


def is_half(precision: str) -> bool:
    """A 16-bit compute dtype: tensor-core peak FLOP/s, 2-byte gathered weights and activations (fp8 too: MFU is
    measured against the card's bf16 peak)."""
    return BYTES.get(precision) == 2
