"""click's own refusals name the help of the command the user typed: an option given without its value ("Option
'--gpus' requires an argument") pointed to `accel-fsdp --help`, which lists no option of any command."""

from __future__ import annotations

import re

import click
from conftest import every_command, user_error


def test_an_option_without_its_value_points_to_its_command_help_on_every_command():
    checked = 0
    for path, command in every_command():
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


def test_an_option_of_two_names_is_spelled_as_slurm_spells_it_and_named_by_both():
    from conftest import cli

    assert cli("estimate", "7B", "--gpus-per-node", "8", "--nodes", "2") == cli("estimate", "7B", "--gpus", "8",
                                                                               "--nodes", "2")
    out = user_error("estimate", "7B", "--gpus-per-node", "0")
    assert out.startswith("error: --gpus / --gpus-per-node: 0 is not in the range 1<=x<=4096"), out
