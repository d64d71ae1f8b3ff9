"""Reading the rows of one source (an entry of data.sources, or data.path), in batches, each row checked as it passes.

A source is read as a stream, so memory stays bounded by a batch whatever the size of the corpus: JSON Lines files
(and the built-in data, written as JSON Lines) and Parquet files are read directly; CSV, a JSON list and paragraph
text go through `datasets`, whose Arrow file is memory-mapped; hub datasets are loaded by `datasets` the same way.
Every row keeps its number in the source (the line of a .jsonl file), so a bad row is named by file and line.

A mistake in the data (a missing file, a field the rows lack, a row that is not text, a file that is not UTF-8) is a
`UserError` naming the file, the line and the fix. This module imports no torch.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel_fsdp.config.recipe import DataConfig, SourceConfig
from accel_fsdp.data.file_checks import (
    COMPRESSED,
    SURROGATE_FIX,
    check_gzip,
    count_lines,
    csv_as_text,
    csv_without_rows,
    file_type,
    find_bad_json_line,
    has_text,
    json_error,
    json_type,
    lone_surrogate,
    not_text,
    not_utf8,
    not_utf8_line,
    nul_line,
    open_bytes,
    surrogate_escapes,
    utf16,
)
from accel_fsdp.data.shapes import SHAREGPT_FIELD
from accel_fsdp.data.synthetic import BUILTIN_DATA, write_builtin
from accel_fsdp.errors import Problem, UserError

JSON_FIX = "fix the file: one JSON object per line (.jsonl), or one JSON list of objects (.json)"
FILE_TYPES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
CHAT_ROLES = ("system", "user", "assistant")
TOOL_ROLES = ("tool", "function", "ipython", "function_call", "observation")
"""Roles of tool calls and their results (OpenAI's tool and older function, Llama 3.1's ipython, ShareGPT's
function_call and observation): named with what to do."""
MAX_PROBLEMS = 5
"""Bad rows reported at once (the first of each kind of problem, up to this many)."""
MAX_ROW_BYTES = 8 << 20
"""The largest row read (its text, 8 MiB: about 2M tokens, far beyond any seq_len). The encoder needs about 40 times
a text's size while it works on it, so one line of hundreds of MB would exhaust the memory and abort the process;
it is refused instead, with its file and line, before it is read whole."""


@dataclass(frozen=True)
class SourceFile:
    """Where a source's rows come from: a local file, a hub dataset, or built-in data (a generated file)."""

    kind: str
    """file, hub or builtin."""
    path: str | None
    """The local file (for builtin: the generated file), else None."""
    name: str
    """What messages call it: the path as the user wrote it, or the hub id."""

    @property
    def type(self) -> str:
        """The file's type, lowercased: .jsonl for data.jsonl, DATA.JSONL and data.jsonl.gz ('' for no file)."""
        return file_type(self.path)[0] if self.path is not None else ""

    @property
    def compressed(self) -> bool:
        return self.path is not None and file_type(self.path)[1]

    @property
    def rows_are_lines(self) -> bool:
        return self.type == ".jsonl"

    @property
    def row_word(self) -> str:
        """What a message calls a row of this file: a .jsonl file's line, a .txt file's paragraph (an example is one:
        its number counts paragraphs, not lines), else a row."""
        return "line" if self.rows_are_lines else "paragraph" if self.type == ".txt" else "row"


def locate(recipe, source: SourceConfig, key: str) -> SourceFile:
    """Resolve a source's path: a local file (relative to the working directory, else to the recipe's folder),
    builtin:NAME, hub:NAME, or owner/name when no such local file exists. `key` is the recipe key that names it."""
    path = source.path or ""
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        if name not in BUILTIN_DATA:
            raise UserError(Problem(recipe.where(key), f"no built-in dataset {name!r}",
                                    f"use one of {', '.join('builtin:' + n for n in BUILTIN_DATA)}"))
        return SourceFile("builtin", None, path)
    if path.startswith("hub:"):
        return SourceFile("hub", None, path.removeprefix("hub:"))
    p = Path(path).expanduser()
    if not p.is_absolute() and recipe.source:
        alt = Path(recipe.source).parent / p
        if not p.exists() and alt.exists():
            p = alt
        elif (p.exists() and alt.exists() and not os.path.samefile(p, alt) and key not in recipe.overridden
              and not path.startswith(("./", "../"))):
            raise UserError(Problem(recipe.where(key), f"{path} names two different files: {p.absolute()} (from "
                                    f"the working directory) and {alt.absolute()} (next to the recipe)",
                                    f"write ./{path} for the first, or the absolute path of either"))
    if not p.exists() and file_type(path)[0] not in FILE_TYPES and re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        return SourceFile("hub", None, path)  # owner/name with no such local file: a hub dataset
    return SourceFile("file", str(p), path)


