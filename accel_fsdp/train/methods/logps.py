"""What every method reads from the model, in one place: the per-sequence sums and counts of a batch's loss-carrying
token log-probabilities (the preference methods, the DPO reference), and the next-token loss (sft). The methods never
touch logits.

Two loss paths behind one interface (`LossPath`), chosen once per run by `build_loss_path`:
- `ChunkedPath` (training.chunked_loss: true, the default): the model runs without its head's full projection; only
  the positions that carry a loss are projected, a chunk at a time (chunked.py), never the full logits.
- `PlainPath` (false, or a model whose head the chunked path does not know): the model's full logits, as
  transformers computes them.

Both read the batch's `LossIndex`, built on the host when the batch is collated (from the labels the data stores):
which positions carry a loss, their targets, the sequence each belongs to and each sequence's count. Nothing in a
micro-step asks the device for a number (`.item()`, `int(tensor)`, a mask's nonzero), so a GPU never waits for the
host to read one back (tests/test_chunked_loss.py counts such calls).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch
import torch.nn.functional as F

from accel_fsdp.data.store import IGNORE_INDEX
from accel_fsdp.model.facts import LOSS_CHUNK_BUDGET, loss_chunk_tokens
from accel_fsdp.train.methods.chunked import find_head, linear_of, projecting

NOT_MODEL_INPUTS = ("labels", "reference_logps", "loss_index")
"""Keys of a batch that are not arguments of the model's forward."""


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}


@dataclass(frozen=True)
class LossIndex:
    """Where a batch's loss is, computed on the host from its labels (token t's hidden state predicts label t + 1)."""

    positions: torch.Tensor
    """(N,) int64: the flat index b x T + t of each hidden state whose next token carries a loss."""
    targets: torch.Tensor
    """(N,) int64: that next token."""
    sequences: torch.Tensor
    """(N,) int64: the sequence it belongs to (a padded row, or a document of a padding-free row)."""
    counts: torch.Tensor
    """(S,) int64: loss-carrying tokens of each sequence."""

    @classmethod
    def of(cls, batch: dict) -> LossIndex:
        """From a collated batch still on the host (data/batches.py): padded rows, or one padding-free row whose
        documents `cu_seq_lens_q` delimits."""
        labels = batch["labels"]
        length = labels.shape[1]
        shifted = labels[:, 1:]
        rows, columns = torch.nonzero(shifted != IGNORE_INDEX, as_tuple=True)
        cu = batch.get("cu_seq_lens_q")
        if cu is None:
            sequences, count = rows, labels.shape[0]
        else:  # the document of the predicted token t + 1
            sequences, count = torch.searchsorted(cu[1:].long(), columns + 1, right=True), len(cu) - 1
        return cls(rows * length + columns, shifted[rows, columns], sequences,
                   torch.bincount(sequences, minlength=count))

    @property
    def tokens(self) -> int:
        """N, from the tensor's shape: known on the host."""
        return self.positions.shape[0]

    def to(self, device, non_blocking: bool = False) -> LossIndex:
        return LossIndex(*(getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)))

    def pin_memory(self) -> LossIndex:
        return LossIndex(*(getattr(self, f.name).pin_memory() for f in fields(self)))


def per_sequence(token_logps: torch.Tensor, index: LossIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of each sequence's token log-probabilities, its count) from the (N,) log-probabilities."""
    sums = torch.zeros(index.counts.shape[0], dtype=torch.float32, device=token_logps.device)
    return sums.index_add(0, index.sequences, token_logps), index.counts


class LossPath(Protocol):
    """How the log-probabilities of a batch's loss tokens are read from the model."""

    name: str
    """"chunked" or "plain"."""

    def sequence_logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the loss-carrying tokens' log-probabilities, their count) of each sequence of the batch (padded
        rows, or the sequences of one padding-free row), from one forward."""

    def next_token_loss(self, model, batch: dict, num_items: float | None) -> torch.Tensor:
        """The causal LM loss: the sum over the batch's loss-carrying tokens of -log p divided by `num_items`
        (transformers' num_items_in_batch; None: the batch's own mean)."""

    def describe(self) -> str:
        """The start summary's loss line."""


