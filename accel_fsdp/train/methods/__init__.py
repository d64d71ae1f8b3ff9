"""Training methods: what a micro-step's loss is, what it logs, how it evaluates, and its start-summary line (the
interface: base.py `Objective`).

One file per method: sft.py, dpo.py, simpo.py, orpo.py, each with a small loss and `build(recipe, reference,
loss_path)`. The list of methods is config/methods.py `REGISTRY` (the config floor validates training.method against
it and cannot import this package); a method's module here has its name. Shared by the methods: logps.py (the only
code that reads log-probabilities from the model: the loss path, chunked from the hidden states by chunked.py or
plain), pairs.py (a pair's answers through one forward, the pair statistics).
"""

from __future__ import annotations

import importlib

from accel_fsdp.config.methods import METHODS
from accel_fsdp.train.methods.base import Norm, Objective, eval_loss
from accel_fsdp.train.methods.logps import LossIndex, LossPath, build_loss_path

__all__ = ["LossIndex", "LossPath", "Norm", "Objective", "build_loss_path", "build_objective", "eval_loss"]


def build_objective(recipe, reference, loss_path: LossPath) -> Objective:
    """The objective of the recipe's training.method, with the `reference` its batches get (train/reference.py),
    reading log-probabilities through `loss_path` (logps.py `build_loss_path`)."""
    spec = METHODS[recipe.training.method]
    return importlib.import_module(f"{__name__}.{spec.name}").build(recipe, reference, loss_path)
