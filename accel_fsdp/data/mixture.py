"""The prepared mixture: what training reads. Each source's tables (memory-mapped, from the cache data/prepare.py
builds), what building them found (`SourceStats`, the cache's stats.json), and the mixture over them (`PreparedData`):
training units numbered over the sources one after the other, the sampler of the run's global batches, and the counts
the loss is normalized by. This module builds nothing and imports no torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from accel_fsdp.config.recipe import SourceConfig
from accel_fsdp.data.sampler import GlobalBatchSampler, total_steps
from accel_fsdp.data.store import Sequence, TokenTable
from accel_fsdp.errors import Problem

DIGEST_SAMPLE = 1 << 16
"""Entries read from each end of a table for `content_digest`: a few hundred KiB of pages, not the whole table."""


@dataclass
class SourceStats:
    """What reading and tokenizing one source found (stats.json of its cache folder)."""

    name: str = ""
    format: str = "text"
    rows_read: int = 0
    empty_rows: int = 0
    """Rows of a text source whose text is empty: skipped."""
    empty_lines: list[int] = field(default_factory=list)
    """The rows (lines) of the first few of them."""
    train_rows: int = 0
    """Training examples (non-empty rows not held out)."""
    eval_rows: int = 0
    train_sequences: int = 0
    eval_sequences: int = 0
    train_tokens: int = 0
    """Tokens of the training sequences (no padding)."""
    label_tokens: int = 0
    """Training tokens that carry a loss."""
    truncated: int = 0
    """Examples cut at seq_len (their tail is lost); reported, never silently dropped."""
    no_label_rows: int = 0
    """Examples with no loss-carrying token left after truncation."""
    pairs: bool = False
    """Preference data: rows are pairs, each two sequences (prompt + chosen, prompt + rejected)."""
    prompts_cut: int = 0
    """Pairs whose prompt was cut from the left so that both answers fit in seq_len."""
    packed: bool = False
    packing_efficiency: float = 1.0
    """Share of the training sequences' seq_len slots holding a token (packed sources)."""
    seconds: float = 0.0
    """Time the build took (reading, tokenizing, writing)."""
    tokens_read: int = 0
    """Tokens of every example as tokenized (before truncation, held-out ones included)."""
    unknown_tokens: int = 0
    """Of those, the tokenizer's unknown token (a vocabulary that does not cover the text: a word-level or
    character-limited tokenizer on text it was not made for)."""
    no_signal_pairs: int = 0
    """Pairs whose answers are the same tokens (or the same once cut to seq_len), or differ in whitespace alone: they
    prefer nothing, and were skipped (data/build.py refuses a source of mostly such pairs)."""
    no_signal_lines: list[int] = field(default_factory=list)
    """The rows (lines) of the first few of them."""
    empty_turn_rows: int = 0
    """Rows trained on whose preference prompt, or an assistant turn (not the answer of a pair), is empty or
    whitespace: warned about (a field named wrong, a conversation cut), not refused."""
    empty_turn_lines: list[int] = field(default_factory=list)
    """The rows (lines) of the first few of them."""

    SHOWN_ROWS = 5
    """How many rows of a kind a warning names (the `*_lines` lists hold the first ones)."""
    TRUNCATION_WARNING = 0.05
    EMPTY_WARNING = 0.05
    """Share of empty rows from which they are warned about: a few are blank records, many a field named wrong (in a
    .json list or a CSV, a row without the field reads as one whose field is empty)."""
    UNKNOWN_WARNING = 0.01

    @staticmethod
    def shown(lines: list[int], count: int) -> str:
        """'3, 8, 12' or '3, 8, 12, 20, 31, ...': the rows a warning names."""
        return ", ".join(map(str, lines)) + (", ..." if count > len(lines) else "")

    @classmethod
    def note_row(cls, lines: list[int], row: int) -> None:
        """Keep `row` among the first SHOWN_ROWS rows of a kind."""
        if len(lines) < cls.SHOWN_ROWS:
            lines.append(row)

    def summary(self) -> str:
        parts = [f"{self.rows_read:,} rows read", f"{self.train_rows:,} train / {self.eval_rows:,} held out",
                 f"{self.train_sequences // 2:,} training pairs" if self.pairs else
                 f"{self.train_sequences:,} training sequences",
                 f"{self.train_tokens:,} tokens ({self.label_tokens:,} with loss)"]
        if self.prompts_cut:
            parts.append(f"{self.prompts_cut:,} pairs had their prompt cut from the left to fit seq_len")
        if self.packed:
            parts.append(f"packing efficiency {self.packing_efficiency:.4f}")
        if self.truncated:
            parts.append(f"{self.truncated:,} examples longer than seq_len were truncated")
        if self.no_label_rows:
            parts.append(f"{self.no_label_rows:,} examples have no response tokens left after truncation")
        if self.empty_rows:
            parts.append(f"{self.empty_rows:,} empty rows skipped")
        if self.no_signal_pairs:
            parts.append(f"{self.no_signal_pairs:,} pairs without a preference skipped")
        return "; ".join(parts)

    def warnings(self, seq_len: int, named: bool = False) -> list[str]:
        out = []
        share = self.no_label_rows / max(1, self.train_rows)
        if share >= self.TRUNCATION_WARNING:
            out.append(f"{self.name + ': ' if named else ''}{100 * share:.0f}% of the training examples "
                       f"({self.no_label_rows:,} of {self.train_rows:,}) lost all their loss-carrying tokens to "
                       f"truncation at data.seq_len = {seq_len}: they are trained on nothing (raise data.seq_len, or "
                       "shorten the prompts)")
        if self.no_signal_pairs:
            rows = self.shown(self.no_signal_lines, self.no_signal_pairs)
            out.append(f"{self.name + ': ' if named else ''}{self.no_signal_pairs:,} pairs (rows {rows}) have a chosen "
                       "and a rejected answer that are the same once tokenized, or differ in whitespace alone: they "
                       "prefer nothing and were skipped (remove them from the data to silence this)")
        if self.empty_rows and self.empty_rows >= self.EMPTY_WARNING * self.rows_read:
            rows = self.shown(self.empty_lines, self.empty_rows)
            out.append(f"{self.name + ': ' if named else ''}{self.empty_rows:,} of {self.rows_read:,} rows ({rows}) "
                       "have no text (the field empty, null, or missing from the row) and were skipped: check the "
                       "field name (data.text_field), and whether those rows hold their text under another key")
        if self.empty_turn_rows:
            rows = self.shown(self.empty_turn_lines, self.empty_turn_rows)
            out.append(f"{self.name + ': ' if named else ''}{self.empty_turn_rows:,} rows ({rows}) have an empty "
                       f"{'prompt, or an assistant turn' if self.pairs else 'assistant turn'} (or only whitespace): "
                       "they teach the model to answer nothing, or answers to no question (check the field names, "
                       "and fill or remove those rows)")
        unknown = self.unknown_tokens / max(1, self.tokens_read)
        if unknown >= self.UNKNOWN_WARNING:
            out.append(f"{self.name + ': ' if named else ''}{100 * unknown:.1f}% of the tokens "
                       f"({self.unknown_tokens:,} of {self.tokens_read:,}) are the tokenizer's unknown token: its "
                       "vocabulary does not cover this text, and a model learns nothing from them (use the model's own "
                       "tokenizer, or model.tokenizer: bpe:8192 to train one on this data)")
        return out


