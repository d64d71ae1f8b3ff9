"""User-facing errors.

A mistake of the user's (a bad recipe key, a missing file, batch sizes that do not divide) must end in one
message that names the file or dotted key, the value and the fix, with exit status 2 and no traceback.
Everything in the package raises `UserError` for those; the CLI (and the training entry point inside
distributed ranks) turns it into that message. Never raise it for a bug of ours: those keep their traceback.
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass

import click


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the user's input: where it is, what it holds, and how to fix it."""

    where: str
    """File and/or dotted key, e.g. `recipes/gpt2.yaml: training.global_batch_size`."""
    message: str
    """What is wrong, quoting the value."""
    fix: str = ""
    """What to change."""

    def __str__(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.fix:
            text += f"\n    fix: {self.fix}"
        return text


class UserError(click.ClickException):
    """A problem with the user's input. Shown as one message; exit status 2."""

    exit_code = 2

    def __init__(self, problems: list[Problem] | Problem | str, *, title: str | None = None,
                 rank_local: bool = False):
        self.rank_local = rank_local
        """Found by this rank alone (rank 0 may not know it), so this rank shows it. Errors every rank finds
        alike are shown by rank 0 only."""
        if isinstance(problems, (Problem, str)):
            problems = [problems]
        self.problems = [p if isinstance(p, Problem) else Problem("", p) for p in problems]
        if len(self.problems) == 1:
            text = str(self.problems[0])
        else:
            head = title or f"{len(self.problems)} problems"
            text = head + ":\n" + "\n".join(f"  - {p}".replace("\n", "\n  ") for p in self.problems)
        super().__init__(text)

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True, file=file)


PATH_FIXES = {
    errno.ENOSPC: "free space there, or choose a path on another filesystem",
    errno.EDQUOT: "free space within your quota there, or choose a path on another filesystem",
    errno.EROFS: "choose a path on a filesystem that can be written",
    errno.ENAMETOOLONG: "choose a shorter path",
}
"""Filesystem errors that come from the paths and disks a user chose, and what to do; with USER_PATH_ERRORS, the
errors a command or a rank reports as the user's (any other errno is a bug and keeps its traceback)."""
USER_PATH_ERRORS = {errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, *PATH_FIXES}
OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
"""A full disk or quota: a write() of an open file says so with no file name, and it is the user's all the same."""


def path_problem(error: BaseException, during: str = "") -> Problem | None:
    """A filesystem error of a path or disk the user chose as the Problem to show (the path, the system's words,
    what to do; `during`: what was being done, for a process whose work is not its command line), else None."""
    if not isinstance(error, OSError) or error.errno not in USER_PATH_ERRORS:
        return None
    if not error.filename and error.errno not in OUT_OF_SPACE:
        return None
    where = ""
    if error.filename:
        where = f"{error.filename} -> {error.filename2}" if error.filename2 else str(error.filename)
    fix = PATH_FIXES.get(error.errno, "check the path, or choose one this user can create and write (or fix its "
                                      "permissions)")
    return Problem(where, (error.strerror or type(error).__name__) + (f" ({during})" if during else ""), fix)


def show_usage_error(error: click.UsageError, file=None) -> None:
    """click's own argument errors (a value out of range, a missing or unknown option) in the one format of every
    user mistake: `error: <option>: <what>` and a fix, exit status 2 (click's default shows usage lines first)."""
    import re

    message = error.format_message().rstrip(".")
    m = re.match(r"Invalid value for ('[^']+'(?: / '[^']+')*): (.*)", message, re.S)
    if m:  # an option of several names ('--gpus' / '--gpus-per-node') is named by all of them
        message = f"{m.group(1).replace(chr(39), '')}: {m.group(2)}"
    m = re.match(r"Missing (?:option|argument) '([^']+)'", message)
    if m:
        message = f"{m.group(1)}: missing (it is required)"
    command = error.ctx.command_path if error.ctx is not None else "accel-fsdp"
    click.echo(f"error: {message}\n    fix: see `{command} --help` for the options, their values and examples",
               err=True, file=file)