FORMAT_FIELDS = {"text": ("text_field",), "instruction": ("instruction_field", "input_field", "output_field"),
                 "chat": ("messages_field",), "preference": ("prompt_field", "chosen_field", "rejected_field")}
"""The field keys each format reads."""
HUB_KEYS = ("hub_config", "split")
"""The keys that choose among a hub dataset's configurations and splits."""


def ineffective_settings(recipe) -> list[Problem]:
    """Data keys set to a value that changes nothing in this setup: `split` or `hub_config` where no source is a hub
    dataset, a field name of a format no source has (`packing` of pairs is the recipe's own check). A key of the data
    section applies to every source that does not set its own; a source's own key, to that source. Values equal to
    the defaults are left alone (a resolved recipe.yaml writes every key)."""
    d, sources = recipe.data, recipe.data.resolved_sources()
    entries = d.sources or [None] * len(sources)
    kinds = [locate(recipe, s, source_key(recipe, i)).kind for i, s in enumerate(sources)]
    defaults = type(d)()
    out = []
    for key in HUB_KEYS + tuple(k for fields in FORMAT_FIELDS.values() for k in fields):
        users = [i for i, (s, entry) in enumerate(zip(sources, entries))
                 if _applies(key, s, kinds[i]) and (entry is None or getattr(entry, key) is None)]
        if getattr(d, key) != getattr(defaults, key) and not users:
            out.append(_no_effect(recipe, f"data.{key}", getattr(d, key), key, sources, kinds))
        for i, entry in enumerate(entries):
            if entry is not None and getattr(entry, key) is not None and not _applies(key, sources[i], kinds[i]):
                out.append(_no_effect(recipe, f"data.sources.{i}.{key}", getattr(entry, key), key, [sources[i]],
                                      [kinds[i]]))
    return out


def _applies(key: str, source: SourceConfig, kind: str) -> bool:
    return kind == "hub" if key in HUB_KEYS else key in FORMAT_FIELDS[source.format]


def _no_effect(recipe, key: str, value, name: str, sources: list[SourceConfig], kinds: list[str]) -> Problem:
    if name in HUB_KEYS:
        what = ", ".join(f"{s.path} ({'built-in data' if k == 'builtin' else 'a local file'})"
                         for s, k in zip(sources, kinds))
        return Problem(recipe.where(key), f"{value!r} has no effect: it chooses among a hub dataset's "
                       f"{'configurations' if name == 'hub_config' else 'splits'}, and the data is {what}",
                       "remove it (a local file is read whole; data.eval_fraction holds rows out)")
    formats = sorted({s.format for s in sources})
    reads = "; ".join(f"{f} reads {', '.join(FORMAT_FIELDS[f])}" for f in formats)
    return Problem(recipe.where(key), f"{value!r} has no effect: no source of format "
                   f"{', '.join(f for f, keys in FORMAT_FIELDS.items() if name in keys)} reads it ({reads})",
                   "remove it, or set the format that reads it")


def source_key(recipe, index: int) -> str:
    """The recipe key of source `index`'s path: data.path for the one-source form, else data.sources.N.path."""
    return f"data.sources.{index}.path" if recipe.data.sources else "data.path"


def field_key(recipe, index: int, field: str) -> str:
    """The recipe key that sets `field` (e.g. text_field) of source `index`, as the user would change it."""
    if recipe.data.sources:
        entry = recipe.data.sources[index]
        if getattr(entry, field) is not None:
            return f"data.sources.{index}.{field}"
    return f"data.{field}"


