"""The tokenized data on disk: one table of sequences per source and split, written once, memory-mapped by every rank.

A table is a folder of flat binary files (little-endian, read with `numpy.memmap`):

    tokens.bin     every token of every document, in order, in the narrowest unsigned integer type that holds
                   the vocabulary (uint16 up to 65,536 tokens, else uint32)
    documents.bin  int64 start of each document in tokens.bin (a document: one example, as truncated)
    sequences.bin  int64 start of each sequence, then the end of the last: sequence i is tokens[s[i]:s[i+1]]
    labels.bin     uint32 loss-carrying tokens of each sequence (what the loss of a step is normalized by)
    mask.bin       one bit per token, 1 where the token carries a loss (numpy.packbits order); absent when every
                   token does (text)
    table.json     the counts and types above, and the CRC-32 of each file; written last

So a token costs 2 bytes (4 above 65,536 tokens) plus an eighth for the mask: no position ids, no labels, no
padding. They are derived when a sequence is read: positions restart at 0 at every document start and at the start
of the sequence (a document cut by packing continues as a new one), and a token carries a loss where its mask bit
is set and its position is not 0: the first token of a document is predicted by nothing of its own (in a packed
sequence the shift would make the previous document predict it), so a packed sequence's loss is the sum of its
documents' losses run alone.

Packing (`TableWriter`): `stream` concatenates the documents and cuts every seq_len tokens (every token is kept;
text); `bins` packs whole examples into sequences first-fit-decreasing within each batch of examples (prompts and
answers stay together); `none` makes each example a sequence.

A table is checked before a run trusts it (`table_damage`): every file has the size table.json says, and (with
`checksums`, once per run: about 0.1 s per 100 MB) the CRC-32 computed as it was written. This module imports no
torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from accel_fsdp.files import Crc32Writer, crc32_of

IGNORE_INDEX = -100
"""The label of a token that carries no loss (transformers' and torch's cross-entropy ignore_index)."""
TABLE_FORMAT = "accel-fsdp-table/2"
"""2: table.json holds each file's CRC-32."""
TOKENS, DOCUMENTS, SEQUENCES, LABELS, MASK, META = ("tokens.bin", "documents.bin", "sequences.bin", "labels.bin",
                                                    "mask.bin", "table.json")
PACKINGS = ("stream", "bins", "none")


def id_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every token id of a vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass
class Sequence:
    """One sequence as the model reads it."""

    ids: np.ndarray
    """Token ids (int64)."""
    labels: np.ndarray
    """The token id where it carries a loss, else IGNORE_INDEX (int64)."""
    positions: np.ndarray
    """Position in its document: 0 at every document start (int64)."""

    def __len__(self) -> int:
        return len(self.ids)


