"""training.method orpo (Hong et al., 2024): no reference, no SFT stage before it. For a pair (x, chosen y_w,
rejected y_l), a(y) = log pi(y) / |y| the mean token log-probability, log odds(y) = a - log(1 - exp(a)) (a at most
-CERTAIN, below):
    loss = NLL(y_w) + lambda (-log sigma(log odds(y_w) - log odds(y_l)))
    rewards: lambda a(y) (as TRL logs them)
The NLL term is averaged over the global batch's chosen loss-carrying tokens, the odds-ratio term over its pairs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from accel_fsdp.train.methods.pairs import PairLogps, PairLosses, PairObjective


def orpo_loss(*, policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
              chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, lambda_: float) -> PairLosses:
    chosen_mean, rejected_mean = policy_chosen_logps / chosen_tokens, policy_rejected_logps / rejected_tokens
    log_odds = log_odds_of(chosen_mean) - log_odds_of(rejected_mean)
    return PairLosses(lambda_ * -F.logsigmoid(log_odds), lambda_ * chosen_mean, lambda_ * rejected_mean,
                      chosen_nll=-policy_chosen_logps)


CERTAIN = 2.0**-23
"""A mean log-probability above -CERTAIN (every token at probability 1 to fp32's precision, as an overfit model gives a
short answer) counts as -CERTAIN: its log odds would be infinite and its gradient nan (through torch.where's other
branch as well), which the run's finite-step check (train/finite.py) would stop at. The odds of such an answer are
capped at log(1/CERTAIN) = 15.9; the gradient through them is 0 there, as it is in the limit."""


def log_odds_of(mean_logps: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of p = exp(mean log-probability), finite with a finite gradient at p = 1 (CERTAIN)."""
    a = mean_logps.clamp(max=-CERTAIN)
    return a - log1mexp(a)


def log1mexp(a: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(a)) for a < 0, accurate at both ends (Maechler, 2012): log(-expm1(a)) near 0, log1p(-exp(a))
    below -log 2."""
    return torch.where(a > -0.6931471805599453, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def build(recipe, reference, loss_path) -> PairObjective:
    lambda_ = recipe.preference.lambda_

    def pair_loss(pairs: PairLogps) -> PairLosses:
        return orpo_loss(policy_chosen_logps=pairs.policy_chosen_logps,
                         policy_rejected_logps=pairs.policy_rejected_logps, chosen_tokens=pairs.chosen_tokens,
                         rejected_tokens=pairs.rejected_tokens, lambda_=lambda_)

    return PairObjective("orpo", pair_loss, reference, loss_path, recipe=recipe, chosen_nll=True)
