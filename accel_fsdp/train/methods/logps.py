"""What every method reads from the model, in one place: the per-sequence sums and counts of a batch's loss-carrying
token log-probabilities (the preference methods, the DPO reference), and the next-token loss (sft).

The methods never touch logits: a loss computed in chunks from the hidden states (never the full logits) replaces
`sequence_logps` and `next_token_loss` here, and every method, the reference and the evaluation follow.
"""

from __future__ import annotations

import torch

from accel_fsdp.data.store import IGNORE_INDEX

NOT_MODEL_INPUTS = ("labels", "reference_logps")
"""Keys of a batch that are not arguments of the model's forward."""


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}


def sequence_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the loss-carrying tokens' log-probabilities, their count) of each sequence of the batch (padded rows,
    or the sequences of one padding-free row), from one forward."""
    inputs = model_inputs(batch)
    # use_cache=False: with a KV cache transformers skips the packed-document mask
    # (masking_utils.py, _preprocess_mask_arguments needs past_key_values None; 5.23.0).
    logits = model(**inputs, use_cache=False).logits
    return answer_logps(logits, batch["labels"], sequence_index(inputs, batch["labels"]))


def next_token_loss(model, batch: dict, num_items: float | None) -> torch.Tensor:
    """The model's own causal LM loss: the sum over the batch's loss-carrying tokens divided by `num_items`
    (transformers' num_items_in_batch; None: the batch's own mean)."""
    return model(**model_inputs(batch), labels=batch["labels"], num_items_in_batch=num_items, use_cache=False).loss


def sequence_index(batch: dict, labels: torch.Tensor) -> torch.Tensor | None:
    """For a padding-free batch (one row, cu_seq_lens), the sequence each token belongs to; None for padded rows."""
    cu = batch.get("cu_seq_lens_q")
    if cu is None:
        return None
    sizes = (cu[1:] - cu[:-1]).to(labels.device).long()
    return torch.repeat_interleave(torch.arange(len(sizes), device=labels.device), sizes)


def answer_logps(logits: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the loss-carrying tokens' log-probabilities, their count) of each sequence: padded rows (B, T), or one
    padding-free row whose tokens `segments` assigns to sequences. Token t's logits predict label t + 1. The
    log-softmax runs in fp32, one row at a time (a row of a 128K vocabulary is what one token costs)."""
    shifted = labels[:, 1:]
    mask = shifted != IGNORE_INDEX
    safe = shifted.masked_fill(~mask, 0)
    token = torch.zeros(shifted.shape, dtype=torch.float32, device=logits.device)
    for r in range(logits.shape[0]):
        row = logits[r, :-1].float()
        token[r] = row.gather(-1, safe[r, :, None])[:, 0] - torch.logsumexp(row, dim=-1)
    token = token * mask
    if segments is None:
        return token.sum(-1), mask.sum(-1)
    owner = segments[1:]  # the sequence of the predicted token
    n = int(segments.max()) + 1
    sums = torch.zeros(n, dtype=torch.float32, device=logits.device).index_add(0, owner, token[0])
    counts = torch.zeros(n, dtype=torch.long, device=logits.device).index_add(0, owner, mask[0].long())
    return sums, counts
