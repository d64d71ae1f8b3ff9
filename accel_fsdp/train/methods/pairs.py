"""What the preference methods share: a pair's chosen and rejected answers through one forward, side by side in the
micro-batch ([c1, r1, c2, r2, ...]: one all-gather of each FSDP unit for the pair), the method's pair loss over the
global batch's pairs, the statistics it logs (metrics.PairStatistics) and its held-out sums.

Each method is a small loss function with named arguments in a file of its own (dpo.py, simpo.py, orpo.py) and a
`build` that hands it to a `PairObjective`; this class is not inherited from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from accel_fsdp.config.methods import METHODS
from accel_fsdp.train.methods.base import Norm
from accel_fsdp.train.metrics import PairStatistics


@dataclass(frozen=True)
class PairLogps:
    """Per pair of a micro-batch: what a pair loss reads. log pi(y) is the sum of an answer's loss-carrying token
    log-probabilities, |y| their count."""

    policy_chosen_logps: torch.Tensor
    policy_rejected_logps: torch.Tensor
    chosen_tokens: torch.Tensor
    """|y_w| (float, at least 1)."""
    rejected_tokens: torch.Tensor
    reference_chosen_logps: torch.Tensor | None = None
    """log ref(y_w), from the batch's reference (train/reference.py); None for a method without one."""
    reference_rejected_logps: torch.Tensor | None = None

    @classmethod
    def interleaved(cls, logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor | None) -> PairLogps:
        """From per-sequence values, chosen and rejected interleaved."""
        logps = logps.float()
        return cls(logps[0::2], logps[1::2], counts[0::2].clamp(min=1).float(), counts[1::2].clamp(min=1).float(),
                   None if reference is None else reference[0::2].float(),
                   None if reference is None else reference[1::2].float())


@dataclass(frozen=True)
class PairLosses:
    """What a method's pair loss gives, per pair."""

    losses: torch.Tensor
    """The preference loss (ORPO: its odds-ratio term only), averaged over the global batch's pairs."""
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_nll: torch.Tensor | None = None
    """ORPO: the chosen answer's NLL sum, averaged over the global batch's chosen loss-carrying tokens."""


def sigmoid_loss(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - eps) log sigma(z) - eps log sigma(-z): the logistic loss of a margin z, with a share eps of pairs
    assumed mislabelled (conservative DPO)."""
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


class PairObjective:
    """The objective of a preference method (base.Objective): `pair_loss` maps a micro-batch's `PairLogps` to its
    `PairLosses`."""

    def __init__(self, method: str, pair_loss: Callable[[PairLogps], PairLosses], reference, loss_path, *, recipe,
                 chosen_nll: bool = False):
        self.method = method
        self.pair_loss = pair_loss
        self.reference = reference
        self.loss_path = loss_path
        """How log-probabilities are read from the model (logps.py)."""
        self.chosen_nll = chosen_nll
        """The loss adds the chosen answers' NLL per chosen token (ORPO)."""
        self.eval_terms = (("loss", "pairs"),) + ((("nll", "tokens"),) if chosen_nll else ())
        self.parameters = describe_parameters(method, recipe.preference)

    def norm(self, data, units: list[int], ranks: int, accumulation: int, *, global_mean: bool = True) -> Norm | None:
        if not global_mean:
            return None
        chosen = sum(data.chosen_label_count(u) for u in units) if self.chosen_nll else 1
        return Norm(tokens=max(1, chosen) / (ranks * accumulation), pairs=len(units) / (ranks * accumulation))

    def forward(self, model, batch: dict) -> tuple[PairLosses, dict[str, torch.Tensor], torch.Tensor]:
        """The micro-batch's pair losses, each PairStatistics' value per pair, and each sequence's token count."""
        logps, counts = self.loss_path.sequence_logps(model, batch)
        reference = batch.get("reference_logps")
        if METHODS[self.method].reference and reference is None:
            raise RuntimeError(f"{self.method}: a batch without reference log-probabilities")  # a bug, not the user's
        pairs = PairLogps.interleaved(logps, counts, reference)
        out = self.pair_loss(pairs)
        per_pair = {"reward_chosen": out.chosen_rewards, "reward_rejected": out.rejected_rewards,
                    "reward_accuracy": (out.chosen_rewards > out.rejected_rewards).float(),
                    "logps_chosen": pairs.policy_chosen_logps / pairs.chosen_tokens,
                    "logps_rejected": pairs.policy_rejected_logps / pairs.rejected_tokens}
        return out, per_pair, counts

    def __call__(self, model, batch: dict, norm: Norm | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out, per_pair, counts = self.forward(model, batch)
        pairs = norm.pairs if norm is not None else len(out.losses)
        loss = out.losses.sum() / pairs
        if out.chosen_nll is not None:
            tokens = norm.tokens if norm is not None else counts[0::2].sum().clamp(min=1)
            loss = loss + out.chosen_nll.sum() / tokens
        with torch.no_grad():
            sums = {name: value.detach().sum() for name, value in per_pair.items()}
            sums["pairs"] = loss.new_full((), float(len(out.losses)))  # a fill on the device, no copy from the host
        return loss, sums

    def statistics(self, sums: dict[str, float]) -> PairStatistics | None:
        return PairStatistics.from_sums(sums)

    def evaluate(self, model, batch: dict) -> dict[str, torch.Tensor]:
        """Sums over a held-out micro-batch's pairs: the pair losses, the chosen answers' NLL and tokens (orpo), and
        the statistics (no gradient)."""
        out, per_pair, counts = self.forward(model, batch)
        sums = {name: value.detach().double().sum() for name, value in per_pair.items()}
        sums["loss"] = out.losses.detach().double().sum()
        sums["nll"] = out.chosen_nll.detach().double().sum() if out.chosen_nll is not None else sums["loss"] * 0
        sums["tokens"] = counts[0::2].double().sum()
        sums["pairs"] = torch.tensor(float(len(out.losses)), dtype=torch.float64, device=sums["loss"].device)
        return sums

    def unit_counts(self, source) -> dict[str, float]:
        units = max(1, source.units())
        return {"pairs": 1.0, "tokens": float(source.train.labels[0::2].sum()) / units}

    def eval_summary(self, sums: dict[str, float], loss: float) -> str:
        statistics = self.statistics(sums)
        return (f"reward accuracy {statistics.reward_accuracy:.3f}, margin {statistics.reward_margin:.4f} "
                f"({int(sums['pairs']):,} held-out pairs)")

    def summary(self) -> str:
        return f"  method    {self.method} ({self.parameters}); reference: {self.reference.describe()}"


def describe_parameters(method: str, preference) -> str:
    """The method's `preference.*` values as the start summary shows them: "beta 0.1, label smoothing 0.0"."""
    names = {f.metadata.get("key", f.name): f.name for f in fields(preference)}
    values = {key: preference.beta_for(method) if key == "beta" else getattr(preference, names[key])
              for key in METHODS[method].keys}
    return ", ".join(f"{key.replace('_', ' ')} {value}" for key, value in values.items()
                     if not isinstance(value, bool))  # a switch (keep_dropout) has a line of its own
