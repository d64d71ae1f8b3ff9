"""training.method sft: next-token prediction, the model's own causal LM loss over the global batch's loss-carrying
tokens (transformers' num_items_in_batch)."""

from __future__ import annotations

import torch

from accel_fsdp.train.methods.base import Norm
from accel_fsdp.train.metrics import perplexity


class NextToken:
    method = "sft"
    eval_terms = (("loss", "tokens"),)

    def __init__(self, reference, loss_path):
        self.reference = reference
        self.loss_path = loss_path

    def norm(self, data, units: list[int], ranks: int, accumulation: int, *, global_mean: bool = True) -> Norm | None:
        if not global_mean:
            return None
        return Norm(tokens=max(1, sum(data.label_count(u) for u in units)) / (ranks * accumulation))

    def __call__(self, model, batch: dict, norm: Norm | None) -> tuple[torch.Tensor, dict]:
        return self.loss_path.next_token_loss(model, batch, None if norm is None else norm.tokens), {}

    def statistics(self, sums: dict[str, float]) -> None:
        return None

    def evaluate(self, model, batch: dict) -> dict[str, torch.Tensor]:
        loss_sum = self.loss_path.next_token_loss(model, batch, 1)
        tokens = torch.tensor(float(batch["loss_index"].tokens), dtype=torch.float64, device=loss_sum.device)
        return {"loss": loss_sum.double(), "tokens": tokens}

    def unit_counts(self, source) -> dict[str, float]:
        return {"tokens": source.stats.label_tokens / max(1, source.units())}

    def eval_summary(self, sums: dict[str, float], loss: float) -> str:
        return f"perplexity {perplexity(loss):.2f} ({int(sums['tokens']):,} tokens)"

    def summary(self) -> None:
        return None


def build(recipe, reference, loss_path) -> NextToken:
    return NextToken(reference, loss_path)
