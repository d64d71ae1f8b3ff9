"""Building one source's tables: its rows read and checked (sources.py), the held-out split, tokenized (tokenize.py),
and truncated or packed into tables (store.py), a batch of rows at a time.

The held-out split is a seeded choice of round(rows x eval_fraction) rows, decided per row as it passes. Memory is
bounded by a batch of rows, not the corpus (and a row by sources.py MAX_ROW_BYTES). Preference pairs whose answers
are the same tokens, or differ in whitespace alone, prefer nothing: a few are skipped and counted, a corpus of mostly
such pairs is refused (NO_SIGNAL_REFUSED). This module writes only inside the folder it is given (prepare.py builds
into a temporary folder and publishes it when complete) and imports no torch.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from accel_fsdp.config.recipe import SourceConfig
from accel_fsdp.data.encoder import template_syntax_error
from accel_fsdp.data.mixture import SourceStats
from accel_fsdp.data.sampler import held_out
from accel_fsdp.data.sources import SourceReader, source_key
from accel_fsdp.data.store import TableWriter, id_dtype
from accel_fsdp.data.tokenize import Example, ExampleTokenizer, fit_pair
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.hardware import usable_cores

BATCH_ROWS = 4096
BATCH_BYTES = 1 << 20
"""A batch of rows read and tokenized at once: at most this many rows or (JSON Lines) bytes of them. The encoder's
output for a batch (its Encoding structs, then the Python lists of ids) is about 40 times the batch's text: 1 MB
keeps a build's memory within ~50 MB of the process's, and measured as fast as larger batches (100 MB of code on 2
cores: 1 MB batches 14.7 s, peak +45 MB; 8 MB batches 16 s, peak +300 MB)."""
NO_SIGNAL_REFUSED = 0.5
"""Share of a source's pairs without a preference (answers the same tokens, or differing in whitespace alone) from
which the source is refused rather than trained on without them: a corpus mostly of such pairs is a mistake (a
wrong field, answers copied), a few are noise to skip."""
INTERRUPTED = threading.Event()
"""Set by the Ctrl-C handler of `accel-fsdp data` (cli/data.py `interruptible`): a build stops at its next batch.
The KeyboardInterrupt the handler raises lands wherever the interpreter is, a `__del__` included (the tokenizer's
`regex` has one), where Python prints it and drops it; this event outlives it."""


def build_source(recipe, tokenizer, index: int, source: SourceConfig, folder, *, delay: float = 0.0) -> SourceStats:
    """Read, check, split, tokenize and pack source `index` into `folder` (its `train/` and `eval/` tables); return
    what the build found. `delay`: seconds to wait first (a test's slow build only)."""
    start = time.monotonic()
    if delay:
        time.sleep(delay)
    _use_cores(recipe.data.num_proc)
    reader = SourceReader(recipe, source, index).open()
    if source.format == "chat" and not tokenizer.chat_template:
        d = recipe.data
        raise UserError(Problem(recipe.where(f"data.sources.{index}.format" if d.sources else "data.format"),
                                "chat data needs a tokenizer with a chat template, and "
                                f"{recipe.model.tokenizer or recipe.model.name_or_path!r} has none",
                                "use an instruct/chat model's tokenizer (model.tokenizer), or format: instruction"))
    if source.format != "text" and tokenizer.chat_template and (wrong := template_syntax_error(tokenizer)):
        m = recipe.model
        raise UserError(Problem(recipe.where("model.tokenizer" if m.tokenizer else "model.name_or_path"),
                                f"the chat template of {m.tokenizer or m.name_or_path!r} is not valid Jinja: {wrong}",
                                "correct the template (chat_template.jinja, or chat_template in "
                                "tokenizer_config.json), or use another tokenizer"))
    build = _Build(recipe, tokenizer, index, source, reader, folder)
    # The next batch is read and rendered while this one encodes (tokenize.py ExampleTokenizer.stream).
    for numbers, batch, examples in build.tokenize.stream(reader.batches(BATCH_ROWS, BATCH_BYTES)):
        if INTERRUPTED.is_set():
            raise KeyboardInterrupt
        build.add(numbers, batch, examples)
    stats = build.finish()
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


class _Build:
    """One source's build in progress: its table writers, the held-out choice and the stats so far."""

    def __init__(self, recipe, tokenizer, index: int, source: SourceConfig, reader: SourceReader, folder):
        d = recipe.data
        self.recipe, self.tokenizer, self.index, self.source, self.reader = recipe, tokenizer, index, source, reader
        self.seq_len, self.pairs = d.seq_len, source.format == "preference"
        rows = reader.count()
        self.n_eval, self.chooser = held_out(rows, d.eval_fraction, recipe.training.seed, salt=index)
        packs = d.packs(source) and not self.pairs
        self.packing = ("stream" if source.format == "text" else "bins") if packs else "none"
        kwargs = dict(dtype=id_dtype(len(tokenizer)), masked=source.format != "text", seq_len=d.seq_len,
                      packing=self.packing)
        self.train = TableWriter(folder / "train", **kwargs)
        self.evaluation = TableWriter(folder / "eval", **kwargs) if self.n_eval else None
        self.tokenize = ExampleTokenizer(tokenizer, source, reader)
        self.unknown = tokenizer.unk_token_id  # not counted where it doubles as a special token (GPT-2's is EOS)
        if self.unknown in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id):
            self.unknown = None
        self.stats = SourceStats(name=source.name, format=source.format, rows_read=rows,
                                 packed=self.packing != "none", pairs=self.pairs)
        self.seen = 0
        self.first_no_signal: tuple[int, str] | None = None

    def add(self, numbers: list[int], batch: list[dict], examples: list[Example]) -> None:
        """One batch of rows and their examples (tokenized): held out or not, fitted to seq_len, appended to its
        table."""
        if self.chooser is not None:
            held = self.chooser.many(np.arange(self.seen, self.seen + len(batch))) < self.n_eval
        else:
            held = np.zeros(len(batch), bool)
        is_eval = dict(zip(numbers, held.tolist()))
        self.seen += len(batch)
        self.reader.raise_problems()
        self._count_tokens(examples)
        groups = self._pairs(examples, is_eval) if self.pairs else [[self._fit(ex, is_eval[ex.row])] for ex in examples]
        parts: dict[bool, list] = {False: [], True: []}
        for group in groups:
            held_row = is_eval[group[0].row]
            if not held_row and not all(ex.mask[1:].any() if ex.mask is not None else len(ex) > 1 for ex in group):
                self.stats.no_label_rows += 1
            parts[held_row] += [(ex.ids, ex.mask) for ex in group]
            self.stats.train_rows += not held_row
            self.stats.eval_rows += held_row
        self.reader.raise_problems()
        self.train.add(parts[False])
        if self.evaluation is not None:
            self.evaluation.add(parts[True])

    def _count_tokens(self, examples: list[Example]) -> None:
        self.stats.tokens_read += sum(len(ex.ids) for ex in examples)
        if self.unknown is not None:
            self.stats.unknown_tokens += sum(int(np.count_nonzero(ex.ids == self.unknown)) for ex in examples)

    def _fit(self, ex: Example, held_row: bool) -> Example:
        """An example of one sequence within seq_len (truncated and counted), unless packing streams it."""
        if self.packing == "stream" or len(ex) <= self.seq_len:
            return ex
        self.stats.truncated += not held_row
        return Example(ex.ids[:self.seq_len], None if ex.mask is None else ex.mask[:self.seq_len], ex.row)

    def _pairs(self, examples: list[Example], is_eval: dict[int, bool]) -> list[list[Example]]:
        """Preference pairs fitted to seq_len (prompts cut from the left first), without those that prefer nothing:
        the same answer tokens, or answers that differ in whitespace alone (found by decoding the differing ones)."""
        fitted, differing = [], []
        for k in range(0, len(examples), 2):
            chosen, rejected, cut, answer_cut = fit_pair(examples[k], examples[k + 1], self.seq_len)
            if np.array_equal(chosen.ids, rejected.ids):
                how = (f"once cut to data.seq_len = {self.seq_len} tokens: they differ only after that" if answer_cut
                       else "once tokenized")
                self._no_signal(chosen.row, how)
                continue
            fitted.append((chosen, rejected, cut, answer_cut))
            differing += [chosen.ids[chosen.mask], rejected.ids[rejected.mask]]
        texts = self.tokenizer.batch_decode([ids.tolist() for ids in differing], skip_special_tokens=True)
        out = []
        for j, (chosen, rejected, cut, answer_cut) in enumerate(fitted):
            if "".join(texts[2 * j].split()) == "".join(texts[2 * j + 1].split()):
                self._no_signal(chosen.row, "but for whitespace")
                continue
            self.stats.prompts_cut += cut and not is_eval[chosen.row]
            self.stats.truncated += answer_cut and not is_eval[chosen.row]
            out.append([chosen, rejected])
        return out

    def _no_signal(self, row: int, how: str) -> None:
        self.stats.no_signal_pairs += 1
        self.stats.no_signal_lines = sorted(self.stats.no_signal_lines + [row])[:SourceStats.SHOWN_ROWS]
        if self.first_no_signal is None or row < self.first_no_signal[0]:
            self.first_no_signal = (row, how)

    def finish(self) -> SourceStats:
        """Close the tables; refuse a source that trains nothing (no rows, no loss token, pairs that prefer
        nothing)."""
        stats = self.stats
        stats.empty_rows, stats.empty_lines = self.tokenize.empty, self.tokenize.empty_lines
        stats.empty_turn_rows, stats.empty_turn_lines = self.tokenize.empty_turns, self.tokenize.empty_turn_lines
        table = self.train.close()
        if self.evaluation is not None:
            stats.eval_sequences = self.evaluation.close()["sequences"]
        stats.train_sequences, stats.train_tokens = table["sequences"], table["tokens"]
        stats.label_tokens = table["label_tokens"]
        self._refuse_no_signal()
        where = self.recipe.where(source_key(self.recipe, self.index))
        if stats.train_sequences == 0:
            raise UserError(Problem(where, f"{self.source.path} has no non-empty training rows"
                                    + (f" ({stats.eval_rows} held out)" if stats.eval_rows else ""),
                                    "put text in the rows (or remove the source from the mixture)"))
        if stats.label_tokens == 0:
            fields_ = {"instruction": f"its output field ({self.source.output_field!r})",
                       "chat": "the assistant messages", "preference": "the answers"}
            raise UserError(Problem(where, "no training example keeps a token that carries a loss "
                                    f"({stats.no_label_rows:,} of {stats.train_rows:,} lost it to truncation at "
                                    f"data.seq_len = {self.seq_len}, or have none), so nothing would be learned",
                                    f"raise data.seq_len, or check {fields_.get(self.source.format, 'the data')}"))
        if stats.packed:
            stats.packing_efficiency = stats.train_tokens / (stats.train_sequences * self.seq_len)
        return stats

    def _refuse_no_signal(self) -> None:
        stats = self.stats
        pairs = stats.no_signal_pairs + stats.train_rows + stats.eval_rows
        if not stats.no_signal_pairs or stats.no_signal_pairs < NO_SIGNAL_REFUSED * pairs:
            return
        row, how = self.first_no_signal
        cut = how.startswith("once cut")
        self.reader.bad("no preference", row, f"the chosen and the rejected answer are the same {how} ("
                        f"{stats.no_signal_pairs:,} of {pairs:,} pairs are so: they prefer nothing)",
                        "raise data.seq_len, or shorten the answers" if cut else
                        "check chosen_field and rejected_field, and remove the pairs whose answers are the same",
                        "data.seq_len" if cut else None)
        self.reader.raise_problems()
