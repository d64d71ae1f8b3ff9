"""An empty path, what an unset shell variable gives (`--output-dir "$OUT"`), is refused on every command before any
work: pathlib reads "" as "." (a run wrote its checkpoints into the folder the user stood in; inspect, report and
generate read it), and an empty --accelerate-config or --base-model was taken as not given (the default config, the
adapter's own base) without a word."""

from __future__ import annotations

import click
from conftest import every_command, user_error

from accel_fsdp.cli.options import GivenPath, not_empty


def argv(path, command, empty: click.Parameter) -> list[str]:
    """The command with `empty` given as "", its other arguments and required options filled in."""
    words = list(path)
    for param in command.params:
        value = "" if param is empty else "1" if isinstance(param.type, click.types.IntParamType) else "x"
        if isinstance(param, click.Argument):
            words.append(value)
        elif param is empty or param.required:
            words += [param.opts[-1], value]
    return words


def test_every_path_and_config_option_refuses_an_empty_value():
    checked = []
    for path, command in every_command():
        for param in command.params:
            if isinstance(param.type, GivenPath) or param.callback is not_empty:
                out = user_error(*argv(path, command, param))
                name = " / ".join(param.opts) if isinstance(param, click.Option) else param.human_readable_name
                assert f"error: {name}: is empty (an unset shell variable?)" in out, (path, name, out)
                checked.append((path, name))
    named = {name for _, name in checked}
    assert {"--output-dir", "--resume-from", "--accelerate-config", "--base-model", "-o / --output", "DEST", "OUT_DIR",
            "RUN_DIR", "MODEL_DIR"} <= named, named
