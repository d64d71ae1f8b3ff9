"""training.method dpo (Rafailov et al., 2023; label smoothing: conservative DPO, Mitchell 2023). For a pair
(x, chosen y_w, rejected y_l), eps = preference.label_smoothing:
    z = beta ((log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)))
    loss = -(1 - eps) log sigma(z) - eps log sigma(-z)
    rewards: beta (log pi(y) - log ref(y))
The reference is the starting model (train/reference.py: the LoRA adapters switched off, or precomputed)."""

from __future__ import annotations

import torch

from accel_fsdp.train.methods.pairs import PairLogps, PairLosses, PairObjective, sigmoid_loss


def dpo_loss(*, policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             reference_chosen_logps: torch.Tensor, reference_rejected_logps: torch.Tensor, beta: float,
             label_smoothing: float) -> PairLosses:
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps)
    return PairLosses(sigmoid_loss(chosen_rewards - rejected_rewards, label_smoothing), chosen_rewards,
                      rejected_rewards)


def build(recipe, reference, loss_path) -> PairObjective:
    beta, label_smoothing = recipe.preference.beta_for("dpo"), recipe.preference.label_smoothing

    def pair_loss(pairs: PairLogps) -> PairLosses:
        return dpo_loss(policy_chosen_logps=pairs.policy_chosen_logps,
                        policy_rejected_logps=pairs.policy_rejected_logps,
                        reference_chosen_logps=pairs.reference_chosen_logps,
                        reference_rejected_logps=pairs.reference_rejected_logps, beta=beta,
                        label_smoothing=label_smoothing)

    return PairObjective("dpo", pair_loss, reference, loss_path, recipe=recipe)