class TableWriter:
    """Appends tokenized examples to a table, packing them into sequences as it goes; memory is one batch."""

    def __init__(self, folder: Path, *, dtype: np.dtype, masked: bool, seq_len: int, packing: str):
        assert packing in PACKINGS, packing
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.dtype, self.masked, self.seq_len, self.packing = (folder, np.dtype(dtype), masked, seq_len,
                                                                            packing)
        self.files = {name: Crc32Writer(folder / name) for name in (TOKENS, DOCUMENTS, SEQUENCES, LABELS)}
        if masked:
            self.files[MASK] = Crc32Writer(folder / MASK)
        self._bits = np.zeros(0, bool)  # mask bits not yet a whole byte
        self.tokens = 0
        self.documents = 0
        self.sequences = 0
        self.label_tokens = 0
        self.longest = 0
        # stream packing: the open sequence (its start, its flags before it, its first token's flag once known)
        self._start = 0
        self._flags_before_start = 0
        self._start_flag: int | None = None
        self._flags = 0

    def add(self, examples: list[tuple[np.ndarray, np.ndarray | None]]) -> None:
        """Examples (ids, loss mask or None for all), each at most seq_len tokens unless packing is `stream`."""
        if not examples:
            return
        if self.packing == "bins":
            bins = pack_bins([len(ids) for ids, _ in examples], self.seq_len)
            sizes = [sum(len(examples[i][0]) for i in b) for b in bins]
            examples = [examples[i] for b in bins for i in b]
        ids = np.concatenate([e[0] for e in examples])
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id {int(ids.max())} does not fit {self.dtype} (the vocabulary was sized wrong)")
        lengths = np.fromiter((len(e[0]) for e in examples), dtype=np.int64, count=len(examples))
        starts = self.tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        mask = np.concatenate([np.ones(len(e[0]), bool) if e[1] is None else e[1].astype(bool) for e in examples])
        flags = mask.copy()
        flags[starts - self.tokens] = False  # a document's first token is predicted by nothing of its own
        self.files[TOKENS].write(ids.astype(self.dtype).tobytes())
        self.files[DOCUMENTS].write(starts.astype(np.int64).tobytes())
        if self.masked:
            self._write_bits(mask)
        if self.packing == "stream":
            self._cut_stream(flags)
        else:
            per_sequence = lengths if self.packing == "none" else np.asarray(sizes, dtype=np.int64)
            seq_starts = self.tokens + np.concatenate([[0], np.cumsum(per_sequence)[:-1]])
            bounds = np.concatenate([[0], np.cumsum(per_sequence)])
            cum = np.concatenate([[0], np.cumsum(flags, dtype=np.int64)])
            labels = cum[bounds[1:]] - cum[bounds[:-1]]
            self._write_sequences(seq_starts, labels, per_sequence)
        self.tokens += len(ids)
        self.documents += len(examples)

    def _cut_stream(self, flags: np.ndarray) -> None:
        """Sequences end every seq_len tokens of the stream; the last one of the table may be shorter."""
        n, L = len(flags), self.seq_len
        cum = np.concatenate([[0], np.cumsum(flags, dtype=np.int64)]) + self._flags  # flags before each position
        if self._start_flag is None and self._start == self.tokens:
            self._start_flag = int(flags[0])
        starts, labels = [], []
        boundary = self._start + L
        while boundary <= self.tokens + n:
            before = int(cum[boundary - self.tokens])
            starts.append(self._start)
            labels.append(before - self._flags_before_start - self._start_flag)
            self._start, self._flags_before_start = boundary, before
            self._start_flag = int(flags[boundary - self.tokens]) if boundary < self.tokens + n else None
            boundary += L
        self._flags = int(cum[-1])
        if starts:
            self._write_sequences(np.asarray(starts, np.int64), np.asarray(labels, np.int64),
                                  np.full(len(starts), L, np.int64))

    def _write_sequences(self, starts: np.ndarray, labels: np.ndarray, lengths: np.ndarray) -> None:
        self.files[SEQUENCES].write(starts.astype(np.int64).tobytes())
        self.files[LABELS].write(labels.astype(np.uint32).tobytes())
        self.sequences += len(starts)
        self.label_tokens += int(labels.sum())
        self.longest = max(self.longest, int(lengths.max()))

    def _write_bits(self, mask: np.ndarray) -> None:
        bits = np.concatenate([self._bits, mask])
        whole = len(bits) // 8 * 8
        self.files[MASK].write(np.packbits(bits[:whole]).tobytes())
        self._bits = bits[whole:]

    def close(self) -> dict:
        """Finish the last sequence and the files; write table.json. Returns its contents."""
        if self.packing == "stream" and self.tokens > self._start:
            label = self._flags - self._flags_before_start - (self._start_flag or 0)
            self._write_sequences(np.asarray([self._start]), np.asarray([label]),
                                  np.asarray([self.tokens - self._start]))
        self.files[SEQUENCES].write(np.asarray([self.tokens], np.int64).tobytes())  # the end of the last sequence
        if self.masked and len(self._bits):
            self.files[MASK].write(np.packbits(self._bits).tobytes())
        crc32 = {name: f.close() for name, f in self.files.items()}
        meta = {"format": TABLE_FORMAT, "dtype": self.dtype.name, "tokens": self.tokens, "documents": self.documents,
                "sequences": self.sequences, "label_tokens": self.label_tokens, "masked": self.masked,
                "packing": self.packing, "seq_len": self.seq_len, "longest": self.longest, "crc32": crc32}
        (self.folder / META).write_text(json.dumps(meta, indent=1))
        return meta


