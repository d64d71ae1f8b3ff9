"""A data file as bytes, before its rows are read: its type and compression (the one place a file's name is read for
them), and what its bytes must be: UTF-8 (not UTF-16, no NUL byte, no lone surrogate escaped in JSON), a gzip stream
that is whole, and where a JSON file goes wrong (datasets' own errors do not say). Each finding names the line and
comes with its fix; sources.py turns it into the user's message. This module imports no torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from accel_fsdp.errors import Problem, UserError, encoding_guess, first_line, iconv_fix

COMPRESSED = ".gz"
"""A file of those types (not .parquet, which compresses itself) may be gzip-compressed: name.jsonl.gz."""


def file_type(path: str) -> tuple[str, bool]:
    """A data file's type (its suffix, lowercased) and whether it is gzip-compressed: ('.jsonl', True) for
    data.jsonl.gz. The one place a file's name is read for its type."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes[-1:] == [COMPRESSED]:
        return (suffixes[-2] if len(suffixes) > 1 else ""), True
    return (suffixes[-1] if suffixes else ""), False


def open_bytes(path: str):
    """A data file opened for reading bytes, decompressed as it is read when its name ends in .gz."""
    if file_type(path)[1]:
        import gzip

        return gzip.open(path, "rb")
    return open(path, "rb")


def csv_without_rows(path: str) -> bool:
    """A CSV file of one line (its header) or none: datasets says only 'Instruction "train" corresponds to no data'."""
    with open_bytes(path) as f:
        return sum(1 for line in f if line.strip()) <= 1


def csv_as_text(path: str) -> dict:
    """datasets' CSV options that read every cell as the text it is: pandas would make a column of numbers numbers (an
    answer "42" refused as not text, "1.50" read as 1.5) and the words NA, N/A, null, None, NaN and an empty cell
    missing (a story "None" skipped as empty). Every column typed string (datasets passes `features` to
    pandas as dtype: packaged_modules/csv/csv.py, _generate_tables, checked with datasets 5.2.0) and pandas' own list
    of missing-value words off: an empty cell is an empty string. A header of repeated or missing names (pandas renames
    them) keeps pandas' types."""
    import csv
    import io

    with open_bytes(path) as f:
        first = f.readline(1 << 20).decode("utf-8", errors="replace").removeprefix("\ufeff")
    names = next(csv.reader(io.StringIO(first)), [])
    options: dict = {"keep_default_na": False}
    if names and all(names) and len(set(names)) == len(names):
        import datasets

        options["features"] = datasets.Features({name: datasets.Value("string") for name in names})
    return options


