"""Where shipped recipes and accelerate configs live, and how a NAME or PATH given by the user is resolved.

The YAML folders sit at the top of the repository (`recipes/`, `accelerate_configs/`) and are installed
inside the package as `accel_fsdp.recipes` / `accel_fsdp.accelerate_configs`, so an editable checkout and a
plain wheel install find them the same way. A user path always wins over a shipped name; a bare name is always
the shipped file (a `<name>.yaml` beside it in the current folder is named in a note).
"""

from __future__ import annotations

import difflib
import functools
import os
from pathlib import Path

import click

from accel_fsdp.errors import Problem, UserError


def _shipped_dir(name: str) -> Path:
    package = Path(__file__).resolve().parent.parent  # accel_fsdp/, above config/
    installed = package / name  # wheel install: accel_fsdp/recipes
    return installed if installed.is_dir() else package.parent / name  # source checkout: ./recipes


def recipes_dir() -> Path:
    return _shipped_dir("recipes")


def accelerate_configs_dir() -> Path:
    return _shipped_dir("accelerate_configs")


def shipped_recipes() -> dict[str, Path]:
    """Shipped recipe name -> file, sorted by name."""
    return {p.stem: p for p in sorted(recipes_dir().glob("*.yaml"), key=lambda p: p.stem)}


def shipped_accelerate_configs() -> dict[str, Path]:
    return {p.stem: p for p in sorted(accelerate_configs_dir().glob("*.yaml"), key=lambda p: p.stem)}


def _resolve(name_or_path: str, shipped: dict[str, Path], folder: str, what: str, list_command: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    name = path.name[: -len(".yaml")] if path.name.endswith(".yaml") else path.name
    # A shipped name, also when spelled as the repository path (`accelerate_configs/fsdp_2gpu.yaml`) from a
    # working directory that has no such folder.
    spelled_as_shipped = len(path.parts) == 1 or (len(path.parts) == 2 and path.parts[0] == folder)
    if name in shipped and spelled_as_shipped:
        if len(path.parts) == 1 and Path(f"{name}.yaml").is_file():
            _say_shadowed(name, what)
        return shipped[name]
    if path.exists():
        article = "an" if what[0] in "aeiou" else "a"
        raise UserError(Problem(str(path), f"is a {'folder' if path.is_dir() else 'special file'}, not {article} "
                                f"{what} file",
                                f"give a .yaml file or one of the names `{list_command}` prints"))
    close = difflib.get_close_matches(name, list(shipped), n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise UserError(Problem(name_or_path, f"no such {what} file, and no shipped {what} by that name",
                            f"{hint}see `{list_command}` for the shipped ones, or give the path to a .yaml file"))


@functools.cache
def _say_shadowed(name: str, what: str) -> None:
    """A bare name is the shipped file even where the current folder holds `<name>.yaml` (a copy being edited): said,
    once per process, so an edit that seems to change nothing is explained."""
    click.echo(f"note: {name} is the shipped {what}; ./{name}.yaml in this folder is not read (give ./{name}.yaml to "
               "use it)", err=True)


def resolve_recipe(name_or_path: str) -> Path:
    return _resolve(name_or_path, shipped_recipes(), "recipes", "recipe", "accel-fsdp recipe list")


def resolve_accelerate_config(name_or_path: str) -> Path:
    return _resolve(name_or_path, shipped_accelerate_configs(), "accelerate_configs", "accelerate config",
                    "ls " + str(accelerate_configs_dir()))


def display(path: str | os.PathLike) -> str:
    """A path as the user would type it: relative to the working directory when below it."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)
