"""The `accel-fsdp` command line: click commands that parse, load and call one function each.

main.py holds the group; recipe.py, checkpoint.py, plan.py and tools.py its commands; options.py what they share.
"""

from accel_fsdp.cli.main import main

__all__ = ["main"]
