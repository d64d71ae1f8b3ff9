"""`accel-fsdp data`: prepare a recipe's data ahead of a run, and look inside it."""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path

import click

from accel_fsdp.cli.options import GivenPath, load_recipe, set_option
from accel_fsdp.data.build import INTERRUPTED
from accel_fsdp.quiet import colour_allowed
from accel_fsdp.tools import data as data_tools


@click.group("data")
def data() -> None:
    """Tokenize a recipe's data ahead of a run (on a CPU machine, before the GPU job), and look inside it."""


@data.command("prepare")
@click.argument("name_or_path")
@set_option
def prepare_command(name_or_path, overrides) -> None:
    """Build the tokenized data a run of the recipe would build, in the same cache, so the run starts without
    tokenizing. Prints each source: rows, train and held-out examples, sequences, tokens and those with a loss,
    truncation, packing efficiency, bytes on disk per token. Sources already prepared are not read again; a cache
    on a filesystem shared by several machines is built once (the others wait for it).

    \b
    accel-fsdp data prepare quickstart-mix
    accel-fsdp data prepare my.yaml --set data.seq_len=2048
    ACCEL_FSDP_CACHE=/shared/cache accel-fsdp data prepare my.yaml   # then the GPU job, with the same cache
    """
    r = load_recipe(name_or_path, overrides)
    with interruptible("data prepare"):
        data = data_tools.prepare(r)
    click.echo(f"prepared: {r.source}: {len(data.sources)} source(s)")
    click.echo(data_tools.prepare_report(r, data))


@data.command("show")
@click.argument("name_or_path")
@click.option("--sequences", default=3, show_default=True, type=click.IntRange(1, 10_000),
              help="Training sequences to decode, in the order a run reads them.")
@click.option("--plot", type=GivenPath(path_type=Path), help="Draw each source's histogram of example lengths into "
              "this PNG (needs matplotlib).")
@click.option("--color/--no-color", default=None, help="Mark loss-carrying tokens in green (default: on a terminal, "
              "unless NO_COLOR is set), "
              "else between \u00ab and \u00bb.")
@set_option
def show_command(name_or_path, sequences, plot, color, overrides) -> None:
    """Decode the first training sequences of a recipe as a run reads them (prepared first, if need be): the source
    each comes from, the tokens that carry a loss marked, \u2016 where a document starts.

    \b
    accel-fsdp data show quickstart-mix --sequences 4
    accel-fsdp data show my.yaml --plot lengths.png
    """
    r = load_recipe(name_or_path, overrides)
    use_color = colour_allowed(sys.stdout) if color is None else color
    with interruptible("data show"):
        text = data_tools.show(r, sequences=sequences, color=use_color, plot=plot)
    click.echo(text)


@contextlib.contextmanager
def interruptible(command: str):
    """Ctrl-C: one line and exit status 130 (128 + SIGINT, as a shell reports it), not a traceback; the cache keeps
    no half-written entry (data/prepare.py builds under a temporary name and removes it on the way out). The handler
    also sets data/build.py's INTERRUPTED, so a KeyboardInterrupt that Python dropped (raised inside a `__del__`)
    still stops the build at its next batch, and the command still ends with 130."""

    def on_ctrl_c(signum, frame):
        INTERRUPTED.set()
        raise KeyboardInterrupt

    INTERRUPTED.clear()
    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield
        if INTERRUPTED.is_set():  # dropped where it landed, after the last batch: the entry is whole, the command ends
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        click.echo(f"{command}: interrupted (Ctrl-C); the cache holds no half-written data", err=True)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGINT, previous)
        INTERRUPTED.clear()
