"""Training data: each source read, checked, split, tokenized and packed into a table on disk, once; then the mixture.

Flow, per source (data.sources, or data.path as a mixture of one): `SourceReader` (sources.py) streams its rows ->
the held-out split (a seeded choice of round(rows x eval_fraction) rows, decided per row as it passes) ->
`ExampleTokenizer` (tokenize.py) checks each row and turns it into token ids and a loss mask -> `TableWriter`
(store.py) truncates or packs them into sequences in the cache. Memory is bounded by a batch of rows, not the corpus.

The cache: `<cache>/tokenized/<key>/` holds a source's `train/` and `eval/` tables and `stats.json`, written last.
The key covers everything that changes the tables (the file's path, size and modification time or the hub id, the
format and field names, seq_len, packing, the held-out fraction and seed, the tokenizer), not the mixture's weights:
changing a weight, or adding a source, tokenizes nothing again. A folder is built under a temporary name and renamed
when complete, with a lock file held meanwhile (`fcntl.flock`: the one builder of a cache shared by several machines
over NFS or a parallel filesystem; on a cache of its own, each machine builds its own), so a half-written cache is
never read. `accel-fsdp data prepare` builds exactly what a run would, ahead of it.

The vocabulary: an *example* is a row of a source; a *sequence* is what training reads (one example, or several
packed into at most seq_len tokens); batch sizes count sequences. Batches are made in batches.py, their order in
sampler.py. This module imports no torch (`recipe validate` uses it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from accel_fsdp.config.recipe import SourceConfig
from accel_fsdp.data.sampler import GlobalBatchSampler, held_out
from accel_fsdp.data.sources import SourceReader, locate, source_key
from accel_fsdp.data.store import IGNORE_INDEX, Sequence, TableWriter, TokenTable, id_dtype, table_damage
from accel_fsdp.data.synthetic import VERSION as BUILTIN_VERSION
from accel_fsdp.data.tokenize import Example, ExampleTokenizer, fit_pair
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.hardware import usable_cores
from accel_fsdp.layout import cache_dir

CACHE_VERSION = 6
"""Bump when the tables change, so caches are rebuilt."""
BATCH_ROWS = 4096
BATCH_BYTES = 1 << 20
"""A batch of rows read and tokenized at once: at most this many rows or (JSON Lines) bytes of them. The encoder's
output for a batch (its Encoding structs, then the Python lists of ids) is about 40 times the batch's text: 1 MB
keeps a build's memory within ~50 MB of the process's, and measured as fast as larger batches (100 MB of code on 2
cores: 1 MB batches 14.7 s, peak +45 MB; 8 MB batches 16 s, peak +300 MB)."""
STATS_FILE = "stats.json"

__all__ = ["IGNORE_INDEX", "DataStats", "PreparedData", "SourceData", "SourceStats", "check_source_rows", "load_data",
           "prepare_data", "prepare_source", "too_little_data"]


@dataclass
class SourceStats:
    """What reading and tokenizing one source found (stats.json of its cache folder)."""

    name: str = ""
    format: str = "text"
    rows_read: int = 0
    empty_rows: int = 0
    """Rows of a text source whose text is empty: skipped."""
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

    TRUNCATION_WARNING = 0.05
    UNKNOWN_WARNING = 0.01

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
        return "; ".join(parts)

    def warnings(self, seq_len: int, named: bool = False) -> list[str]:
        out = []
        share = self.no_label_rows / max(1, self.train_rows)
        if share >= self.TRUNCATION_WARNING:
            out.append(f"{self.name + ': ' if named else ''}{100 * share:.0f}% of the training examples "
                       f"({self.no_label_rows:,} of {self.train_rows:,}) lost all their loss-carrying tokens to "
                       f"truncation at data.seq_len = {seq_len}: they are trained on nothing (raise data.seq_len, or "
                       "shorten the prompts)")
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


# ---------------------------------------------------------------------------------------------------- building


def prepare_data(recipe, tokenizer, accelerator=None) -> PreparedData:
    """Every source of the recipe, prepared (from the cache, or built now). With an `accelerator`, the first process
    of each machine builds while the others wait, and a failure there stops every rank with the message shown once."""
    error: UserError | None = None
    builds = accelerator is None or accelerator.is_local_main_process
    if builds:
        try:
            for i, source in enumerate(recipe.data.resolved_sources()):
                prepare_source(recipe, tokenizer, i, source)
        except UserError as e:
            e.rank_local = accelerator is not None and not accelerator.is_main_process  # another machine's builder
            error = e
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        if not all(gather_object([error is None])) and error is None:
            raise UserError("the data could not be prepared (the message is above)")
    if error is not None:
        raise error
    return load_data(recipe, tokenizer)


def load_data(recipe, tokenizer) -> PreparedData:
    """The prepared sources from the cache (built by `prepare_source`)."""
    out = []
    for i, source in enumerate(recipe.data.resolved_sources()):
        folder = cache_folder(recipe, tokenizer, i, source)
        stats = read_stats(folder)
        evaluation = TokenTable(folder / "eval") if (folder / "eval" / "table.json").exists() else None
        out.append(SourceData(source, TokenTable(folder / "train"), evaluation, stats, folder))
    return PreparedData(out, recipe.data.mix_by)


def read_stats(folder: Path) -> SourceStats:
    saved = json.loads((folder / STATS_FILE).read_text())
    return SourceStats(**{k: v for k, v in saved.items() if k in {f.name for f in fields(SourceStats)}})


def prepare_source(recipe, tokenizer, index: int, source: SourceConfig) -> tuple[Path, bool]:
    """The cache folder of one source, built now unless it is complete already: (folder, built now)."""
    folder = cache_folder(recipe, tokenizer, index, source)
    if (folder / STATS_FILE).exists() and not entry_damage(folder):
        return folder, False
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _BuildLock(folder.with_name(folder.name + ".lock")):
        if (folder / STATS_FILE).exists():  # another machine sharing this cache built it while we waited
            damage = entry_damage(folder)
            if not damage:
                return folder, False
            print(f"note: the cache entry {folder} is damaged ({damage}); building it again", file=sys.stderr)
        tmp = folder.with_name(f".{folder.name}.tmp-{socket.gethostname()}-{os.getpid()}")
        for dead in folder.parent.glob(f".{folder.name}.tmp-*"):  # builds killed half-way: we hold the lock
            shutil.rmtree(dead, ignore_errors=True)
        try:
            stats = _build(recipe, tokenizer, index, source, tmp)
            (tmp / STATS_FILE).write_text(json.dumps(asdict(stats), indent=1))
            if folder.exists():  # left incomplete by hand or by a filesystem that lost the rename: never read
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder, True


def entry_damage(folder: Path) -> str | None:
    """What is wrong with a finished cache entry (a table truncated or removed since it was written), or None."""
    for split in ("train", "eval"):
        table = folder / split
        if split == "train" or table.exists():
            damage = table_damage(table)
            if damage:
                return f"{split}/{damage}"
    return None


def _build(recipe, tokenizer, index: int, source: SourceConfig, folder: Path) -> SourceStats:
    d = recipe.data
    _use_cores(d.num_proc)
    start = time.monotonic()
    reader = SourceReader(recipe, source, index).open()
    if source.format == "chat" and not tokenizer.chat_template:
        raise UserError(Problem(recipe.where(f"data.sources.{index}.format" if d.sources else "data.format"),
                                "chat data needs a tokenizer with a chat template, and "
                                f"{recipe.model.tokenizer or recipe.model.name_or_path!r} has none",
                                "use an instruct/chat model's tokenizer (model.tokenizer), or format: instruction"))
    rows = reader.count()
    n_eval, chooser = held_out(rows, d.eval_fraction, recipe.training.seed, salt=index)
    pairs = source.format == "preference"
    packing = ("stream" if source.format == "text" else "bins") if d.packs(source) and not pairs else "none"
    dtype = id_dtype(len(tokenizer))
    masked = source.format != "text"
    train = TableWriter(folder / "train", dtype=dtype, masked=masked, seq_len=d.seq_len, packing=packing)
    evaluation = TableWriter(folder / "eval", dtype=dtype, masked=masked, seq_len=d.seq_len, packing=packing) \
        if n_eval else None
    tokenize = ExampleTokenizer(tokenizer, source, reader)
    unknown = tokenizer.unk_token_id  # not counted where it doubles as a special token (GPT-2's is <|endoftext|>)
    if unknown in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id):
        unknown = None
    stats = SourceStats(name=source.name, format=source.format, rows_read=rows, packed=packing != "none",
                        pairs=pairs)
    seen = 0
    for numbers, batch, examples in tokenize.stream(reader.batches(BATCH_ROWS, BATCH_BYTES)):
        held = chooser.many(np.arange(seen, seen + len(batch))) < n_eval if chooser else np.zeros(len(batch), bool)
        is_eval = dict(zip(numbers, held.tolist()))
        seen += len(batch)
        reader.raise_problems()
        stats.tokens_read += sum(len(ex.ids) for ex in examples)
        if unknown is not None:
            stats.unknown_tokens += sum(int(np.count_nonzero(ex.ids == unknown)) for ex in examples)
        parts: dict[bool, list] = {False: [], True: []}
        groups = [examples[k:k + 2] for k in range(0, len(examples), 2)] if pairs else [[ex] for ex in examples]
        for group in groups:
            held_row = is_eval[group[0].row]
            if pairs:
                chosen, rejected, cut, answer_cut = fit_pair(group[0], group[1], d.seq_len)
                if answer_cut and np.array_equal(chosen.ids, rejected.ids):
                    reader.bad("same once cut", chosen.row, f"the chosen and the rejected answer are the same once "
                               f"cut to data.seq_len = {d.seq_len} tokens: they differ only after that",
                               "raise data.seq_len, or shorten the answers", "data.seq_len")
                group = [chosen, rejected]
                stats.prompts_cut += cut and not held_row
                stats.truncated += answer_cut and not held_row
            elif packing != "stream" and len(group[0]) > d.seq_len:
                ex = group[0]
                group = [Example(ex.ids[:d.seq_len], None if ex.mask is None else ex.mask[:d.seq_len], ex.row)]
                stats.truncated += not held_row
            if not held_row and not all(ex.mask[1:].any() if ex.mask is not None else len(ex) > 1 for ex in group):
                stats.no_label_rows += 1
            parts[held_row] += [(ex.ids, ex.mask) for ex in group]
            stats.train_rows += not held_row
            stats.eval_rows += held_row
        reader.raise_problems()
        train.add(parts[False])
        if evaluation is not None:
            evaluation.add(parts[True])
    stats.empty_rows = tokenize.empty
    table = train.close()
    if evaluation is not None:
        stats.eval_sequences = evaluation.close()["sequences"]
    stats.train_sequences, stats.train_tokens, stats.label_tokens = table["sequences"], table["tokens"], \
        table["label_tokens"]
    where = recipe.where(source_key(recipe, index))
    if stats.train_sequences == 0:
        raise UserError(Problem(where, f"{source.path} has no non-empty training rows"
                                + (f" ({stats.eval_rows} held out)" if stats.eval_rows else ""),
                                "put text in the rows (or remove the source from the mixture)"))
    if stats.label_tokens == 0:
        fields_ = {"instruction": f"its output field ({source.output_field!r})", "chat": "the assistant messages",
                   "preference": "the answers"}
        raise UserError(Problem(where, "no training example keeps a token that carries a loss "
                                f"({stats.no_label_rows:,} of {stats.train_rows:,} lost it to truncation at "
                                f"data.seq_len = {d.seq_len}, or have none), so nothing would be learned",
                                f"raise data.seq_len, or check {fields_.get(source.format, 'the data')}"))
    if stats.packed:
        stats.packing_efficiency = stats.train_tokens / (stats.train_sequences * d.seq_len)
    stats.seconds = round(time.monotonic() - start, 3)
    return stats


def check_source_rows(recipe, index: int, source: SourceConfig) -> int:
    """Read a source and check every row for its format, without a tokenizer (for `recipe validate` when the
    tokenizer is not on this machine). Returns the rows read; raises the problems found."""
    reader = SourceReader(recipe, source, index).open()
    check = ExampleTokenizer(None, source, reader)
    rows = 0
    for numbers, batch in reader.batches(BATCH_ROWS, BATCH_BYTES):
        check(numbers, batch)
        reader.raise_problems()
        rows += len(batch)
    return rows


def _use_cores(num_proc: int | None) -> None:
    """The tokenizer's Rust thread pool (rayon) takes RAYON_NUM_THREADS when it starts: the cores this process may use
    (or data.num_proc), not the machine's count, which a job's cgroup or taskset may not allow."""
    if num_proc or "RAYON_NUM_THREADS" not in os.environ:
        os.environ["RAYON_NUM_THREADS"] = str(num_proc or usable_cores())


def cache_folder(recipe, tokenizer, index: int, source: SourceConfig) -> Path:
    return cache_dir() / "tokenized" / source_cache_key(recipe, tokenizer, index, source)


def source_cache_key(recipe, tokenizer, index: int, source: SourceConfig) -> str:
    """Everything that changes a source's tables, hashed; not its weight, name or place in the mixture (the held-out
    split's salt is its place, so a source moved in the list is split again: a rare, cheap rebuild)."""
    d = recipe.data
    where = locate(recipe, source, source_key(recipe, index))
    if where.kind == "file" and os.path.exists(where.path):
        st = os.stat(where.path)
        identity = [os.path.abspath(where.path), st.st_size, st.st_mtime_ns]
    elif where.kind == "builtin":
        identity = [source.path, BUILTIN_VERSION]
    else:
        identity = [where.name, source.hub_config, source.split]
    tok = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer)
    parts = {
        "version": CACHE_VERSION, "identity": identity, "index": index,
        "source": {k: v for k, v in asdict(source).items() if k not in ("name", "weight", "path")},
        "seq_len": d.seq_len, "packing": d.packs(source), "eval_fraction": d.eval_fraction,
        "seed": recipe.training.seed, "tokenizer": hashlib.sha256(tok.encode()).hexdigest(),
        "chat_template": tokenizer.chat_template,
        "special": [tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


class _BuildLock:
    """An exclusive lock on a file next to the cache folder, for the life of a build. flock on a local disk; on NFS
    Linux turns it into a POSIX byte-range lock, which the server arbitrates between machines."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        import fcntl

        self.file = open(self.path, "a")
        fcntl.flock(self.file.fileno(), fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        import fcntl

        fcntl.flock(self.file.fileno(), fcntl.LOCK_UN)
        self.file.close()


def too_little_data(recipe, sequences: int) -> Problem | None:
    """One optimizer step needs a global batch of training sequences; fewer, and nothing would train."""
    t = recipe.training
    if sequences >= t.global_batch_size:
        return None
    return Problem(recipe.where("training.global_batch_size"), f"{t.global_batch_size} sequences per optimizer step, "
                   f"but the data has only {sequences:,} training sequences (after packing and the held-out split)",
                   f"use a global batch of at most {max(1, sequences)} or more data (data.path, data.max_rows)")
