"""click's own refusals name the help of the command the user typed: an option given without its value ("Option
'--gpus' requires an argument") pointed to `accel-fsdp --help`, which lists no option of any command."""

from __future__ import annotations

import re

import click
from conftest import user_error

from accel_fsdp.cli import main


def commands(group: click.Group = main, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))
        else:
            yield (*path, name), command


def test_an_option_without_its_value_points_to_its_command_help_on_every_command():
    checked = 0
    for path, command in commands():
        takes_value = [p for p in command.params if isinstance(p, click.Option) and not p.is_flag
                       and not p._flag_needs_value and not p.hidden]
        if not takes_value:
            continue
        option = takes_value[0].opts[-1]
        out = user_error(*path, option)  # the option last, its value missing
        # (in-process, the program is named `main`; installed, `accel-fsdp`)
        assert re.search(rf"requires an argument\n    fix: see `\S+ {' '.join(path)} --help`", out), (path, out)
        checked += 1
    assert checked >= 10
