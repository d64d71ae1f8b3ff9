"""The speed and memory knobs a rank applies to its model and its micro-steps, in the order they must happen:

  before activation checkpointing and sharding   fp8: the blocks' linear layers become float8 ones (model/fp8.py);
                                                 compile: the blocks' forwards compiled (model/compile.py)
  after sharding                                 fp8: the weights' float8 scales computed after every optimizer step
                                                 (an optimizer step hook), for the next all-gather
  before the start summary                       compile: the first micro-step run once, so the summary says what
                                                 compiling cost and the first step's time is a step's
  around each micro-step's forward               activation offloading (train/activation_offload.py)

train/setup.py calls `before_sharding`, `after_sharding` and `compile_now`; the loop enters `saving_activations`.
The chunked loss is the objective's (train/methods/), not here. Off, each knob leaves the run as it was.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from accel_fsdp.config.precision import FP8
from accel_fsdp.model.compile import CompiledBlocks, compile_blocks, compile_statistics, describe
from accel_fsdp.model.fp8 import convert_to_fp8, precompute_scales
from accel_fsdp.train.activation_offload import ActivationOffload


@dataclass
class Knobs:
    """What the knobs did to this rank's model, and the offload hooks of its micro-steps."""

    compiled: CompiledBlocks | None = None
    fp8_layers: list[str] = field(default_factory=list)
    offload: ActivationOffload | None = None
    compile_seconds: float | None = None
    """The compile warm-up's wall time (`compile_now`)."""

    def saving_activations(self):
        """The context of a micro-step's forward: its saved tensors offloaded, or kept as usual."""
        return self.offload.saving() if self.offload is not None else contextlib.nullcontext()

    def summary(self) -> list[str]:
        """The start summary's lines."""
        lines = []
        if self.compiled is not None and self.compile_seconds is not None:
            lines.append(describe(self.compiled, self.compile_seconds, compile_statistics()))
        if self.fp8_layers:
            lines.append(f"  fp8       {len(self.fp8_layers)} linear layers in float8 (torchao, tensorwise scales, "
                         "float8 all-gather); the output head, norms and embeddings in bf16")
        if self.offload is not None:
            where = ("pinned host memory, copied on a side stream" if self.offload.plan.pinned else
                     "host memory (CPU ranks: copied, nothing saved)")
            lines.append(f"  offload   activations saved for the backward go to {where} (tensors of "
                         f"{self.offload.plan.min_bytes // 1024} KiB and more)")
        return lines


def before_sharding(model, recipe, settings, *, lossy_compile: bool = False) -> Knobs:
    """fp8 conversion, then block compilation (of the blocks that now hold float8 layers), in place. `lossy_compile`:
    only for `verify`'s proof that its compile check can fail (train/hooks.py, compile-skew)."""
    knobs = Knobs()
    if settings.mixed_precision.value == FP8:
        knobs.fp8_layers = convert_to_fp8(model)
    if recipe.training.compile:
        knobs.compiled = compile_blocks(model, skew=2.0**-8 if lossy_compile else 0.0)
    return knobs


def after_sharding(knobs: Knobs, recipe, model, optimizer, device, *, lossy_offload: bool = False) -> Knobs:
    """fp8's scales after each optimizer step (a post-step hook of the torch optimizer, whose step runs only on the
    last micro-step: accelerate/optimizer.py, AcceleratedOptimizer.step; 1.15.0); the offload hooks of `device`.
    `lossy_offload`: only for `verify`'s proof that its offload check can fail (train/hooks.py, offload-bf16)."""
    if knobs.fp8_layers:
        getattr(optimizer, "optimizer", optimizer).register_step_post_hook(lambda *_: precompute_scales(model))
    if recipe.training.activation_offload:
        import torch

        knobs.offload = ActivationOffload(device, host_dtype=torch.bfloat16 if lossy_offload else None)
    return knobs


def compile_now(run) -> None:
    """Compile before training: the first micro-step of step 1, forward and backward, run once and its gradients
    dropped (every rank at once: the backward reduces them). Before the seed of the loop is set, so the loop's
    randomness is what it would be without it."""
    knobs = run.knobs
    if knobs.compiled is None:
        return
    started = time.monotonic()
    units = run.sampler.micro_batches(0)[0]
    norm = run.norm(run.sampler.global_sequences(0))
    with run.accelerator.autocast(), knobs.saving_activations():
        loss, _ = run.objective(run.model, run.batch(units), norm)
    loss.backward()
    run.optimizer.zero_grad(set_to_none=True)
    knobs.compile_seconds = time.monotonic() - started
