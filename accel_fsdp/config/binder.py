"""The typed-YAML binder: raw YAML data -> keyword-only dataclasses, each value checked against its field's annotation.

Generic over the schema (recipe.py's `Recipe` is its one user): a section is a dataclass, a list of sections is
`list[SomeConfig]`, a field's YAML key is its name unless `metadata={"key": ...}` says otherwise, and a field with
`metadata={"internal": True}` is not part of the YAML. Unknown keys and values of the wrong type become `Problem`s,
all gathered, located by the caller's `where`; `--set dotted.key=value` overrides are applied to the raw data first
(`apply_override`), so they are checked exactly like the file. The attribute docstrings of the dataclasses are the
keys' documentation (`field_docs`, `schema_keys`).

This module must never touch the disk, the hub or torch: it only converts and checks values.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import json
import math
import types
import typing
from typing import Any, Literal

import yaml

from accel_fsdp.errors import Problem


def apply_override(raw: dict, item: str, problems: list[Problem], root, other_names=None) -> list[str]:
    """Set `dotted.key=value` (a YAML scalar) in the raw YAML data of the dataclass `root`; the key must name a field
    of its schema. Returns the dotted keys whose values now come from the override: the key (with everything under
    it, a list of sections included), or, for a mapping laid over a section, the keys the mapping names. Nothing,
    with the problem added, when the key names no field. `other_names`: {name other tools use: dotted key}, for the
    did-you-mean of an unknown key."""
    key, _, value_text = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if "=" not in item or not all(part.strip() for part in parts):
        what = "no '='" if "=" not in item else "no key" if not key else f"an empty part in {key!r}"
        problems.append(Problem(f"--set {item}", f"expected dotted.key=value ({what})",
                                "write the dotted key, '=' and the value, e.g. --set training.lr=3e-4"))
        return []
    # The key must name a field of the schema; the value is type-checked with everything else.
    found, cls = _field_of(root, raw, key, parts, problems, other_names)
    if not found:
        return []
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else ""
    except yaml.YAMLError as e:
        if value_text.lstrip()[:1] in ("[", "{"):  # a list or mapping cut short: never read it as a string
            entry = _section_list(cls)
            kind, example = (("list", f"[{_entry_example(entry)}, {_entry_example(entry)}]" if entry else "[a, b]")
                             if value_text.lstrip()[0] == "[" else ("mapping", "{key: value}"))
            problems.append(Problem(f"--set {key}", f"{value_text.strip()!r} is not a complete YAML {kind} "
                                    f"({getattr(e, 'problem', None) or 'YAML syntax error'})",
                                    f"close its brackets, and quote the whole argument for the shell: "
                                    f"--set '{key}={example}'"))
            return []
        value = value_text  # plain text such as a prompt with a colon: a string, as it reads
    if value is None and _is_dataclass_type(cls):  # `--set training=null` would drop the file's whole section
        problems.append(Problem(f"--set {key}", "is a section; null would drop every key the recipe sets in it",
                                f"set the keys you mean, e.g. --set {key}.KEY=VALUE (`accel-fsdp recipe keys` "
                                "lists them)"))
        return []
    node = raw
    for part in parts[:-1]:
        if isinstance(node, list):
            node = node[int(part)]
            continue
        if not isinstance(node.get(part), (dict, list)):
            node[part] = {}
        node = node[part]
    if isinstance(node, list):
        node[int(parts[-1])] = value
    elif isinstance(value, dict) and isinstance(node.get(parts[-1]), dict) and _is_dataclass_type(cls):
        replaced = _replaced_keys(node[parts[-1]], value, f"{key}.")
        node[parts[-1]] = _merged(node[parts[-1]], value)  # --set training={lr: 1e-5} sets lr, keeps the rest
        return replaced
    else:
        node[parts[-1]] = value
    return [key]


def _entry_example(cls) -> str:
    """`{path: ...}`: an entry of a list of sections, by its first required-looking key (`path` where it has one)."""
    keys = [k for k in _hints(cls) if not _is_internal(cls, k)]
    return "{" + ("path" if "path" in keys else keys[0]) + ": ...}"


def later_wins(items: list[str]) -> list[str]:
    """--set items a tool composes (the user's, then its own) with each key once, its last value kept, in the order
    the kept ones came: a command notes a key given twice with two values (cli/options.py), which is for the user's
    own mistakes, while a tool's own later value is meant to replace the user's, without a word."""
    kept, seen = [], set()
    for item in reversed(items):
        key = item.partition("=")[0].strip()
        if key not in seen or "=" not in item:
            seen.add(key)
            kept.append(item)
    return kept[::-1]


def _field_of(root, raw: dict, key: str, parts: list[str], problems: list[Problem],
              other_names=None) -> tuple[bool, Any]:
    """(True, the field's type) when the dotted `key` names a field of `root`'s schema (an entry of a list of
    sections by an index the raw data has, a key of a free-form mapping below a field); else (False, None) with the
    problem added."""
    cls: Any = root
    for i, part in enumerate(parts):
        if _section_list(cls) is not None:  # data.sources.1.weight: an entry of a list of sections, by index
            entries = _lookup(raw, parts[:i])
            count = len(entries) if isinstance(entries, list) else 0
            if not part.isdigit() or int(part) >= count:
                problems.append(Problem(f"--set {key}", f"{'.'.join(parts[:i])} has no entry {part!r} "
                                        f"({count} entr{'y' if count == 1 else 'ies'}, numbered from 0)",
                                        f"use an index below {count}, or set the whole list" if count else
                                        f"set the whole list: --set {'.'.join(parts[:i])}=[...]"))
                return False, None
            cls = _section_list(cls)
            continue
        hints = _hints(cls) if _is_dataclass_type(cls) else None
        if hints is None or part not in hints or _is_internal(cls, part):
            if cls is dict or (hints is None and _origin(cls) is dict):
                return True, dict  # free-form mapping such as model.config_overrides.n_layer
            known = [k for k in (hints or {}) if not _is_internal(cls, k)] if hints else []
            prefix = ".".join(parts[:i])
            if not known:
                problems.append(Problem(f"--set {key}", f"{prefix} is a value, not a section with keys",
                                        f"--set {prefix}=VALUE"))
                return False, None
            fix = unknown_key_fix(root, part, f"{prefix}." if prefix else "", known, other_names)
            problems.append(Problem(f"--set {key}", "unknown key", fix))
            return False, None
        cls = _strip_optional(hints[part])
    return True, cls


def _merged(base: dict, update: dict) -> dict:
    """`update` laid over `base`, mapping within mapping (a section given as a mapping changes the keys it names)."""
    out = dict(base)
    for k, v in update.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _replaced_keys(base: dict, update: dict, prefix: str) -> list[str]:
    """The dotted keys whose values `_merged(base, update)` takes from `update`."""
    out = []
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            out += _replaced_keys(base[k], v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


def _lookup(raw: Any, parts: list[str]) -> Any:
    """The value at a dotted path of the raw YAML data (list entries by index), or None."""
    node = raw
    for part in parts:
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def bind(cls, raw: Any, prefix: str, where, problems: list[Problem], *, root=None, other_names=None):
    """The dataclass `cls` from its raw YAML data: unknown keys and values of the wrong type are added to `problems`
    (located by `where(dotted_key)`) and left at their defaults. `root`: the schema `cls` is a section of (itself
    at the top); `other_names`: as for `apply_override`."""
    root = root or cls
    below = {"root": root, "other_names": other_names}
    if not isinstance(raw, dict):
        key = prefix.rstrip(".")
        listed, _, index = key.rpartition(".")
        fix = (f"write each entry of {listed} as a mapping of keys, e.g. {_entry_example(cls)} (in a file: "
               f"`- {_entry_example(cls)[1:-1]}`)" if index.isdigit() else f"write `{key}:` followed by indented keys")
        problems.append(Problem(where(key) if prefix else "recipe", f"expected a mapping of keys, found {_show(raw)}",
                                fix))
        return cls()
    hints = _hints(cls)
    known = [k for k in hints if not _is_internal(cls, k)]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            problems.append(Problem(where(dotted), "unknown key",
                                    unknown_key_fix(root, str(key), prefix, known, other_names)))
            continue
        typ = hints[key]
        if _is_dataclass_type(_strip_optional(typ)):
            kwargs[key] = bind(_strip_optional(typ), {} if value is None else value, dotted + ".", where, problems,
                               **below)
            continue
        item = _section_list(typ)
        if item is not None:
            if not isinstance(value, list):
                problems.append(Problem(where(dotted), f"expected a list of {item.__name__.removesuffix('Config')} "
                                        f"entries, found {_show(value)}",
                                        f"write `{key}:` followed by `- path: ...` entries"))
                continue
            kwargs[key] = [bind(item, entry, f"{dotted}.{i}.", where, problems, **below)
                           for i, entry in enumerate(value)]
            continue
        ok, converted, expected = _check_type(value, typ)
        if not ok:
            example = " (`{}` for none)" if expected == "a mapping" else ""
            problems.append(Problem(where(dotted), f"expected {expected}, found {_show(value)}",
                                    f"set {dotted} to {expected}{example}"))
            continue
        kwargs[key] = converted
    return _construct(cls, kwargs)


def unknown_key_fix(root, key: str, prefix: str, known: list[str], other_names=None) -> str:
    """What an unknown key `prefix + key` may have meant: a key of its section spelled alike, else a key of another
    section by that name (training.seq_len: data.seq_len), else the key another tool calls so (`other_names`:
    learning_rate is training.lr), else the section's keys."""
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f"did you mean {prefix}{close[0]}?"
    elsewhere = [k for k in _dotted_keys(root).get(key.lower(), ()) if k != f"{prefix}{key}"]
    named = (other_names or {}).get(key.lower())
    candidates = elsewhere or ([named] if named else [])
    if candidates:
        return f"did you mean {' or '.join(candidates)}?"
    return f"known keys{' in ' + prefix.rstrip('.') if prefix else ''}: {', '.join(known)}"


@functools.cache
def _dotted_keys(root) -> dict[str, tuple[str, ...]]:
    """{the last part of a key: every dotted key of the schema `root` ending in it} (lists of sections left out:
    their keys are data's too)."""
    out: dict[str, list[str]] = {}

    def walk(cls, prefix):
        for name, typ in _hints(cls).items():
            if _is_internal(cls, name) or _section_list(typ) is not None:
                continue
            if _is_dataclass_type(_strip_optional(typ)):
                walk(_strip_optional(typ), f"{prefix}{name}.")
            else:
                out.setdefault(name.lower(), []).append(f"{prefix}{name}")

    walk(root, "")
    return {k: tuple(v) for k, v in out.items()}


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a recipe dict; entries of a list of sections by index (data.sources.1.weight)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "config_overrides":
            out.update(flatten(v, key + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            out[f"{key}.count"] = len(v)
            for i, entry in enumerate(v):
                out.update(flatten(entry, f"{key}.{i}."))
        else:
            out[key] = v
    return out


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal under each field), for help texts."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(getattr(nxt, "value", None), ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def schema_keys(root) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, documentation) of every key of the dataclass `root`, in schema order."""
    out = []

    def walk(cls, prefix):
        docs = field_docs(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            if f.metadata.get("internal"):
                continue
            key = yaml_key(f)
            typ = _hints(cls)[key]
            if _is_dataclass_type(_strip_optional(typ)):
                walk(_strip_optional(typ), f"{prefix}{key}.")
            elif _section_list(typ) is not None:
                out.append((f"{prefix}{key}", "list", "[]", docs.get(f.name, "")))
                walk(_section_list(typ), f"{prefix}{key}[].")
            else:
                default = yaml.safe_dump(to_plain(getattr(defaults, f.name)), default_flow_style=True).strip()
                default = default.removesuffix("...").strip()
                out.append((f"{prefix}{key}", _type_name(typ), default, docs.get(f.name, "")))

    walk(root, "")
    return out


def _type_name(typ) -> str:
    origin = _origin(typ)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(typ))
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(typ))
    if origin is list:
        return f"list[{_type_name(typing.get_args(typ)[0])}]"
    if origin is dict:
        return "mapping"
    return "null" if typ is type(None) else getattr(typ, "__name__", str(typ))


def to_plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v):
        return {yaml_key(f): to_plain(getattr(v, f.name)) for f in dataclasses.fields(v)
                if not f.metadata.get("internal")}
    if isinstance(v, (list, tuple)):
        return [to_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: to_plain(x) for k, x in v.items()}
    return copy.deepcopy(v)


def _hints(cls) -> dict[str, Any]:
    """The type of each field of a section, by the key the YAML file uses for it."""
    types_ = typing.get_type_hints(cls)
    return {yaml_key(f): types_[f.name] for f in dataclasses.fields(cls)}


def yaml_key(f: dataclasses.Field) -> str:
    """A field's key in the YAML file: its name, unless that is a Python keyword (preference.lambda is lambda_)."""
    return f.metadata.get("key", f.name)


def _construct(cls, kwargs: dict[str, Any]):
    names = {yaml_key(f): f.name for f in dataclasses.fields(cls)}
    return cls(**{names[k]: v for k, v in kwargs.items()})


def _is_internal(cls, name: str) -> bool:
    for f in dataclasses.fields(cls):
        if yaml_key(f) == name:
            return bool(f.metadata.get("internal"))
    return False


def _is_dataclass_type(t) -> bool:
    return isinstance(t, type) and dataclasses.is_dataclass(t)


def _section_list(t):
    """The entry type of a list of sections (list[SourceConfig]), else None."""
    if _origin(t) is list:
        (item,) = typing.get_args(t)
        return item if _is_dataclass_type(item) else None
    return None


def _origin(t):
    return typing.get_origin(t)


def _strip_optional(t):
    if _origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return t


def _check_type(value: Any, typ) -> tuple[bool, Any, str]:
    """(ok, converted value, what was expected) for a YAML value against a field annotation. (Long: one branch per
    kind of annotation, read as a table.)"""
    origin = _origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return True, None, "null"
        expected = []
        for a in args:
            if a is type(None):
                continue
            ok, conv, exp = _check_type(value, a)
            if ok:
                return True, conv, exp
            expected.append(exp)
        return False, value, " or ".join(expected) + (" or null" if type(None) in args else "")
    if origin is Literal:
        choices = typing.get_args(typ)
        if isinstance(value, str):
            for c in choices:
                if value == c or value.upper() == str(c).upper():
                    return True, c, ""
        return False, value, "one of " + ", ".join(map(str, choices))
    if origin is list:
        (item,) = typing.get_args(typ)
        if isinstance(value, str) and item is str:
            value = [s.strip() for s in value.split(",") if s.strip()]
        if not isinstance(value, list):
            return False, value, f"a list of {item.__name__}"
        out = []
        for x in value:
            ok, conv, _ = _check_type(x, item)
            if not ok:
                return False, value, f"a list of {item.__name__}"
            out.append(conv)
        return True, out, ""
    if origin is dict:
        return (True, dict(value), "") if isinstance(value, dict) else (False, value, "a mapping")
    if typ is bool:
        return (True, value, "") if isinstance(value, bool) else (False, value, "true or false")
    if typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return (True, value, "") if ok else (False, value, "an integer")
    if typ is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            return True, number, ""
        return False, value, "a finite number"
    if typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return True, str(value), ""
        return False, value, "a string"
    if typ is Any:
        return True, value, ""
    raise TypeError(f"unsupported recipe field type {typ}")  # a bug in the schema, not the user's


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value)
    text = json.dumps(value, default=str) if isinstance(value, (list, dict)) else str(value)
    return text if len(text) < 60 else text[:57] + "..."
