"""An optimizer step whose gradients are not finite stops the run before it changes a weight.

Without this a diverged run, or one started from damaged weights, trains on in silence: every later loss nan, every
checkpoint and the export nan (a tiny GPT-2 whose weights file held 50 nan floats trained its 8 steps, evaluated,
saved and exported, with exit status 0). Megatron-LM stops likewise (`check_for_nan_in_grad`). Here the step is not
taken, nothing is saved after it, and one message (exit status 2) names the step, its loss and gradient norm, the
weights that hold non-finite values if any, the newest checkpoint, and what to change.

The signal is the gradient norm, which the loop computes every step (clipping; `max_norm=inf` when clipping is off):
an all-reduce of every rank's shards, so every rank holds the same value and decides alike, with no collective of its
own. Reading it is one host synchronization per optimizer step, after the backward, which the step waits for anyway.
Only after a non-finite norm do the ranks communicate, every one of them: the step's loss, and which weights hold
non-finite values.

fp16 is the exception: the grad scaler multiplies the loss by up to 2^16, so an overflowing backward is routine; the
scaler skips that step and lowers its scale (train/loop.py `advance_schedule`). There a non-finite norm stops the run
only when the loss itself was not finite: no scale brings back a forward that overflows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from accel_fsdp.checkpoint.consolidate import plain_name
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.model.nf4 import is_nf4

NAMES_SHOWN = 5
"""Weights named in the message; the rest are counted."""


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (clip_grad_norm_ returns one under FSDP2), a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class FiniteSteps:
    """Checks each optimizer step's gradient norm before the step is taken (`check`), and stops the run at one that
    is not finite. Built from what it reads: the accelerator (the step's loss over the ranks), the model (which
    weights are not finite), the recipe (what to change) and the checkpointer's record of the newest checkpoint."""

    def __init__(self, accelerator, model, recipe, *, accumulation_steps: int, scaled: bool,
                 newest_checkpoint: Callable[[], str | None], started_from: Callable[[], tuple[str, bool]],
                 settle: Callable[[], None] = lambda: None, gather: Callable[[list], list] | None = None):
        self.accelerator, self.model, self.recipe = accelerator, model, recipe
        self.accumulation_steps = accumulation_steps
        self.scaled = scaled
        """fp16's grad scaler is on: a non-finite norm with a finite loss is a step it skips."""
        self.newest_checkpoint = newest_checkpoint
        """The newest checkpoint of the run (this attempt's last save, or the one it resumed from), or None."""
        self.started_from = started_from
        """Where this attempt's weights came from, as the message names it (the model's key, or the checkpoint), and
        whether that is a checkpoint it resumed from."""
        self.settle = settle
        """Waits for the checkpointer's work in the background (rotation) before the rank ends."""
        self.gather = gather or _gather_object
        self.first_step: int | None = None
        """The first optimizer step of this attempt: weights not finite before it are the weights it started from."""

    def start(self, next_step: int) -> None:
        self.first_step = next_step

    def check(self, step: int, grad_norm: torch.Tensor, step_loss: torch.Tensor) -> None:
        """Before optimizer step `step` is taken: return if its gradient norm is finite (every rank alike), else,
        collectively, decide and raise the run's one message. `step_loss`: this rank's micro-step losses of the
        step, summed (each a share of the step's mean, train/loop.py)."""
        norm = full_value(grad_norm).detach()
        if bool(torch.isfinite(norm)):  # the step's one host read
            return
        acc = self.accelerator
        loss = float(acc.reduce(step_loss.detach().float().reshape(1), reduction="sum")[0]) / (
            acc.num_processes * self.accumulation_steps)
        if self.scaled and math.isfinite(loss):
            return  # fp16: the scaler skips this step and lowers its scale
        weights = self.nonfinite_weights()
        self.settle()
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