@dataclass
class DataStats:
    """Every source's stats, and their sums."""

    sources: list[SourceStats] = field(default_factory=list)

    def total(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.sources)

    @property
    def train_sequences(self) -> int:
        return self.total("train_sequences")

    @property
    def eval_rows(self) -> int:
        return self.total("eval_rows")

    def summary(self) -> str:
        if len(self.sources) == 1:
            return self.sources[0].summary()
        return "; ".join(f"{s.name}: {s.summary()}" for s in self.sources)

    def warnings(self, recipe) -> list[str]:
        return [w for s in self.sources for w in s.warnings(recipe.data.seq_len, named=len(self.sources) > 1)]


@dataclass
class SourceData:
    """One source, prepared: its tables (memory-mapped) and what the build found."""

    config: SourceConfig
    train: TokenTable
    eval: TokenTable | None
    stats: SourceStats
    folder: Path
    built: bool = False
    """Built by this process (else read from the cache)."""

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def weight(self) -> float:
        return self.config.weight

    @property
    def per_unit(self) -> int:
        """Sequences per training unit: 2 for preference pairs, else 1."""
        return 2 if self.stats.pairs else 1

    def units(self, split: str = "train") -> int:
        table = self.train if split == "train" else self.eval
        return 0 if table is None else len(table) // self.per_unit

    def sequences(self, unit: int, split: str = "train") -> list[Sequence]:
        table = self.train if split == "train" else self.eval
        return [table.sequence(unit * self.per_unit + k) for k in range(self.per_unit)]

    def costs(self):
        """Loss-carrying tokens of each training unit (memory-mapped; a pair's two sequences summed on access)."""
        return self.train.labels if self.per_unit == 1 else _PairSums(self.train.labels)


class _PairSums:
    """costs[j] = labels[2j] + labels[2j+1], without an array of them."""

    def __init__(self, labels):
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels) // 2

    def __getitem__(self, j: int) -> int:
        return int(self.labels[2 * j]) + int(self.labels[2 * j + 1])