class SourceReader:
    """The rows of one source, streamed in batches and checked for its format."""

    def __init__(self, recipe, source: SourceConfig, index: int):
        self.recipe, self.source, self.index = recipe, source, index
        self.where = recipe.where(source_key(recipe, index))
        self.file = locate(recipe, source, source_key(recipe, index))
        if self.file.kind == "builtin":
            self.file = SourceFile("builtin", str(write_builtin(source.path.split(":", 1)[1])), source.path)
        self._dataset = None
        self.problems: list[Problem] = []
        self._kinds: set[str] = set()

    # ------------------------------------------------------------------------------------------ opening

    def open(self) -> SourceReader:
        """Check that the source can be read (exists, not empty, UTF-8); hub and datasets-read files are loaded."""
        f = self.file
        if f.kind == "hub":
            self._dataset = self._load_hub()
            return self
        p = Path(f.path)
        if not p.exists():
            raise UserError(Problem(self.where, f"data file {f.name!r} not found",
                                    "check the path (relative paths start at the working directory or the recipe's "
                                    "folder), or use builtin:quickstart"))
        if p.is_dir():
            raise UserError(Problem(self.where, f"{f.name!r} is a folder{_data_files_in(p)}",
                                    "point the path at one file; files of one corpus are sources of a mixture: one "
                                    "entry of data.sources each (or join them: cat *.jsonl > all.jsonl)"))
        kind = f.type
        builder = FILE_TYPES.get(kind)
        if builder is None or (f.compressed and builder == "parquet"):
            shown = kind + COMPRESSED if f.compressed else kind
            raise UserError(Problem(f"{self.where} ({f.path})", f"unsupported file type {shown!r}",
                                    f"use one of {', '.join(FILE_TYPES)} (each but .parquet may end in "
                                    f"{COMPRESSED}: gzip-compressed)"))
        if f.compressed:
            check_gzip(p, self.where)
        if p.stat().st_size == 0 or (builder != "parquet" and not has_text(p)):
            raise UserError(Problem(self.where, f"data file {f.name!r} is empty", "put training rows in it"))
        if builder != "parquet" and (problem := not_text(f.path, kind)):
            raise UserError(Problem(f"{self.where} ({f.path})", *problem))
        if kind == ".jsonl":
            problem = utf16(p)  # the rest of a JSON Lines file is checked line by line as it streams
        else:
            problem = not_utf8(p) if builder != "parquet" else None
        if problem:
            raise UserError(Problem(f"{self.where} ({f.path})", *problem))
        if kind == ".json" and surrogate_escapes(f.path):
            detail, fix = find_bad_json_line(f.path)
            if detail:
                raise UserError(Problem(f"{self.where} ({f.path})", detail, fix or JSON_FIX))
        if kind not in (".jsonl", ".parquet"):
            self._dataset = self._load_file(builder)
        elif kind == ".parquet":
            try:
                import pyarrow.parquet as pq

                pq.ParquetFile(p)
            except Exception as e:  # pyarrow raises several types for a file that is not Parquet
                raise UserError(Problem(f"{self.where} ({f.path})", f"cannot read it as parquet: {_root_cause(e)}",
                                        "write the file again (it is not a readable Parquet file)")) from None
        return self

    def _load_hub(self):
        import datasets

        datasets.disable_progress_bars()
        s = self.source
        try:
            return datasets.load_dataset(self.file.name, s.hub_config, split=s.split)
        except Exception as e:  # the hub raises many types; all mean "could not get it"
            raise UserError(Problem(self.where, f"cannot load hub dataset {self.file.name!r} (config "
                                    f"{s.hub_config!r}, split {s.split!r}): {str(e).splitlines()[0][:200]}",
                                    "check the name, hub_config and split, and your network")) from None

    def _load_file(self, builder: str):
        import datasets

        datasets.disable_progress_bars()
        # utf-8-sig: a byte-order mark is not text (datasets' text builder opens the file with its config's
        # encoding, plain utf-8 by default, and the mark became the first example's first character: checked with
        # datasets 5.2.0, packaged_modules/text/text.py); JSON and CSV readers drop it themselves.
        kwargs: dict[str, Any] = {"sample_by": "paragraph", "encoding": "utf-8-sig"} if builder == "text" else {}
        if builder == "csv":
            kwargs = csv_as_text(self.file.path)
        try:
            with _library_logs_silenced():  # datasets logs its own error line before raising: one message per mistake
                return datasets.load_dataset(builder, data_files=self.file.path, split="train", **kwargs)
        except Exception as e:
            detail, fix = find_bad_json_line(self.file.path) if builder == "json" else (None, None)
            if builder == "csv" and detail is None and csv_without_rows(self.file.path):
                detail = "has a header line and no rows"
            elif detail is None and "corresponds to no data" in _root_cause(e):  # [] or {}: datasets' words for it
                detail, fix = "holds no rows", "put training rows in it"
            msg = detail or f"cannot read it as {builder}: {_root_cause(e)}"
            fix = fix or {"json": JSON_FIX,
                          "csv": "fix the file: a header line, then the same number of comma-separated fields on "
                                 "every line (quote fields that contain commas)"}.get(builder, "fix the file")
            if detail == "has a header line and no rows":
                fix = "add rows below the header, or point the path at the file that has them"
            raise UserError(Problem(f"{self.where} ({self.file.path})", msg, fix)) from None

    # ------------------------------------------------------------------------------------------ reading

    def count(self) -> int:
        """Rows this source yields (max_rows applied), without reading them all into memory."""
        if self._dataset is not None:
            n = len(self._dataset)
        elif self.file.type == ".parquet":
            import pyarrow.parquet as pq

            n = pq.ParquetFile(self.file.path).metadata.num_rows
        else:
            n = count_lines(self.file.path)
        if n == 0:
            raise UserError(Problem(self.where, f"data file {self.file.name!r} has no rows", "put training rows in it"))
        return min(n, self.source.max_rows) if self.source.max_rows else n

    def batches(self, size: int, max_bytes: int = 1 << 62) -> Iterator[tuple[list[int], list[dict]]]:
        """(row numbers, rows) in order, at most `size` rows (and, from a JSON Lines file, `max_bytes` of them) at a
        time; max_rows applied."""
        limit = self.source.max_rows or None
        seen = 0
        for numbers, rows in self._raw_batches(size, max_bytes):
            if limit is not None and seen + len(rows) > limit:
                numbers, rows = numbers[:limit - seen], rows[:limit - seen]
            seen += len(rows)
            if rows:
                yield numbers, rows
            if limit is not None and seen >= limit:
                return

    def _raw_batches(self, size: int, max_bytes: int):
        if self._dataset is not None:
            ds, n = self._dataset, len(self._dataset)
            for start in range(0, n, size):
                chunk = ds[start:min(n, start + size)]
                keys = list(chunk)
                count = len(chunk[keys[0]]) if keys else 0
                yield from self._bounded(list(range(start + 1, start + count + 1)),
                                         [{k: chunk[k][i] for k in keys} for i in range(count)], max_bytes)
        elif self.file.type == ".parquet":
            import pyarrow.parquet as pq

            start = 0
            for batch in pq.ParquetFile(self.file.path).iter_batches(batch_size=size):
                rows = batch.to_pylist()
                yield from self._bounded(list(range(start + 1, start + len(rows) + 1)), rows, max_bytes)
                start += len(rows)
        else:
            yield from self._jsonl_batches(size, max_bytes)

    def _bounded(self, numbers: list[int], rows: list[dict], max_bytes: int):
        """Rows read by datasets or pyarrow (already in memory-mapped Arrow), in batches of at most `max_bytes` of
        text; a row over MAX_ROW_BYTES refused before it reaches the encoder."""
        start, used = 0, 0
        for k, row in enumerate(rows):
            size = _text_bytes(row)
            if size > MAX_ROW_BYTES:
                raise self._too_long(numbers[k], f"holds {size / 2**20:,.0f} MiB of text")
            if used and used + size > max_bytes:
                yield numbers[start:k], rows[start:k]
                start, used = k, 0
            used += size
        if start < len(rows):
            yield numbers[start:], rows[start:]

    def _too_long(self, number: int, what: str) -> UserError:
        row = self.file.row_word
        return UserError(Problem(f"{self.where} ({self.file.path or self.file.name})",
                                 f"{row} {number} {what}, more than the {MAX_ROW_BYTES >> 20} MiB a row may hold "
                                 "(tokenizing it would take about 40 times that in memory)",
                                 "split it into several rows (each a document of its own), or remove it"))

    def _jsonl_batches(self, size: int, max_bytes: int):
        numbers, rows, used = [], [], 0
        with open_bytes(self.file.path) as f:
            for number, line in self._lines(f):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except UnicodeDecodeError as e:
                    problem = nul_line(number, line) if b"\0" in line else not_utf8_line(number, line, e)
                    raise UserError(Problem(f"{self.where} ({self.file.path})", *problem)) from None
                except ValueError as e:
                    if b"\0" in line:
                        raise UserError(Problem(f"{self.where} ({self.file.path})", *nul_line(number, line))) from None
                    raise UserError(Problem(f"{self.where} ({self.file.path})",
                                            f"line {number}: invalid JSON ({json_error(e)})",
                                            _jsonl_fix(number, line))) from None
                if not isinstance(row, dict):
                    raise UserError(Problem(f"{self.where} ({self.file.path})", f"line {number}: expected a JSON "
                                            f"object per line, found {json_type(row)}",
                                            _jsonl_fix(number, line)))
                if (b"\\ud" in line or b"\\uD" in line) and (half := lone_surrogate(row)):
                    raise UserError(Problem(f"{self.where} ({self.file.path})", f"line {number}: {half}",
                                            SURROGATE_FIX))
                numbers.append(number)
                rows.append(row)
                used += len(line)
                if len(rows) == size or used >= max_bytes:
                    yield numbers, rows
                    numbers, rows, used = [], [], 0
        if rows:
            yield numbers, rows

    def _lines(self, f):
        """(number, line) of a file read line by line, never more than MAX_ROW_BYTES of a line at once: a longer line
        is refused with its number when its first MAX_ROW_BYTES have been read."""
        number = 0
        while line := f.readline(MAX_ROW_BYTES + 2):
            number += 1
            if len(line.rstrip(b"\r\n")) > MAX_ROW_BYTES:
                raise self._too_long(number, "is longer than that")
            yield number, line

    # ----------------------------------------------------------------------------------------- checking

    def bad(self, kind: str, number: int, message: str, fix: str, key: str | None = None) -> None:
        """Record a bad row: the first of each kind, up to MAX_PROBLEMS. `key`: the recipe key to change."""
        if kind in self._kinds or len(self.problems) >= MAX_PROBLEMS:
            return
        self._kinds.add(kind)
        row = self.file.row_word
        where = self.recipe.where(key) if key else self.where
        self.problems.append(Problem(where, f"{self.file.name} {row} {number}: {message}", fix))

    def missing_field(self, number: int, row: dict, field: str) -> None:
        key = field_key(self.recipe, self.index, FIELD_KEYS.get(field, field))
        name = getattr(self.source, FIELD_KEYS.get(field, field))
        fix = f"set {key} to one of them"
        holder = next((k for k, v in row.items() if isinstance(v, list) and v and isinstance(v[0], dict)
                       and name in v[0]), None)
        if holder is not None and len(row) == 1:  # {"data": [rows]}: the rows are one level down
            fix = (f"its field {holder!r} holds the rows: write them one per line (.jsonl), or as the file's JSON "
                   "list (.json)")
        elif "." in name and isinstance(row.get(name.split(".")[0]), dict):
            fix = (f"a field name is a key of the row, not a path into {name.split('.')[0]!r}: write the rows with the "
                   f"text at the top (e.g. jq -c '{{{name.rsplit('.', 1)[-1]}: .{name}}}' FILE), or set {key} to a key")
        elif (other := _format_of(row)) not in (None, self.source.format):
            format_key = f"data.sources.{self.index}.format" if self.recipe.data.sources else "data.format"
            fix = f"the rows look like {other} data: set {format_key}: {other} (or {key} to the field that holds it)"
        elif len(row) == 1 and any(sep in str(k) for k in row for sep in ";\t|"):
            fix = ("its first line looks separated by ';', a tab or '|', and a .csv file is read with commas: save it "
                   "with commas")
        self.bad(f"missing {field}", number, f"has no field {name!r} (its fields: {', '.join(sorted(map(str, row)))})",
                 fix, key)

    def raise_problems(self) -> None:
        if self.problems:
            raise UserError(self.problems, title=f"data {self.file.name} has {len(self.problems)} problems")


