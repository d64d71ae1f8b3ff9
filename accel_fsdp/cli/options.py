"""What several commands share: the help of their common options, loading a recipe by name or path, and the
argv of a command run again in a child process."""

from __future__ import annotations

import click

from accel_fsdp.config.recipe import load_recipe as read_recipe
from accel_fsdp.config.shipped import display, resolve_recipe
from accel_fsdp.launch.launcher import inside_launch

SET_HELP = "Override a recipe key, typed as YAML: --set training.lr=3e-4 --set model.lora.enabled=true (repeatable)."
CPU_HELP = ("Run a GPU accelerate config on CPU ranks (gloo), on purpose: to try its sharding, wrapping and "
            "checkpoints on a machine without a GPU. Without it, a GPU config on a machine that cannot run CUDA is "
            "refused.")
CONFIG_HELP = ("Accelerate config: a shipped name (fsdp_2gpu) or a path. Default: fsdp_cpu (2 CPU ranks) without a "
               "GPU, else fsdp_1gpu with one process per local GPU.")


def _note_keys_given_twice(ctx, param, overrides: tuple[str, ...]) -> tuple[str, ...]:
    """The user's --set items, applied in order, so a key given twice takes its later value, as argparse and
    OmegaConf overrides do (a script's base flags followed by one run's change), and said in one note when the two
    values differ, never silently. (A recipe file's key given twice is refused: a file states each key once,
    config/yaml_file.py.) The note is the launching process's: the ranks parse the same command line."""
    given: dict[str, str] = {}
    changed: dict[str, list[str]] = {}
    for item in overrides:
        if "=" not in item:
            continue  # said by the recipe loader, with every other problem
        key, _, value = item.partition("=")
        key = key.strip()
        if key in given and given[key] != value:
            changed.setdefault(key, [given[key]]).append(value)
        given[key] = value
    if changed and not inside_launch():
        for key, values in changed.items():
            click.echo(f"note: --set {key} is given {len(values)} times ({', '.join(map(repr, values))}): the last, "
                       f"{values[-1]!r}, is used", err=True)
    return overrides


def set_option(command):
    """The --set option of every command that loads a recipe."""
    return click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP,
                        callback=_note_keys_given_twice)(command)


def load_recipe(name_or_path: str, overrides):
    """A shipped recipe by name, or a file, with --set applied; messages quote it as the user wrote it."""
    path = resolve_recipe(name_or_path)
    r = read_recipe(path, overrides)
    r.source = display(path)
    return r


EMPTY = "is empty (an unset shell variable?)"


def not_empty(ctx, param, value):
    """The callback of an option that names a file, a folder or a hub id as text (--accelerate-config, --base-model):
    an empty value (an unset shell variable) is refused, where the command took it as not given and used its default."""
    if isinstance(value, str) and not value.strip():
        raise click.BadParameter(f"{EMPTY}: give a value, or leave the option out for its default", ctx=ctx,
                                 param=param)
    return value


class GivenPath(click.Path):
    """A path option or argument of any command: click's Path, refusing an empty value. An empty path is pathlib's
    "." (the folder the user stands in), and it is what an unset shell variable gives (`--output-dir "$OUT"`): a run
    wrote its checkpoints there, inspect and report read it. "." typed is still the current folder."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail(f"{EMPTY}, which would mean the current folder: give the path, or . for the current folder",
                      param, ctx)
        return super().convert(value, param, ctx)


def names_a_folder(typed: str) -> bool:
    """A path typed with a trailing separator (`jobs/`) names a folder, whatever is there now: pathlib drops the
    separator (Path("jobs/") is Path("jobs")), and a command that writes a file there wrote a file named `jobs`."""
    import os

    return typed.endswith(("/", os.sep))


def finite(param, value):
    import math

    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", param=param)
    return value


def child_argv(ctx: click.Context, *, parent_only=frozenset(), given: dict | None = None) -> list[str]:
    """The argv that runs this command again in a child process, derived from the command's own parameters: its
    subcommand path, then every parameter the user gave (not a default) in declaration order, each written as click
    reads it back; `given` sets parameters the child must receive whatever the user typed (None: leave out), and
    `parent_only` names those the parent alone consumes. A new option is forwarded without being listed here."""
    from click.core import ParameterSource

    given = given or {}
    path, c = [], ctx
    while c.parent is not None:
        path.insert(0, c.info_name)
        c = c.parent
    argv = list(path)
    for param in ctx.command.params:
        name = param.name
        if name in parent_only:
            continue
        if name in given:
            value = given[name]
        elif ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT,
                                                ParameterSource.PROMPT):
            value = ctx.params.get(name)
        else:
            continue
        if value is None or (param.multiple and not value):
            continue
        if isinstance(param, click.Argument):
            argv += [str(v) for v in value] if param.nargs != 1 else [str(value)]
            continue
        opt = next((o for o in param.opts if o.startswith("--")), param.opts[0])
        if param.is_flag:  # a switch: written when on (or its --no- form when off), never with a value
            on = param.flag_value if not param.is_bool_flag or isinstance(param.flag_value, bool) else True
            if value == on:
                argv.append(opt)
            elif param.secondary_opts:
                argv.append(next((o for o in param.secondary_opts if o.startswith("--")), param.secondary_opts[0]))
            continue
        for v in (value if param.multiple else [value]):
            argv += [opt, *map(str, v)] if param.nargs != 1 else [opt, str(v)]
    return argv
