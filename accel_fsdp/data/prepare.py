"""Training data, prepared: each source built once into the cache (build.py), checked before it is trusted, and read
back as the mixture training reads (mixture.py). `prepare_data` is the one path: `accel-fsdp data prepare`, the
checks before a launch (preflight.py) and the ranks (train/setup.py) all call it, and it refuses data that does not
fill one global batch before any model is loaded.

Flow, per source (data.sources, or data.path as a mixture of one): `SourceReader` (sources.py) streams its rows ->
the held-out split -> `ExampleTokenizer` (tokenize.py) -> `TableWriter` (store.py), in build.py.

The cache: `<cache>/tokenized/<key>/` holds a source's `train/` and `eval/` tables and `stats.json`. The key covers
everything that changes the tables (the source's identity: data/identity.py; the format and field names, seq_len,
packing, the held-out fraction and seed, the tokenizer), not the mixture's weights: changing a weight, or adding a
source, tokenizes nothing again. An entry is built under a temporary name and published by one rename when complete
(files.py), with a lock file held meanwhile (`files.FileLock`: the one builder of a cache shared by several machines
over NFS or a parallel filesystem; on a cache of its own, each machine builds its own), so a half-written entry is
never read, and Ctrl-C leaves none. An entry is checked before it is used: its stats, every table file's size and
CRC-32 (once per run, by the process that would build it), the held-out table the stats promise; a damaged entry is
built again, with a line saying so.

The vocabulary: an *example* is a row of a source; a *sequence* is what training reads (one example, or several
packed into at most seq_len tokens); batch sizes count sequences. This module imports no torch (`recipe validate`
uses it).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path

from accel_fsdp.config.recipe import SourceConfig
from accel_fsdp.data.build import build_source, check_source_rows
from accel_fsdp.data.identity import data_identity, digest, source_identity, tokenizer_identity
from accel_fsdp.data.mixture import (PreparedData, SourceData, SourceStats, too_little_data,
                                    warmup_beyond_the_run)
from accel_fsdp.data.sources import ineffective_settings
from accel_fsdp.data.store import TokenTable, table_damage
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.files import (FileLock, failing_write, new_temporary_folder, publish_folder, remove, temporaries_of,
                              write_atomic)
from accel_fsdp.layout import cache_dir

CACHE_VERSION = 9
"""Bump when the tables change, so caches are rebuilt. 7: tables carry CRC-32s; pairs without a preference are
skipped; keys from data/identity.py. 8: a CSV cell is the text it holds (a number's digits as written; NA, None and
null are words, no longer skipped rows); a .txt file's byte-order mark is not text. 9: an assistant turn after a
generation prompt its rendered turns leave out (DeepSeek-R1's "<think>") carries a loss from its first token; an
EOS the tokenizer appends itself is not written twice, nor inside a prompt."""
STATS_FILE = "stats.json"

__all__ = ["PreparedData", "SourceData", "SourceStats", "cache_folder", "check_source_rows", "entry_damage",
           "load_data", "prepare_data", "prepare_source", "read_stats", "too_little_data"]

Wait = Callable[[UserError | None], None]
"""Holds a rank until every rank is done with its part of the preparation (the first rank of each machine builds):
raises that rank's own error, or one saying another rank failed. train/ provides it; None: a single process."""


def prepare_data(recipe, tokenizer, *, build: bool = True, wait: Wait | None = None, delay: float = 0.0,
                 say: Callable[[str], None] | None = None) -> PreparedData:
    """Every source of the recipe prepared (from the cache, checked, or built now), the mixture read back, and checked
    to fill a global batch. `build`: this process builds what is missing (in the ranks, the first of each machine;
    the others only read). `wait`: the ranks' rendezvous once the builders are done, which says what it waits for
    (never a collective that the build could outlast). `delay`: a test's slow build. `say`: lines for the person
    (a source being built)."""
    ineffective = ineffective_settings(recipe)
    if ineffective:
        raise UserError(ineffective, title="data settings that would change nothing")
    built: dict[int, bool] = {}
    error: UserError | None = None
    if build:
        errors = []
        for i, source in enumerate(recipe.data.resolved_sources()):
            try:
                built[i] = prepare_source(recipe, tokenizer, i, source, delay=delay, say=say)[1]
            except UserError as e:
                errors.append(e)
        if errors:
            error = errors[0] if len(errors) == 1 else UserError([p for e in errors for p in e.problems],
                                                                  title="problems with the data")
    if wait is not None:
        wait(error)
    elif error is not None:
        raise error
    data = load_data(recipe, tokenizer)
    for i, source in enumerate(data.sources):
        source.built = built.get(i, False)
    little = too_little_data(recipe, len(data)) or warmup_beyond_the_run(recipe, len(data))
    if little:
        raise UserError(little)
    return data


def prepare_source(recipe, tokenizer, index: int, source: SourceConfig, *, delay: float = 0.0,
                   say: Callable[[str], None] | None = None) -> tuple[Path, bool]:
    """The cache entry of one source, built now unless it is complete and undamaged: (folder, built now)."""
    folder = cache_folder(recipe, tokenizer, index, source)
    if (folder / STATS_FILE).exists() and not entry_damage(folder):
        return folder, False
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(folder.with_name(folder.name + ".lock")):
        if (folder / STATS_FILE).exists():  # another machine sharing this cache built it while we waited
            damage = entry_damage(folder)
            if not damage:
                return folder, False
            print(f"note: the cache entry {folder} is damaged ({damage}); building it again", file=sys.stderr,
                  flush=True)
        for dead in temporaries_of(folder):  # builds killed half-way: we hold the lock
            remove(dead)
        if say is not None:
            say(f"data: preparing {source.name} ({source.path}) into {folder} (once; cached)")
        temporary = new_temporary_folder(folder)
        try:
            with failing_write(folder):  # a full disk: one message naming the entry
                stats = build_source(recipe, tokenizer, index, source, temporary, delay=delay)
                write_atomic(temporary / STATS_FILE, json.dumps(asdict(stats), indent=1))
                # A hub dataset's revision is known once it is loaded: its entry is published under the key that
                # has it.
                folder = cache_folder(recipe, tokenizer, index, source)
                publish_folder(temporary, folder)
        except BaseException:  # Ctrl-C included: nothing half-written stays
            remove(temporary)
            raise
    return folder, True


def load_data(recipe, tokenizer) -> PreparedData:
    """The prepared sources from the cache, each entry checked to be whole (its files' sizes; their CRC-32s were
    checked by `prepare_source` in this run). One message naming the entry when it is not."""
    out = []
    for i, source in enumerate(recipe.data.resolved_sources()):
        folder = cache_folder(recipe, tokenizer, i, source)
        damage = entry_damage(folder, checksums=False)
        if damage:
            raise UserError(Problem(str(folder), f"the prepared data of {source.name} is missing or damaged ({damage})",
                                    "run `accel-fsdp data prepare` with this recipe (it builds a damaged entry "
                                    "again), or remove the folder"))
        stats = read_stats(folder)
        evaluation = TokenTable(folder / "eval") if (folder / "eval").is_dir() else None
        out.append(SourceData(source, TokenTable(folder / "train"), evaluation, stats, folder))
    return PreparedData(out, recipe.data.mix_by, data_identity(recipe))


def read_stats(folder: Path) -> SourceStats:
    """A cache entry's stats.json; ValueError when it is not one this version wrote."""
    saved = json.loads((folder / STATS_FILE).read_text())
    if not isinstance(saved, dict):
        raise ValueError("not a JSON object")
    known = {f.name: f for f in fields(SourceStats)}
    values = {k: v for k, v in saved.items() if k in known}
    for name, value in values.items():
        default = getattr(SourceStats, name, None)
        if isinstance(default, int) and not isinstance(default, bool) and not (isinstance(value, int) and value >= 0):
            raise ValueError(f"{name} is {value!r}")
    return SourceStats(**values)


def entry_damage(folder: Path, *, checksums: bool = True) -> str | None:
    """What is wrong with a finished cache entry, or None: its stats unreadable, a table missing (the held-out one
    included, when the stats count held-out rows), truncated, or (with `checksums`) changed in place."""
    if not (folder / STATS_FILE).is_file():
        return f"no {STATS_FILE}"
    try:
        stats = read_stats(folder)
    except (OSError, UnicodeDecodeError, ValueError, TypeError) as e:
        return f"{STATS_FILE} is unreadable ({type(e).__name__})"
    for split, expected in (("train", True), ("eval", stats.eval_rows > 0)):
        table = folder / split
        if expected or table.exists():
            damage = table_damage(table, checksums=checksums)
            if damage:
                return f"{split}/{damage}"
    return None


def cache_folder(recipe, tokenizer, index: int, source: SourceConfig) -> Path:
    return cache_dir() / "tokenized" / source_cache_key(recipe, tokenizer, index, source)


def source_cache_key(recipe, tokenizer, index: int, source: SourceConfig) -> str:
    """Everything that changes a source's tables, hashed; not its weight, name or place in the mixture (the held-out
    split's salt is its place, so a source moved in the list is split again: a rare, cheap rebuild)."""
    d = recipe.data
    return digest({
        "version": CACHE_VERSION, "identity": source_identity(recipe, index, source), "index": index,
        "source": {k: v for k, v in asdict(source).items() if k not in ("name", "weight", "path")},
        "seq_len": d.seq_len, "packing": d.packs(source), "eval_fraction": d.eval_fraction,
        "seed": recipe.training.seed, "tokenizer": tokenizer_identity(tokenizer),
    })