def first_line(error: BaseException, limit: int = 200, *, named: bool = False) -> str:
    """What an exception says, for a message: the first line of its text that is not blank, at most `limit`
    characters; its type's name where the text is empty or blank (`str(OSError())` is '', and `splitlines()[0]` of it
    raises IndexError). `named`: "TypeName: first line" (the name alone where it says nothing)."""
    line = next((text.strip() for text in str(error).splitlines() if text.strip()), "")[:limit]
    name = type(error).__name__
    if not line:
        return name
    return f"{name}: {line}" if named else line


def out_of_memory(error: BaseException) -> str | None:
    """"GPU" or "host" when `error` is an allocation that failed, else None: torch.OutOfMemoryError (the CUDA caching
    allocator's, a RuntimeError), the CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory",
    c10/core/impl/alloc_cpu.cpp; torch 2.13.0), Python's MemoryError. Linux's overcommit usually ends a process out
    of host memory with SIGKILL instead: our launcher says that one (launch/launcher.py `killed_rank_message`).
    Read by a rank (train/lifetime.py) and by the one-process commands (cli/main.py)."""
    if isinstance(error, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(error):
        return "host"
    if type(error).__name__ == "OutOfMemoryError":
        return "GPU"
    return None


def allocation_figures(error: BaseException) -> str:
    """What an allocation that failed says of its sizes, for a message: CUDA's first sentences (what it tried to
    allocate, the capacity, what was free), not its advice on the allocator's settings."""
    detail = ""
    for sentence in " ".join(str(error).split()).split(". "):
        if detail and (len(detail) + len(sentence) > 240 or sentence.startswith(("If ", "See "))):
            break
        detail += ("" if not detail else ". ") + sentence
    return detail or type(error).__name__


def raise_if(problems: list[Problem], title: str) -> None:
    """Raise one `UserError` listing every problem gathered, or return when there are none."""
    if problems:
        raise UserError(problems, title=title if len(problems) > 1 else None)


def read_json_object(path, *, what: str, fix: str, then: str = "") -> dict:
    """The JSON object in `path`, or one UserError naming the file: "{what} ({why}){then}" and `fix`. For the files
    we wrote that a person or a disk may have damaged since (run.json, a checkpoint's config.json)."""
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = first_line(e, 120, named=True)
        raise UserError(Problem(str(path), f"{what} ({why}){then}", fix)) from None
    return data


EAST_ASIAN = "GB18030, Big5, Shift_JIS, EUC-JP or EUC-KR"
"""The legacy encodings of Chinese, Japanese and Korean text that `encoding_guess` cannot tell apart."""


def encoding_guess(sample: bytes) -> tuple[str, str]:
    """(what text that is not UTF-8 probably is, iconv's name for it), from a sample of it (a line). NUL bytes mean
    UTF-16 or no text; a European legacy encoding (Latin-1, Windows-1252) puts a byte over 0x7f here and there among
    ASCII letters ("café", at most two together as in "Größe"), an East Asian one (GB18030/GBK, Big5, Shift_JIS, EUC)
    writes each character as two bytes, the first over 0x7f: a word of two characters is a run of four, and a line of
    such text is mostly such bytes."""
    if sample.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16 (it starts with a UTF-16 byte-order mark)", "utf-16"
    if b"\x00" in sample:
        return "not text (it holds NUL bytes), or UTF-16 without a byte-order mark", "utf-16le"
    visible = [b for b in sample if b > 0x20]
    longest_run = max(map(len, re.findall(rb"[\x80-\xff]+", sample)), default=0)
    if longest_run >= 4 or (len(visible) >= 4 and sum(b > 0x7f for b in visible) * 2 >= len(visible)):
        return f"in an East Asian encoding ({EAST_ASIAN})", "GB18030"
    return "Latin-1 or Windows-1252", "latin1"


def iconv_fix(encoding: str, what: str = "it") -> str:
    """The fix for text that is not UTF-8 of the encoding `encoding_guess` named (`what`: the file, as the message
    calls it)."""
    other = " (or -f BIG5, SHIFT_JIS, EUC-JP, EUC-KR: the one it was written in)" if encoding == "GB18030" else ""
    return f"save {what} as UTF-8, e.g. iconv -f {encoding} -t utf-8 FILE > FILE.utf8{other}"