def pack_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of items with these lengths into bins of `capacity`; each bin lists its
    items in their original order. Ties keep the original order, so the result is deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    space: list[int] = []
    for i in order:
        for b, free in enumerate(space):
            if lengths[i] <= free:
                bins[b].append(i)
                space[b] -= lengths[i]
                break
        else:
            bins.append([i])
            space.append(capacity - lengths[i])
    return [sorted(b) for b in bins]


class TokenTable:
    """A table on disk, memory-mapped: pages are read when a sequence is, and shared by the ranks of a machine."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / META).read_text())
        if self.meta.get("format") != TABLE_FORMAT:
            raise ValueError(f"{self.folder}: not a table of this version ({self.meta.get('format')})")
        m = self.meta
        self.tokens = _map(self.folder / TOKENS, m["dtype"], m["tokens"])
        self.documents = _map(self.folder / DOCUMENTS, "int64", m["documents"])
        self.starts = _map(self.folder / SEQUENCES, "int64", m["sequences"] + 1)
        self.labels = _map(self.folder / LABELS, "uint32", m["sequences"])
        """Loss-carrying tokens of each sequence."""
        self.mask = _map(self.folder / MASK, "uint8", (m["tokens"] + 7) // 8) if m["masked"] else None

    def __len__(self) -> int:
        return self.meta["sequences"]

    def length(self, i: int) -> int:
        return int(self.starts[i + 1] - self.starts[i])

    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def sequence(self, i: int) -> Sequence:
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        ids = np.asarray(self.tokens[a:b], dtype=np.int64)
        d0, d1 = np.searchsorted(self.documents, [a, b], side="right")  # documents starting inside (a, b)
        cuts = np.asarray(self.documents[d0:d1], dtype=np.int64) - a
        cuts = cuts[(cuts > 0) & (cuts < b - a)]
        segment_starts = np.concatenate([[0], cuts])
        sizes = np.diff(np.concatenate([segment_starts, [b - a]]))
        positions = np.arange(b - a, dtype=np.int64) - np.repeat(segment_starts, sizes)
        if self.mask is None:
            carries = positions > 0
        else:
            bits = np.unpackbits(np.asarray(self.mask[a // 8:(b + 7) // 8]))[a % 8:a % 8 + (b - a)]
            carries = bits.astype(bool) & (positions > 0)
        return Sequence(ids, np.where(carries, ids, IGNORE_INDEX), positions)


def table_damage(folder: Path, *, checksums: bool = False) -> str | None:
    """What is wrong with a finished table on disk, or None: a file truncated, removed or swapped since it was
    written (from table.json and the files' sizes alone), and with `checksums` a file changed in place (its CRC-32,
    read whole)."""
    try:
        m = json.loads((Path(folder) / META).read_text())
        if m.get("format") != TABLE_FORMAT:
            return f"{META} is not of this version ({m.get('format')})"
        sizes = {TOKENS: m["tokens"] * np.dtype(m["dtype"]).itemsize, DOCUMENTS: 8 * m["documents"],
                 SEQUENCES: 8 * (m["sequences"] + 1), LABELS: 4 * m["sequences"]}
        if m["masked"]:
            sizes[MASK] = (m["tokens"] + 7) // 8
        sums = m["crc32"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{META} is unreadable ({type(e).__name__})"
    for name, size in sizes.items():
        path = Path(folder) / name
        have = path.stat().st_size if path.is_file() else None
        if have is None:
            return f"{name} is missing"
        if have != size:
            return f"{name} is {have:,} bytes where {META} says {size:,}"
        if checksums and crc32_of(path) != sums.get(name):
            return f"{name} changed since it was written (its CRC-32 differs from {META}'s)"
    return None


def _map(path: Path, dtype: str, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))
