"""Reading the user's YAML files (recipes, accelerate configs) strictly: a syntax error names its line, and a key
given twice is an error naming both lines (PyYAML keeps the later value silently, which would change what is
trained without a word). Returns the data and the line of every dotted key, for messages."""

from __future__ import annotations

from typing import Any

import yaml

from accel_fsdp.errors import Problem, UserError


def load_yaml(text: str, source: str) -> tuple[Any, dict[str, int], list[Problem]]:
    """(data, {dotted key: 1-based line}, problems with duplicate keys). Raises UserError on a syntax error."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context = getattr(e, "context", None)
        msg = f"YAML syntax error: {problem}" + (f" ({context})" if context else "")
        raise UserError(Problem(where, msg, "fix the YAML at that line (indentation, a missing ':' or quote)")) \
            from None
    lines: dict[str, int] = {}
    problems: list[Problem] = []

    def walk(n, prefix: str) -> None:
        if not isinstance(n, yaml.MappingNode):
            return
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
