"""Every example in a command's --help is a command line that parses as written (its options exist, their values are
in range) and names shipped recipes and accelerate configs where it names one (README.md's are held by test_docs.py).
Running the fast ones for real: tests/test_cli.py and the probes of each command."""

from __future__ import annotations

import re
import shlex

import click

from accel_fsdp.cli import main
from accel_fsdp.config.shipped import shipped_accelerate_configs, shipped_recipes


def commands(group: click.Group = main, path: tuple[str, ...] = ()):
    yield path, group
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))
        else:
            yield (*path, name), command


def help_examples() -> list[list[str]]:
    """The argv of each `accel-fsdp ...` line of each help text: up to its comment, which follows two spaces or more
    (`# why`, or the program's overview saying what each line does)."""
    found = []
    for _, command in commands():
        for line in (command.help or "").split("\f")[0].splitlines():
            example = re.sub(r"^(\w+=\S+\s+)+", "", line.strip())  # VAR=value accel-fsdp ...
            if example.startswith("accel-fsdp "):
                found.append(shlex.split(re.split(r"\s{2,}", example)[0].split(" | ")[0]))  # before a pipe
    return found


def leaf_context(args: list[str]) -> click.Context:
    ctx = main.make_context("accel-fsdp", list(args))
    while isinstance(ctx.command, click.Group):
        name, command, rest = ctx.command.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
        ctx = command.make_context(name, rest, parent=ctx)
    return ctx


def test_every_help_example_parses_and_names_shipped_files():
    examples = help_examples()
    assert len(examples) >= 40, len(examples)
    for words in examples:
        try:
            params = leaf_context(words[1:]).params
        except click.UsageError as e:
            raise AssertionError(f"{' '.join(words)}: {e.format_message()}") from None
        for key in ("name_or_path", "name"):
            value = params.get(key)
            if value and not value.endswith(".yaml"):
                assert value in shipped_recipes(), " ".join(words)
        config = params.get("accelerate_config")
        if config:
            assert config in shipped_accelerate_configs(), " ".join(words)
