"""training.method simpo (Meng et al., 2024): no reference; length-normalized log-probabilities against a margin.
For a pair (x, chosen y_w, rejected y_l), |y| an answer's loss-carrying tokens, eps = preference.label_smoothing:
    z = beta (log pi(y_w) / |y_w| - log pi(y_l) / |y_l|) - gamma
    loss = -(1 - eps) log sigma(z) - eps log sigma(-z)
    rewards: beta log pi(y) / |y|"""

from __future__ import annotations

import torch

from accel_fsdp.train.methods.pairs import PairLogps, PairLosses, PairObjective, sigmoid_loss


def simpo_loss(*, policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
               chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, beta: float, gamma: float,
               label_smoothing: float) -> PairLosses:
    chosen_rewards = beta * (policy_chosen_logps / chosen_tokens)
    rejected_rewards = beta * (policy_rejected_logps / rejected_tokens)
    return PairLosses(sigmoid_loss(chosen_rewards - rejected_rewards - gamma, label_smoothing), chosen_rewards,
                      rejected_rewards)


def build(recipe, reference, loss_path) -> PairObjective:
    p = recipe.preference
    beta, gamma, label_smoothing = p.beta_for("simpo"), p.gamma, p.label_smoothing

    def pair_loss(pairs: PairLogps) -> PairLosses:
        return simpo_loss(policy_chosen_logps=pairs.policy_chosen_logps,
                          policy_rejected_logps=pairs.policy_rejected_logps, chosen_tokens=pairs.chosen_tokens,
                          rejected_tokens=pairs.rejected_tokens, beta=beta, gamma=gamma,
                          label_smoothing=label_smoothing)

    return PairObjective("simpo", pair_loss, reference, loss_path, recipe=recipe)
