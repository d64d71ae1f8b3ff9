"""The hub's CLI commands that our fixes name are commands of the installed huggingface_hub: `hf cache delete` (there
is `hf cache rm`), `huggingface-cli download` and `huggingface-cli login` (gone since huggingface_hub 1.0) were fixes
that a user could not run. Parsed in this process by the hub's own click app, never run."""

from __future__ import annotations

import shlex

import pytest

from accel_fsdp.model.checks import HUB_LOGIN, hub_cache_remove, hub_download


@pytest.mark.parametrize("command", [hub_cache_remove("org/tiny"), hub_cache_remove("org/data", "dataset"),
                                     hub_download("org/tiny"), hub_download("org/data", "dataset"), HUB_LOGIN])
def test_every_hub_command_a_fix_names_parses_with_the_installed_hub_cli(command):
    from click.testing import CliRunner
    from huggingface_hub.cli.hf import app

    program, *words = shlex.split(command)
    assert program == "hf"
    # --help after the words: click parses the command path and the options before it, and runs nothing
    result = CliRunner().invoke(app, [*words, "--help"])
    assert result.exit_code == 0, result.output
    path = " ".join(words[:next(i for i, w in enumerate([*words, "-"]) if w.startswith("-") or "/" in w)])
    assert result.output.startswith(f"Usage: root {path} "), result.output  # that command's help, not its group's