class PlainPath:
    """The model's full logits (B, T, V): transformers' own loss for sft, an fp32 log-softmax one row at a time for
    the sequence sums."""

    name = "plain"

    def __init__(self, why: str):
        self.why = why

    def sequence_logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        # use_cache=False: with a KV cache transformers skips the packed-document mask
        # (masking_utils.py, _preprocess_mask_arguments needs past_key_values None; 5.23.0).
        logits = model(**model_inputs(batch), use_cache=False).logits
        index = batch["loss_index"]
        return per_sequence(answer_logps(logits, batch["labels"], index), index)

    def next_token_loss(self, model, batch: dict, num_items: float | None) -> torch.Tensor:
        return model(**model_inputs(batch), labels=batch["labels"], num_items_in_batch=num_items,
                     use_cache=False).loss

    def describe(self) -> str:
        return f"  loss      full logits ({self.why})"


def answer_logps(logits: torch.Tensor, labels: torch.Tensor, index: LossIndex) -> torch.Tensor:
    """The (N,) log-probabilities of the loss tokens from full logits (B, T, V). The log-softmax runs in fp32, one row
    at a time (a row of a 128K vocabulary is what one token costs); rows are unbound, not indexed, so backward adds
    them into one gradient of the logits instead of one zero-filled copy per row."""
    safe = labels[:, 1:].clamp(min=0)  # IGNORE_INDEX is negative; those positions are not read below
    rows = []
    for row, targets in zip(logits.unbind(0), safe.unbind(0)):
        row = row[:-1].float()
        rows.append(row.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(row, dim=-1))
    every = F.pad(torch.stack(rows), (0, 1))  # (B, T): position t predicts t + 1; the last predicts nothing
    return every.flatten().index_select(0, index.positions)


class ChunkedPath:
    """The loss tokens' log-probabilities from the hidden states, `chunk_tokens` positions at a time (chunked.py)."""

    name = "chunked"

    def __init__(self, head: torch.nn.Module, chunk_tokens: int, *, vocab: int, chosen_by_planner: bool = False,
                 whole: bool = False):
        self.head = head
        self.chunk_tokens = chunk_tokens
        self.vocab = vocab
        self.chosen_by_planner = chosen_by_planner
        self.whole = whole
        """The chunk holds a whole micro-step's tokens (a small vocabulary): one chunk, still loss positions only."""

    def token_logps(self, model, batch: dict) -> torch.Tensor:
        index = batch["loss_index"]
        with projecting(self.head, index.positions, index.targets, self.chunk_tokens):
            return model(**model_inputs(batch), use_cache=False).logits

    def sequence_logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return per_sequence(self.token_logps(model, batch), batch["loss_index"])

    def next_token_loss(self, model, batch: dict, num_items: float | None) -> torch.Tensor:
        token_logps = self.token_logps(model, batch)
        return -token_logps.sum() / (num_items if num_items is not None else max(1, batch["loss_index"].tokens))

    def describe(self) -> str:
        how = (f"planner: {LOSS_CHUNK_BUDGET // 2**20} MiB of fp32 logits at vocabulary {self.vocab:,}"
               if self.chosen_by_planner else "training.loss_chunk_tokens")
        size = ("one chunk a micro-step" if self.whole else f"{self.chunk_tokens:,} tokens a chunk") + f" ({how})"
        adapted = "; the LoRA-adapted head checkpointed" if not isinstance(self.head, torch.nn.Linear) else ""
        return f"  loss      from the hidden states of the loss-carrying positions only, {size}{adapted}"


def build_loss_path(recipe, model) -> LossPath:
    """The recipe's loss path for the prepared model; the plain one, saying why, where the chunked one cannot run."""
    t = recipe.training
    if not t.chunked_loss:
        return PlainPath("training.chunked_loss: false")
    head, why = find_head(model)
    if head is None:
        return PlainPath(f"the chunked loss is off: {why}")
    vocab = linear_of(head).out_features
    micro_step = t.sequences_per_micro_step() * recipe.data.seq_len  # no micro-step has more loss positions
    chunk = min(t.loss_chunk_tokens or loss_chunk_tokens(vocab), micro_step)
    return ChunkedPath(head, chunk, vocab=vocab, chosen_by_planner=t.loss_chunk_tokens is None,
                       whole=chunk == micro_step)
