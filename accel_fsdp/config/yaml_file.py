"""Reading the user's YAML files (recipes, accelerate configs) strictly: a syntax error names its line, and a key
given twice is an error naming both lines (PyYAML keeps the later value silently, which would change what is
trained without a word). Returns the data and the line of every dotted key, for messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from accel_fsdp.errors import Problem, UserError, encoding_guess, first_line, iconv_fix


def read_text(path: Path, source: str, what: str) -> str:
    """The text of a YAML file the user gave (`what`: "the recipe file"); a file that cannot be read, or is not UTF-8
    (a recipe saved as Latin-1 or UTF-16 by an editor, a binary file under a .yaml name), is one message naming the line
    and byte. FileNotFoundError is left to the caller, whose fix depends on what a name may also be."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise UserError(Problem(source, f"is a folder, not {what}", "give the path of a .yaml file")) from None
    except PermissionError:
        raise UserError(Problem(source, f"cannot read {what}: permission denied",
                                "make it readable (chmod u+r), or copy it where you can read it")) from None
    except OSError as e:
        raise UserError(Problem(source, f"cannot read {what}: {first_line(e)}", "give a readable .yaml file")) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = e.start
    else:
        at = len(data)
    # No text holds a NUL byte; ASCII text saved as UTF-16 without its byte-order mark is valid UTF-8 with them.
    nul = data.find(b"\x00", 0, at)
    at = nul if nul >= 0 else at
    if at == len(data):
        return text
    start, end = data.rfind(b"\n", 0, at) + 1, data.find(b"\n", at)
    guess, encoding = encoding_guess(data[start:end if end >= 0 else len(data)])
    line = data.count(b"\n", 0, at) + 1
    raise UserError(Problem(f"{source}:{line}", f"{what} is not UTF-8 (byte "
                            f"0x{data[at]:02x} at column {at - start + 1}); it is probably {guess}",
                            iconv_fix(encoding)))


def load_yaml(text: str, source: str) -> tuple[Any, dict[str, int], list[Problem]]:
    """(data, {dotted key: 1-based line}, problems with duplicate keys). Raises UserError on a syntax error."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(e, "problem", None) or first_line(e)
        context = getattr(e, "context", None)
        msg = f"YAML syntax error: {problem}" + (f" ({context})" if context else "")
        fix = "fix the YAML at that line (indentation, a missing ':' or quote)"
        raise UserError(Problem(where, msg, fix)) from None
    except RecursionError:  # an alias that contains itself (&a [*a]): PyYAML recurses forever
        raise UserError(Problem(source, "YAML anchors refer to themselves (an alias inside its own anchor)",
                                "remove the recursive &anchor / *alias")) from None
    if _cyclic(data):  # PyYAML builds &a [*a] as a list containing itself; anything walking it would recurse forever
        raise UserError(Problem(source, "YAML anchors refer to themselves (an alias inside its own anchor)",
                                "remove the recursive &anchor / *alias"))
    lines: dict[str, int] = {}
    problems: list[Problem] = []

    walked: set[int] = set()

    def walk(n, prefix: str) -> None:
        # An aliased mapping is one node reached twice: walk it once, so a "billion laughs" document stays linear.
        if id(n) in walked:
            return
        if isinstance(n, yaml.SequenceNode):  # entries of a list of sections: data.sources.0.weight
            walked.add(id(n))
            for i, item in enumerate(n.value):
                if isinstance(item, yaml.MappingNode):
                    lines.setdefault(f"{prefix}{i}", item.start_mark.line + 1)
                    walk(item, f"{prefix}{i}.")
            return
        if not isinstance(n, yaml.MappingNode):
            return
        walked.add(id(n))
        seen: dict[str, int] = {}
        for k, v in n.value:
            key = f"{prefix}{k.value}"
            line = k.start_mark.line + 1
            if key in seen:
                problems.append(Problem(f"{source}:{line}: {key}", f"is given twice (lines {seen[key]} and {line}); "
                                        "YAML would silently keep the later value",
                                        "keep one of them"))
            seen[key] = line
            lines.setdefault(key, line)
            walk(v, key + ".")

    walk(node, "")
    return data, lines, problems


def _cyclic(data: Any) -> bool:
    """Whether a loaded YAML value contains itself. Depth-first with grey/black marks, so shared aliases (a DAG, as
    in a "billion laughs" document) are walked once each and the check stays linear."""
    grey: set[int] = set()
    black: set[int] = set()
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        value, leaving = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        if leaving:
            grey.discard(id(value))
            black.add(id(value))
            continue
        if id(value) in grey:
            return True
        if id(value) in black:
            continue
        grey.add(id(value))
        stack.append((value, True))
        stack.extend((v, False) for v in (value.values() if isinstance(value, dict) else value))
    return False