def _format_of(row: dict) -> str | None:
    """The format whose default fields a row holds all of (chosen and rejected: preference; ShareGPT's conversations:
    chat), or None."""
    defaults = DataConfig()
    for fmt, fields in (("preference", ("chosen_field", "rejected_field")), ("chat", ("messages_field",)),
                        ("instruction", ("instruction_field", "output_field")), ("text", ("text_field",))):
        if all(getattr(defaults, f) in row for f in fields):
            return fmt
    return "chat" if SHAREGPT_FIELD in row else None  # ShareGPT's conversations (data/shapes.py)


def _data_files_in(folder: Path) -> str:
    """", holding 12 data files (train-00000.jsonl, ...)" for a folder of shards, else ""."""
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and file_type(p.name)[0] in FILE_TYPES)
    if not files:
        return ""
    more = len(files) > 1
    return f", holding {len(files)} data file{'s' if more else ''} ({files[0]}{', ...' if more else ''})"


def _jsonl_fix(number: int, line: bytes) -> str:
    """The fix for a line of a .jsonl file that is not an object: a whole JSON document over several lines (a list,
    objects written with an indent) is a .json file's shape."""
    head = line.strip().lstrip(b"\xef\xbb\xbf")
    if b"}\r{" in head.replace(b" ", b""):
        return ("its lines end in a carriage return alone (\\r, the old Mac OS line end), so it reads as one line: "
                "convert them, e.g. tr '\\r' '\\n' < FILE > FILE.jsonl")
    if head in (b"[", b"{") or (number == 1 and head.startswith(b"[")):
        return ("the file looks like one JSON document over several lines (a list, or objects written with an "
                "indent): name it .json, or write one object per line")
    return "fix the file: one JSON object per line (.jsonl)"


