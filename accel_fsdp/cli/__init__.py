"""The `accel-fsdp` command line: click commands that parse, load and call one function each."""

from accel_fsdp.cli.commands import main

__all__ = ["main"]
