"""An optimizer step whose gradients are not finite stops the run before it changes a weight.

Without this a diverged run, or one started from damaged weights, trains on in silence: every later loss nan, every
checkpoint and the export nan (a tiny GPT-2 whose weights file held 50 nan floats trained its 8 steps, evaluated,
saved and exported, with exit status 0). Megatron-LM stops likewise (`check_for_nan_in_grad`). Here the step is not
taken, nothing is saved after it, and one message (exit status 2) names the step, its loss and gradient norm, the
weights that hold non-finite values if any, the newest checkpoint, and what to change.

The signal is the gradient norm, which the loop computes every step (clipping; `max_norm=inf` when clipping is off):
an all-reduce of every rank's shards, so every rank holds the same value and decides alike, with no collective of its
own. Only after a non-finite norm do the ranks communicate, every one of them: the step's loss, and which weights
hold non-finite values.

Without a host read in the step (`StepFlag`): reading the norm before the optimizer step made the host wait for the
backward, so the GPU idled while the host then launched the optimizer step and the next forward: +3.7-6.9% a step
for llama-3.2-1b (4 x 2,048 tokens) on one H100, against +1.5% now (benchmarks/finite_check_cost.py,
docs/PERFORMANCE.md). Instead the
norm's verdict goes to the fused AdamW kernel as its `found_inf` (the flag torch's grad scaler uses: torch/optim/
adam.py `_fused_adam`, torch 2.13.0), which leaves every weight, moment and step count as it was when it is 1, on the
device; the host reads the verdict (copied to pinned memory behind an event) at the next step's check, long after it
was computed, or before anything reads the model or saves it (`confirm`: the loop's logging and evaluation steps,
every checkpoint, the end of the loop). A step found non-finite that late was never taken, so the run stops exactly
as if it had been read at once: the same message, the same newest checkpoint, the same weights.

fp16 is the exception: the grad scaler multiplies the loss by up to 2^16, so an overflowing backward is routine; the
scaler skips that step and lowers its scale (train/loop.py `advance_schedule`), through the same `found_inf`, so the
norm is read at once there (the scaler reads its own flag anyway). There a non-finite norm stops the run only when
the loss itself was not finite: no scale brings back a forward that overflows. An optimizer without the flag (not
torch's fused Adam or AdamW) is read at once too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from accel_fsdp.checkpoint.consolidate import plain_name
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.model.nf4 import is_nf4

NAMES_SHOWN = 5
"""Weights named in the message; the rest are counted."""


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (clip_grad_norm_ returns one under FSDP2), a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def is_finite(grad_norm: torch.Tensor) -> bool:
    """Whether the step's gradient norm is finite, read at once: the host waits for the backward (its cost on a
    GPU: benchmarks/finite_check_cost.py)."""
    return bool(torch.isfinite(full_value(grad_norm).detach()))


def skips_on_device(optimizer, scaled: bool) -> bool:
    """The optimizer can skip a step on the device from a flag (torch's fused Adam and AdamW read `found_inf`), and
    no grad scaler sets that flag itself (fp16)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps torch's
    return (not scaled and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
            and bool(inner.defaults.get("fused")))


@dataclass
class Verdict:
    """A step whose gradient norm's verdict is on its way to the host."""

    step: int
    not_finite: torch.Tensor
    """1.0 when the norm is not finite: the host's copy (pinned, behind `ready`), or the CPU tensor itself."""
    ready: object | None
    """The CUDA event after the copy; None on the CPU."""
    grad_norm: torch.Tensor
    step_loss: torch.Tensor


class StepFlag:
    """The verdict of each step's gradient norm handed to the fused optimizer as `found_inf` (it skips the step on
    the device when the norm is not finite) and read by the host later, without waiting for the device's queue."""

    def __init__(self, optimizer):
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        self.host: torch.Tensor | None = None
        """Pinned host memory the verdict is copied into (CUDA), made at the first step."""
        self.devices = {p.device for group in self.optimizer.param_groups for p in group["params"]}
        """Where the optimizer's parameters are (a DTensor's: its shard's)."""

    def serves(self, grad_norm: torch.Tensor) -> bool:
        """The norm is where every parameter is: the kernel reads the verdict in place. Elsewhere (a GPU's norm of
        parameters offloaded to the host), torch would copy it with `non_blocking=True` (adam.py `_fused_adam`),
        which a host kernel could read before it lands: the norm is then read at once."""
        return self.devices == {grad_norm.device}

    def set(self, step: int, grad_norm: torch.Tensor, step_loss: torch.Tensor) -> Verdict:
        """Before optimizer step `step`: its verdict, given to the optimizer and sent to the host."""
        not_finite = (~torch.isfinite(full_value(grad_norm).detach())).to(torch.float32)
        self.optimizer.found_inf = not_finite
        ready = None
        if not_finite.device.type == "cuda":
            if self.host is None:
                self.host = torch.empty((), dtype=torch.float32, pin_memory=True)
            self.host.copy_(not_finite, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            not_finite = self.host
        return Verdict(step, not_finite, ready, grad_norm, step_loss)

    @staticmethod
    def finite(verdict: Verdict) -> bool:
        """The host reads the verdict: waits for the step's norm (not for the work queued after it)."""
        if verdict.ready is not None:
            verdict.ready.synchronize()
        return not bool(verdict.not_finite)


class FiniteSteps:
    """Checks each optimizer step's gradient norm (`guard`), and stops the run at one that is not finite, before it
    changes a weight. Built from what it reads: the accelerator (the step's loss over the ranks), the model (which
    weights are not finite), the optimizer (which skips a step on the device), the recipe (what to change) and the
    checkpointer's record of the newest checkpoint."""

    def __init__(self, accelerator, model, recipe, *, accumulation_steps: int, scaled: bool,
                 newest_checkpoint: Callable[[], str | None], started_from: Callable[[], tuple[str, bool]],
                 optimizer=None, wait_for_checkpointer: Callable[[], None] = lambda: None,
                 gather: Callable[[list], list] | None = None):
        self.accelerator, self.model, self.recipe = accelerator, model, recipe
        self.accumulation_steps = accumulation_steps
        self.scaled = scaled
        """fp16's grad scaler is on: a non-finite norm with a finite loss is a step it skips."""
        self.newest_checkpoint = newest_checkpoint
        """The newest checkpoint of the run (this attempt's last save, or the one it resumed from), or None."""
        self.started_from = started_from
        """Where this attempt's weights came from, as the message names it (the model's key, or the checkpoint), and
        whether that is a checkpoint it resumed from."""
        self.flag = StepFlag(optimizer) if optimizer is not None and skips_on_device(optimizer, scaled) else None
        """The device skips a non-finite step and the host reads it later; None: read before the step."""
        self.pending: Verdict | None = None
        self.wait_for_checkpointer = wait_for_checkpointer
        """Waits for the checkpointer's work in the background (rotation) before the rank ends."""
        self.gather = gather or _gather_object
        self.first_step: int | None = None
        """The first optimizer step of this attempt: weights not finite before it are the weights it started from."""

    def start(self, next_step: int) -> None:
        self.first_step = next_step

    def guard(self, step: int, grad_norm: torch.Tensor, step_loss: torch.Tensor) -> None:
        """Before optimizer step `step` is taken (every rank alike): the step before it confirmed, then this one
        handed to the device's skip, or checked at once (`check`). `step_loss`: this rank's micro-step losses of
        the step, summed (each a share of the step's mean, train/loop.py)."""
        self.confirm()
        if self.flag is not None and not self.flag.serves(grad_norm):
            self.flag = None  # the norm's device is the run's: decided at the first step, read at once from then on
        if self.flag is None:
            self.check(step, grad_norm, step_loss)
        else:
            self.pending = self.flag.set(step, grad_norm, step_loss)

    def confirm(self) -> None:
        """The last step's gradients were finite, or the run stops here with its message (collective then). Called
        before the model is read or saved; nothing to do when no step waits."""
        pending, self.pending = self.pending, None
        if pending is not None and not StepFlag.finite(pending):
            self.stop(pending.step, pending.grad_norm, pending.step_loss)

    def check(self, step: int, grad_norm: torch.Tensor, step_loss: torch.Tensor) -> None:
        """Step `step`'s norm read at once (the step waits for it): return if it is finite, else stop."""
        if not is_finite(grad_norm):
            self.stop(step, grad_norm, step_loss)

    def stop(self, step: int, grad_norm: torch.Tensor, step_loss: torch.Tensor) -> None:
        """Collectively: decide and raise the run's one message (fp16: return for a step the scaler skips)."""
        norm = full_value(grad_norm).detach()
        acc = self.accelerator
        loss = float(acc.reduce(step_loss.detach().float().reshape(1), reduction="sum")[0]) / (
            acc.num_processes * self.accumulation_steps)
        if self.scaled and math.isfinite(loss):
            return  # fp16: the scaler skips this step and lowers its scale
        weights = self.nonfinite_weights()
        self.wait_for_checkpointer()
        raise UserError(self.problem(step, float(norm), loss, weights))

    def nonfinite_weights(self) -> list[str]:
        """Collective: the weights whose values (any rank's shard of them) are not all finite, by their own names.
        A 4-bit base's NF4 weights are left out (torchao's tensor has no isfinite; training never writes them)."""
        local = []
        for name, param in self.model.named_parameters():
            if is_nf4(param):
                continue
            value = (param.to_local() if hasattr(param, "to_local") else param).detach()
            if value.numel() and not bool(torch.isfinite(value).all()):
                local.append(plain_name(name))
        return list(dict.fromkeys(name for part in self.gather([local]) for name in part))  # rank order, once each

    def problem(self, step: int, norm: float, loss: float, weights: list[str]) -> Problem:
        recipe, t = self.recipe, self.recipe.training
        newest = self.newest_checkpoint()
        stopped = (f"optimizer step {step}'s gradient norm is {norm} (its loss: {loss:.6g}): the run stops before the "
                   "step changes a weight; " + (f"the newest checkpoint, {newest}, was saved before it"
                                                 if newest else "no checkpoint was written"))
        if weights:
            shown = ", ".join(weights[:NAMES_SHOWN]) + (f" and {len(weights) - NAMES_SHOWN} more"
                                                        if len(weights) > NAMES_SHOWN else "")
            damaged = f"{len(weights)} weight tensor(s) hold non-finite values ({shown})"
            if step == self.first_step:  # every step before was checked: these are the weights it started from
                origin, resumed = self.started_from()
                fix = ("resume from an earlier checkpoint (--resume-from PATH)" if resumed
                       else "the model's files are damaged or hold a model that diverged: download or export them "
                            "again")
                return Problem(origin, f"{damaged} as this run read them; {stopped}", fix)
            stopped = f"{stopped}; {damaged}"
        fixes = [f"lower training.lr (now {t.lr:g})"]
        if t.max_grad_norm is None:
            fixes.append("turn clipping on (training.max_grad_norm: 1.0)")
        if self.scaled:
            fixes.append("train in bf16 (training.mixed_precision: bf16), whose range is fp32's; fp16 ends at 65,504")
        choice = fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + " or " + fixes[-1]
        again = ("; a resume keeps the recipe, so start a new run (another --output-dir), from the newest checkpoint's "
                 "export to keep its progress (accel-fsdp checkpoint consolidate)" if newest else
                 ", and run it again (--overwrite)")
        return Problem(recipe.where("training.lr"), stopped, choice + again)


def _gather_object(objects: list) -> list:
    from accelerate.utils import gather_object

    return gather_object(objects)