FIELD_KEYS = {"text": "text_field", "instruction": "instruction_field", "input": "input_field",
              "output": "output_field", "messages": "messages_field", "prompt": "prompt_field",
              "chosen": "chosen_field", "rejected": "rejected_field"}
"""A row field's role -> the source key that names its column."""


def check_messages(messages) -> str | None:
    """What is wrong with a chat row's message list, or None."""
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list"
    has_assistant = False
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            what = f"its keys: {', '.join(map(str, m))}" if isinstance(m, dict) else json_type(m)
            if isinstance(m, dict) and "from" in m:
                what += "; ShareGPT's form: role is from (user for human, assistant for gpt), content is value"
            return f"message {j + 1} is not a {{role, content}} object ({what})"
        if m["role"] not in CHAT_ROLES:
            hint = ("; a tool's call and its result are not trained here: leave those turns out, or write the result "
                    "into a user turn" if m["role"] in TOOL_ROLES else "")
            return f"message {j + 1} has unknown role {m['role']!r}{hint}"
        if not isinstance(m["content"], str):
            hint = ""
            if isinstance(m["content"], list) and all(isinstance(p, dict) and "type" in p for p in m["content"]):
                hint = ("; a list of content parts (OpenAI's form): write the text of its parts as one string, "
                        '{"role": ..., "content": "..."} (parts that are not text cannot be trained here)')
            return f"message {j + 1} content is not text ({json_type(m['content'])}){hint}"
        has_assistant |= m["role"] == "assistant"
    if not has_assistant:
        return "no assistant message, so nothing to learn"
    return None


def _text_bytes(value) -> int:
    """The size of a row's text: its strings, those inside lists and mappings (a chat's messages) included."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_bytes(v) for v in value)
    return 0


class _library_logs_silenced:
    """datasets logs an ERROR line of its own before it raises; ours says the same thing with the fix."""

    def __enter__(self):
        import logging

        self.logger = logging.getLogger("datasets")
        self.level = self.logger.level
        self.logger.setLevel(logging.CRITICAL)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
