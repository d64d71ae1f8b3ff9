"""The objective interface: what every training method (sft.py, dpo.py, simpo.py, orpo.py) offers the loop, the
logger, the evaluator and the start summary. A structural interface (a Protocol), not a base class to inherit from.

Exactness over the global batch, however it is split over ranks and micro-steps: FSDP averages gradients over the W
ranks and `accelerator.backward` divides by the k accumulation steps, so a micro-step's loss is a *sum* over its part
of the global batch divided by (global count) / (W x k), and the k x W micro-steps add up to the mean over the global
batch. The counts come from the per-sequence counts the data stores, the same on every rank: no communication.
  sft     token sum / (loss-carrying tokens of the global batch / (W x k))   (transformers' num_items_in_batch)
  pairs   sum of pair losses / (pairs of the global batch / (W x k)) = / micro batch
  orpo    adds the chosen answers' NLL sum / (chosen loss-carrying tokens of the global batch / (W x k))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Norm:
    """The global counts a step's micro-step losses are divided by, each already divided by W x k."""

    tokens: float = 1.0
    """Loss-carrying tokens (sft), or the chosen answers' (orpo)."""
    pairs: float = 1.0
    """Preference pairs."""


class Objective(Protocol):
    """What a micro-step's loss is, what it logs, how it evaluates held-out data, and its start-summary line."""

    method: str
    """Its training.method (config/methods.py REGISTRY)."""
    reference: object
    """How its batches get reference log-probabilities (train/reference.py); NoReference when it needs none."""
    loss_path: object
    """How it reads log-probabilities from the model (logps.py `LossPath`: chunked from the hidden states, or the
    full logits)."""
    eval_terms: tuple[tuple[str, str], ...]
    """How the held-out loss is made of `evaluate`'s sums: the sum of sums[total] / sums[count] over these
    (total, count) pairs. The evaluator weights each source's terms by the source's share of `count` in training."""

    def norm(self, data, units: list[int], ranks: int, accumulation: int, *, global_mean: bool = True) -> Norm | None:
        """The global batch's counts / (W x k). None (only `verify`'s proof that its equivalence check can fail):
        each micro-step takes its own mean."""

    def __call__(self, model, batch: dict, norm: Norm | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A micro-step's loss, and sums of what it logs (over the micro-batch; `statistics` turns the window's
        sums, reduced over ranks, into a row's numbers)."""

    def statistics(self, sums: dict[str, float]):
        """What a metrics row reports besides the loss, from sums of `__call__`'s or `evaluate`'s; None for none."""

    def evaluate(self, model, batch: dict) -> dict[str, torch.Tensor]:
        """Sums (float64, no gradient) over a held-out micro-batch: the totals and counts of `eval_terms`, and what
        `statistics` reads."""

    def unit_counts(self, source) -> dict[str, float]:
        """The mean of each count of `eval_terms` per training unit of a source (the evaluator's mixture weights)."""

    def eval_summary(self, sums: dict[str, float], loss: float) -> str:
        """The held-out numbers of an evaluation line, after its loss."""

    def summary(self) -> str | None:
        """The start summary's method line; None for none."""


def eval_loss(terms: tuple[tuple[str, str], ...], sums: dict[str, float]) -> float:
    """The held-out loss of one source from an objective's sums."""
    return sum(sums[total] / max(1.0, sums[count]) for total, count in terms)
