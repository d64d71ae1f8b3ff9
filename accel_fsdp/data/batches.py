"""Batches: which training sequences form each optimizer step, and how a micro-batch becomes model inputs.

Vocabulary (data/prepare.py too): an *example* is a row of the source; a *sequence* is what training reads, one
example or several packed into up to seq_len tokens. Batch sizes count sequences.

`GlobalBatchSampler` fixes which sequences form optimizer step s (a seeded permutation per epoch), no matter how many
ranks share it: a resumed run continues at step s, also after the number of ranks changed, and sees exactly the
sequences an uninterrupted run would have seen. `collate` lays a micro-batch out for the model's attention kernel.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from accel_fsdp.config.recipe import TrainingConfig
from accel_fsdp.data.prepare import IGNORE_INDEX


class GlobalBatchSampler:
    """Which sequences each rank reads at each micro-step, derived from the optimizer step alone.

    Optimizer step s of epoch e = s // steps_per_epoch takes the sequences perm_e[b*G:(b+1)*G] of a permutation
    seeded by (seed, e), where b = s % steps_per_epoch and G = global batch size. Micro-step m of rank r gets
    the slice [(m*W + r)*B, (m*W + r + 1)*B) of those sequences (W ranks, micro batch B). Sequences left over at the end
    of an epoch (fewer than G) are skipped for that epoch, like drop_last.
    """

    def __init__(self, num_sequences: int, *, global_batch: int, micro_batch: int, world_size: int, rank: int,
                 seed: int):
        self.n, self.G, self.B = num_sequences, global_batch, micro_batch
        self.W, self.r, self.seed = world_size, rank, seed
        batch = TrainingConfig(global_batch_size=global_batch, micro_batch_size=micro_batch)  # its formula, no copy
        self.accumulation_steps = batch.accumulation_steps(world_size)
        self.steps_per_epoch = num_sequences // global_batch
        self._perm: tuple[int, list[int]] | None = None

    def global_sequences(self, step: int) -> list[int]:
        epoch, b = divmod(step, self.steps_per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.n, generator=g).tolist())
        return self._perm[1][b * self.G:(b + 1) * self.G]

    def micro_batches(self, step: int) -> list[list[int]]:
        seqs = self.global_sequences(step)
        return [seqs[(m * self.W + self.r) * self.B:(m * self.W + self.r + 1) * self.B]
                for m in range(self.accumulation_steps)]

    def position(self, step: int) -> dict[str, int]:
        epoch, b = divmod(step, self.steps_per_epoch)
        return {"epoch": epoch, "batch_in_epoch": b, "rows_consumed": step * self.G}  # sequences; the key is on disk


def total_steps(recipe, steps_per_epoch: int) -> int:
    t = recipe.training
    if t.max_steps is not None:
        return t.max_steps
    return max(1, math.ceil((t.epochs if t.epochs is not None else 1.0) * steps_per_epoch))


PADDED, PADDING_FREE = "padded", "padding-free"


def batch_layout(attn_implementation: str | None, use_position_ids: bool) -> str:
    """How a micro-batch is laid out for the model's attention kernel.

    padded: one row per sequence, right-padded; documents packed into a row are kept apart by their restarting
    position ids, from which transformers builds a block-diagonal mask for SDPA and eager attention at any batch
    size (masking_utils.py, find_packed_sequence_indices, checked with 5.23.0), provided no attention mask and no
    KV cache is passed (the forward calls pass use_cache=False).
    padding-free: the micro-batch flattened into one row with cu_seq_lens, for varlen flash attention.
    transformers derives varlen boundaries from position ids only at batch size 1 and otherwise runs FA2 without
    any mask (modeling_flash_attention_utils.py, _is_packed_sequence; masking_utils.py, flash_attention_mask), so a
    padded batch of packed rows would let documents attend to each other: flash kernels always get this layout.
    """
    if attn_implementation and "flash" in attn_implementation and use_position_ids:
        return PADDING_FREE
    return PADDED


def collate(rows: dict[str, list], pad_id: int, use_position_ids: bool, multiple_of: int = 8,
            layout: str = PADDED, restart_positions: bool = True) -> dict[str, torch.Tensor]:
    """A micro-batch (columns as returned by `dataset[indices]`) as model inputs, in the given layout.

    Padded: right-pad to the longest row, rounded up to `multiple_of`. With position ids, padding is its own
    document, so no real token attends to it. Padding-free: see `collate_padding_free`. `restart_positions` False
    (only `verify`'s proof that its packing check can fail) numbers each row's tokens straight through, so packed
    documents see each other."""
    if not restart_positions:
        rows = dict(rows, position_ids=[list(range(len(p))) for p in rows["position_ids"]])
    if layout == PADDING_FREE:
        return collate_padding_free(rows)
    ids = rows["input_ids"]
    length = int(math.ceil(max(len(r) for r in ids) / multiple_of) * multiple_of)

    def pad(column, value):
        return torch.tensor([r + [value] * (length - len(r)) for r in column], dtype=torch.long)

    batch = {"input_ids": pad(ids, pad_id), "labels": pad(rows["labels"], IGNORE_INDEX)}
    if use_position_ids:
        batch["position_ids"] = torch.tensor([p + list(range(length - len(p))) for p in rows["position_ids"]],
                                             dtype=torch.long)
    else:
        batch["attention_mask"] = torch.tensor([[1] * n + [0] * (length - n) for n in rows["length"]],
                                               dtype=torch.long)
    return batch


def collate_padding_free(rows: dict[str, list]) -> dict[str, torch.Tensor]:
    """The micro-batch's tokens (no padding) concatenated into one row of shape (1, T), with the varlen
    attention arguments FA2 takes (as TRL's padding_free and DataCollatorWithFlattening build them):
    cu_seq_lens_q/k = cumulative document lengths [0, l1, l1+l2, ..., T] (int32), max_length_q/k = the longest
    document. Every document starts at position 0, and its first label is masked (see `_tokenize_batch`), so no
    token predicts across a document boundary."""
    ids, labels, pos = [], [], []
    for r_ids, r_labels, r_pos, n in zip(rows["input_ids"], rows["labels"], rows["position_ids"], rows["length"]):
        ids += r_ids[:n]
        labels += r_labels[:n]
        pos += r_pos[:n]
    position_ids = torch.tensor([pos], dtype=torch.long)
    starts = torch.nonzero(position_ids[0] == 0).flatten().tolist() + [len(pos)]
    cu = torch.tensor(starts, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"input_ids": torch.tensor([ids], dtype=torch.long), "labels": torch.tensor([labels], dtype=torch.long),
            "position_ids": position_ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(),
            "max_length_q": longest, "max_length_k": longest}


def label_count(labels: torch.Tensor) -> int:
    """Tokens that carry a loss: every document's first token is masked in the data, so this equals the count
    after the model's causal shift."""
    return int((labels != IGNORE_INDEX).sum())


def iter_eval_batches(dataset, *, micro_batch: int, world_size: int, rank: int,
                      max_batches: int | None) -> Iterator[list[int] | None]:
    """Row indices of this rank's evaluation micro-batches. Every rank yields the same number of batches (FSDP
    collectives need it); a rank out of rows yields None and evaluates a dummy batch with no loss tokens."""
    n = len(dataset)
    per_rank = math.ceil(n / world_size)
    batches = math.ceil(per_rank / micro_batch)
    if max_batches:
        batches = min(batches, max_batches)
    mine = list(range(rank, n, world_size))
    for b in range(batches):
        chunk = mine[b * micro_batch:(b + 1) * micro_batch]
        yield chunk or None