@dataclass
class PreparedData:
    """The mixture's sources, prepared. Training units are numbered over the sources one after the other (source i's
    sequence j is `offsets[i] + j`), which is how the sampler hands them out."""

    sources: list[SourceData]
    mix_by: str
    identity: dict = field(default_factory=dict)
    """What each source was when it was read (data/identity.py `data_identity`): a checkpoint records it."""
    stats: DataStats = field(init=False)

    def __post_init__(self):
        self.stats = DataStats([s.stats for s in self.sources])
        self.offsets = np.concatenate([[0], np.cumsum([s.units() for s in self.sources])]).astype(np.int64)

    @property
    def pairs(self) -> bool:
        """Preference data: a training unit is a pair of sequences (chosen, rejected)."""
        return self.sources[0].per_unit == 2

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def split(self, unit: int) -> tuple[int, int]:
        """(source index, unit within its train table) of a unit id."""
        source = int(np.searchsorted(self.offsets, unit, side="right")) - 1
        return source, unit - int(self.offsets[source])

    def content_digest(self) -> int:
        """What training reads, the same wherever the same data was prepared (each machine prepares its own, from its
        own cache): every table's counts and the tokens and sequence bounds at its start and end, not the files'
        paths or times. A positive int64, for a collective to compare."""
        digest = hashlib.sha256()
        for source in self.sources:
            for table in (source.train, source.eval):
                if table is None:
                    digest.update(b"no table")
                    continue
                digest.update(f"{len(table)} {table.meta['tokens']}".encode())
                for part in (table.tokens[:DIGEST_SAMPLE], table.tokens[-DIGEST_SAMPLE:], table.starts[:DIGEST_SAMPLE],
                             table.starts[-DIGEST_SAMPLE:]):
                    digest.update(np.ascontiguousarray(part).tobytes())
        return int.from_bytes(digest.digest()[:8], "big") >> 1

    def sequences(self, unit: int) -> list[Sequence]:
        """The sequences of a training unit: one, or a preference pair's chosen and rejected (in that order)."""
        source, j = self.split(unit)
        return self.sources[source].sequences(j)

    def sequence(self, unit: int) -> Sequence:
        """The sequence of a unit of one sequence (not a pair)."""
        (sequence,) = self.sequences(unit)
        return sequence

    def label_count(self, unit: int) -> int:
        source, j = self.split(unit)
        return self.sources[source].costs()[j]

    def chosen_label_count(self, unit: int) -> int:
        """Loss-carrying tokens of a pair's chosen answer (ORPO's SFT term is normalized by them)."""
        source, j = self.split(unit)
        return int(self.sources[source].train.labels[2 * j])

    def length(self, unit: int) -> int:
        source, j = self.split(unit)
        per = self.sources[source].per_unit
        return sum(self.sources[source].train.length(j * per + k) for k in range(per))

    def tokens_by_source(self, units: list[int]) -> dict[str, int]:
        """Loss-carrying tokens of these units, per source name (every source present, 0 if none)."""
        out = dict.fromkeys(self.names, 0)
        for unit in units:
            source, j = self.split(unit)
            out[self.sources[source].name] += int(self.sources[source].costs()[j])
        return out

    def sampler(self, training, *, world_size: int, rank: int, equal_shares: bool = False) -> GlobalBatchSampler:
        """The global batches of a run on `world_size` ranks (see sampler.py). `equal_shares` (only `verify`'s proof
        that its data check can fail) ignores the weights."""
        costs = [s.costs() for s in self.sources] if self.mix_by == "tokens" else None
        weights = [1.0] * len(self.sources) if equal_shares else [s.weight for s in self.sources]
        return GlobalBatchSampler([s.units() for s in self.sources], weights, costs,
                                  global_batch=training.global_batch_size, micro_batch=training.micro_batch_size,
                                  world_size=world_size, rank=rank, seed=training.seed)

    def mean_costs(self) -> list[float] | None:
        """Mean loss-carrying tokens per training unit of each source (mix_by tokens), for the epoch estimate."""
        if self.mix_by != "tokens":
            return None
        return [s.stats.label_tokens / max(1, s.units()) for s in self.sources]


def too_little_data(recipe, sequences: int) -> Problem | None:
    """One optimizer step needs a global batch of training sequences; fewer, and nothing would train."""
    t = recipe.training
    if sequences >= t.global_batch_size:
        return None
    return Problem(recipe.where("training.global_batch_size"), f"{t.global_batch_size} sequences per optimizer step, "
                   f"but the data has only {sequences:,} training sequences (after packing and the held-out split)",
                   f"use a global batch of at most {max(1, sequences)} or more data (data.path, data.max_rows)")


def warmup_beyond_the_run(recipe, sequences: int) -> Problem | None:
    """Warm-up longer than a run whose length training.epochs gives (with max_steps the recipe check says it): the
    learning rate would never reach training.lr and the schedule's decay would never start."""
    t = recipe.training
    if t.max_steps is not None:
        return None
    steps = total_steps(recipe, sequences)
    if t.warmup_steps <= steps:
        return None
    epochs = t.epochs if t.epochs is not None else 1.0
    return Problem(recipe.where("training.warmup_steps"), f"{t.warmup_steps} warm-up steps exceed the run's {steps:,} "
                   f"optimizer steps ({epochs:g} epoch(s) of {sequences:,} training sequences, "
                   f"{t.global_batch_size} per step)",
                   f"set training.warmup_steps to at most {steps:,}, e.g. {max(0, steps // 10):,} (a tenth of the "
                   "run), or train longer (training.epochs)")