def json_error(e: ValueError) -> str:
    """What json found wrong, and at which column (its `msg` alone may end in "at", the position cut off)."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg.removesuffix(' at')} at column {e.colno}"
    return str(e)


MAGIC = {b"\x1f\x8b": "gzip-compressed", b"PK\x03\x04": "a zip archive (an .xlsx workbook is one)",
         b"BZh": "bzip2-compressed", b"\xfd7zXZ\x00": "xz-compressed", b"\x28\xb5\x2f\xfd": "zstd-compressed",
         b"PAR1": "a Parquet file", b"SQLite format 3\x00": "an SQLite database"}
"""The first bytes of files that are not text, and what they are."""


def not_text(path: str, kind: str) -> tuple[str, str] | None:
    """(what, fix) when a file named as text (.jsonl, .json, .csv, .txt) starts as a file of another kind does: read
    as text, its first bytes would be called "not UTF-8, probably Latin-1"."""
    with open_bytes(path) as f:
        head = f.read(16)
    for magic, what in MAGIC.items():
        if head.startswith(magic):
            fix = (f"name it with .gz at the end (name{kind}.gz: read as it is decompressed), or decompress it"
                   if what == "gzip-compressed" else
                   "name it .parquet" if what == "a Parquet file" else
                   f"export the rows as {kind} (or .parquet), or point the path at the file that holds them")
            return f"the file is {what}, not {kind} text (its first bytes: {head[:len(magic)]!r})", fix
    return None


def utf16(path: Path) -> tuple[str, str] | None:
    """(what, fix) when the file starts with a UTF-16 byte-order mark, else None."""
    with open_bytes(str(path)) as f:
        if f.read(4).startswith((b"\xff\xfe", b"\xfe\xff")):
            return ("the file is UTF-16 (it starts with a UTF-16 byte-order mark), not UTF-8",
                    iconv_fix("utf-16", "the file"))
    return None


def not_utf8(path: Path) -> tuple[str, str] | None:
    """Where a text file stops being UTF-8 ("line 3, byte 0xe9 at column 7: the file is probably Latin-1"), or None.
    A NUL byte is UTF-8, but no text holds one: a file with one is UTF-16 without its byte-order mark (every other
    byte of English text is 0), or not text at all; read as UTF-8 it would train on every character and a NUL."""
    problem = utf16(path)
    if problem:
        return problem
    with open_bytes(str(path)) as f:
        for number, line in enumerate(f, 1):
            if b"\0" in line:
                return nul_line(number, line)
            if line.isascii():
                continue
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return not_utf8_line(number, line, e)
    return None


def nul_line(number: int, line: bytes) -> tuple[str, str]:
    """(what, fix) for a line holding a NUL byte: UTF-16 when the NULs are every other byte (ASCII text in UTF-16),
    else binary data."""
    column = line.index(b"\0") + 1
    body = line.rstrip(b"\r\n")
    if body.count(b"\0") * 3 >= len(body) > 1 and (b"\0" not in body[::2] or b"\0" not in body[1::2]):
        return ((f"line {number} holds a NUL byte (0x00 at column {column}), every other byte; the file is probably "
                 "UTF-16 without a byte-order mark"),
                "save the file as UTF-8, e.g. iconv -f utf-16le -t utf-8 FILE > FILE.utf8")
    return ((f"line {number} holds a NUL byte (0x00 at column {column}); text has none, so the file is probably not "
             "text, or has binary data in it"),
            "remove the NUL bytes (e.g. tr -d '\\000' < FILE > FILE.clean), or point the path at the text file")


def not_utf8_line(number: int, line: bytes, e: UnicodeDecodeError) -> tuple[str, str]:
    """(what, fix) for line `number` of a text file, which UTF-8 cannot decode (`e`): where, and what it probably is
    (errors.py `encoding_guess`: Latin-1, or an East Asian encoding such as GBK or Big5)."""
    byte = line[e.start] if e.start < len(line) else 0
    guess, encoding = encoding_guess(line)
    return (f"line {number} is not UTF-8 (byte 0x{byte:02x} at column {e.start + 1}); the file is probably {guess}",
            iconv_fix(encoding, "the file"))


def count_lines(path: str) -> int:
    """Lines holding something other than whitespace, read in blocks (one line of any length never whole)."""
    count, text = 0, False
    with open_bytes(path) as f:
        while block := f.read(1 << 20):
            *ended, rest = block.split(b"\n")
            for part in ended:
                count += text or bool(part.strip())
                text = False
            text = text or bool(rest.strip())
    return count + text


def check_gzip(path: Path, where: str) -> None:
    """A .gz file decompressed once, whole, in blocks: one that is not gzip or was cut short is named before anything
    reads it (the readers would stop at the damage with zlib's error, half-way through a build)."""
    import zlib

    try:
        with open_bytes(str(path)) as f:
            while f.read(1 << 20):
                pass
    except (OSError, EOFError, zlib.error) as e:
        raise UserError(Problem(f"{where} ({path})", f"cannot decompress it as gzip ({first_line(e, named=True)})",
                                "compress the file again (gzip FILE), or give it uncompressed without .gz")) from None


def has_text(path: Path) -> bool:
    """Something other than whitespace in the file (read in blocks: never the whole file at once)."""
    with open_bytes(str(path)) as f:
        while block := f.read(1 << 20):
            if block.strip():
                return True
    return False


SURROGATE_FIX = ("write the character itself, or both halves of its pair (\\ud83d\\ude00 is one emoji), or remove the "
                 "escape; a program that cut a text between the two halves wrote it")


def lone_surrogate(value, field: str = "") -> str | None:
    """Where a parsed JSON row holds a lone UTF-16 surrogate (JSON's \\ud800 escape without its other half), or None.
    Such a string is no text: no encoder takes it (the Rust one raises TypeError), nor Arrow."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return (f"{'field ' + repr(field) if field else 'the row'} holds \\u{ord(value[e.start]):04x}, half of "
                    "a UTF-16 surrogate pair without its other half (no character)")
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((f"{i}", v) for i, v in enumerate(value))
    else:
        return None
    for key, item in items:
        found = lone_surrogate(item, f"{field}.{key}" if field else str(key))
        if found:
            return found
    return None


def surrogate_escapes(path: str) -> bool:
    """Whether a JSON file holds an escape of a surrogate (\\ud800 to \\udfff: half of a pair, or a whole pair),
    read line by line. datasets reads a .json file whose lone one it either refuses without a line or replaces
    silently (pandas' reader), so such a file is checked first (`find_bad_json_line`)."""
    escape = re.compile(rb"\\u[dD][89a-fA-F]")
    with open_bytes(path) as f:
        return any(escape.search(line) for line in f)


def json_type(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null"}.get(
        type(value), "a number")


def find_bad_json_line(path: str) -> tuple[str | None, str | None]:
    """The first line of a .json file that is not JSON, not an object (a list element or a line), or holds a lone
    surrogate: datasets' own error does not say where (and for a list element that is not an object, says something
    else: "'int' object is not iterable"). (what, the fix when it is not the file's shape), or (None, None)."""
    with open_bytes(path) as f:
        text = f.read().decode("utf-8", errors="replace").removeprefix("\ufeff")
    if text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return f"line {e.lineno}: invalid JSON ({json_error(e)})", None
        return _bad_list_element(text)
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            return f"line {i}: invalid JSON ({json_error(e)})", None
        if not isinstance(value, dict):
            return f"line {i}: expected a JSON object per line, found {json_type(value)}", None
        half = lone_surrogate(value)
        if half:
            return f"line {i}: {half}", SURROGATE_FIX
    return None, None


def _bad_list_element(text: str) -> tuple[str | None, str | None]:
    """The first element of a JSON list (valid JSON) that is not an object or holds a lone surrogate, by its line."""
    decoder, space = json.JSONDecoder(), re.compile(r"[\s,]*")
    at = space.match(text, text.index("[") + 1).end()
    number = 0
    while at < len(text) and text[at] != "]":
        value, end = decoder.raw_decode(text, at)
        number += 1
        line = text.count("\n", 0, at) + 1
        if not isinstance(value, dict):
            return f"line {line}: element {number} of the list is {json_type(value)}, not an object (a row)", None
        half = lone_surrogate(value)
        if half:
            return f"line {line}: {half}", SURROGATE_FIX
        at = space.match(text, end).end()
    return None, None
