"""Batches: how the sequences of a micro-batch (data/store.py `Sequence`: ids, labels, positions) become model
inputs, laid out for the model's attention kernel; and which held-out sequences each rank evaluates. Which sequences
form each optimizer step is sampler.py's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from accel_fsdp.data.store import IGNORE_INDEX, Sequence


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


def collate(sequences: list[Sequence], pad_id: int, use_position_ids: bool, multiple_of: int = 8,
            layout: str = PADDED, restart_positions: bool = True) -> dict[str, torch.Tensor]:
    """A micro-batch as model inputs, in the given layout.

    Padded: one row per sequence, right-padded to the longest, rounded up to `multiple_of`. With position ids, the
    padding is its own document, so no real token attends to it; without (a model that takes none), an attention
    mask. Padding-free: see `collate_padding_free`. `restart_positions` False (only `verify`'s proof that its
    packing check can fail) numbers each sequence's tokens straight through, so packed documents see each other."""
    if not restart_positions:
        sequences = [Sequence(s.ids, s.labels, np.arange(len(s), dtype=np.int64)) for s in sequences]
    if layout == PADDING_FREE:
        return collate_padding_free(sequences)
    length = int(math.ceil(max(len(s) for s in sequences) / multiple_of) * multiple_of)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), length), IGNORE_INDEX, dtype=torch.long)
    for r, s in enumerate(sequences):
        ids[r, :len(s)] = torch.from_numpy(s.ids)
        labels[r, :len(s)] = torch.from_numpy(s.labels)
    batch = {"input_ids": ids, "labels": labels}
    if use_position_ids:
        positions = torch.arange(length, dtype=torch.long).repeat(len(sequences), 1)
        for r, s in enumerate(sequences):
            positions[r, :len(s)] = torch.from_numpy(s.positions)
            positions[r, len(s):] = torch.arange(length - len(s))
        batch["position_ids"] = positions
    else:
        batch["attention_mask"] = (torch.arange(length) < torch.tensor([len(s) for s in sequences])[:, None]).long()
    return batch


def collate_padding_free(sequences: list[Sequence]) -> dict[str, torch.Tensor]:
    """The micro-batch's tokens (no padding) concatenated into one row of shape (1, T), with the varlen
    attention arguments FA2 takes (as TRL's padding_free and DataCollatorWithFlattening build them):
    cu_seq_lens_q/k = cumulative document lengths [0, l1, l1+l2, ..., T] (int32), max_length_q/k = the longest
    document. Every document starts at position 0 and its first token carries no label (data/store.py), so no token
    predicts across a document boundary."""
    ids = torch.from_numpy(_concat([s.ids for s in sequences]))[None]
    labels = torch.from_numpy(_concat([s.labels for s in sequences]))[None]
    position_ids = torch.from_numpy(_concat([s.positions for s in sequences]))[None]
    starts = torch.nonzero(position_ids[0] == 0).flatten().tolist() + [position_ids.shape[1]]
    cu = torch.tensor(starts, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"input_ids": ids, "labels": labels, "position_ids": position_ids, "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu.clone(), "max_length_q": longest, "max_length_k": longest}


def _concat(arrays) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64)


def label_count(labels: torch.Tensor) -> int:
    """Tokens that carry a loss: every document's first token is masked in the data, so this equals the count
    after the model's causal shift."""
    return int((labels != IGNORE_INDEX).sum())


def iter_eval_batches(size: int, *, micro_batch: int, world_size: int, rank: int,
                      max_batches: int | None) -> Iterator[list[int] | None]:
    """Indices of this rank's evaluation micro-batches over a held-out table of `size` sequences. Every rank yields
    the same number of batches (FSDP collectives need it); a rank out of sequences yields None and evaluates a dummy
    batch with no loss tokens."""
    per_rank = math.ceil(size / world_size)
    batches = math.ceil(per_rank / micro_batch)
    if max_batches:
        batches = min(batches, max_batches)
    mine = list(range(rank, size, world_size))
    for b in range(batches):
        chunk = mine[b * micro_batch:(b + 1) * micro_batch]
        yield chunk or None
