"""The `accel-fsdp` command line. Thin: each command parses, loads, and calls one library function.

User mistakes are `UserError`s (click exceptions with exit status 2): one message naming the file or key, the
value and the fix; never a traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import sys
import threading
from collections.abc import Iterator

import click

from accel_fsdp import __version__
from accel_fsdp.cli import checkpoint, data, plan, recipe, tools
from accel_fsdp.errors import Problem, UserError, allocation_figures, out_of_memory, path_problem, show_usage_error
from accel_fsdp.hardware import settle_thread_environment
from accel_fsdp.launch.launcher import inside_launch
from accel_fsdp.quiet import quiet_libraries
from accel_fsdp.train.lifetime import INTERRUPTED, PREEMPTED, PREEMPTION_SIGNALS

click.UsageError.show = show_usage_error  # one format for every user mistake, click's own included

# A process that imported torch spends 1.5-2.5 s at exit in the collector's passes over its modules' objects while
# the interpreter tears them down (Py_FinalizeEx runs the atexit callbacks first, then collects and clears the
# modules); every command that launched ranks or checked a model paid that after its work was done. Frozen objects
# are skipped by those passes and still freed as the modules are cleared. Registered first, so it runs after every
# other exit callback. (The ranks end through os._exit: train/lifetime.py `leave`.)
atexit.register(gc.freeze)


ONE_PROCESS_MEMORY_FIX = {
    "GPU": "free the GPU (`nvidia-smi` shows who holds it), or use a GPU with more memory",
    "host": "free memory on this machine, or use a machine with more memory",
}
"""What to change when a command of one process (generate, consolidate, data prepare) runs out of memory, after the
command's own knob for it, where it has one (COMMAND_MEMORY_FIX)."""
COMMAND_MEMORY_FIX = {
    ("generate", "GPU"): "sample on the host (--device cpu)",
    ("consolidate", "host"): "write smaller shards (--max-shard-size)",
}
"""A command's own option that lowers its memory, by (command, memory): named for that command alone (generate has no
shards to make smaller)."""


class _Stopped(BaseException):
    """A preemption signal (SIGTERM, SIGUSR1) to a command, raised where the command is, as Ctrl-C's KeyboardInterrupt
    is: its writers remove what they had half-written on the way out."""


@contextlib.contextmanager
def _preemption_unwinds() -> Iterator[None]:
    """SIGTERM and SIGUSR1 raise _Stopped in the command, instead of their default action (the process ends where it
    is: a temporary left for the next writer to sweep, no word, status 143 or 138). Not in a rank (train/lifetime.py
    answers there, from its process group on: before it, a Python handler could not run while the rendezvous blocks),
    and not in a thread of a program that called the CLI (only the main thread may install handlers)."""
    if inside_launch() or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame) -> None:
        raise _Stopped(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in PREEMPTION_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is stop:  # else the launch's handlers (torchrun's) took over: theirs stay
                signal.signal(sig, handler)


def reexec_in_utf8_mode() -> None:
    """Start this program again in Python's UTF-8 mode where the locale's encoding is not UTF-8 (LANG=C with
    PYTHONUTF8=0, a Latin-1 locale): every file we read or write (recipes, configs, data, records), every path and
    every line printed is UTF-8 text, and Python would otherwise read and write them all in the locale's encoding (a
    recipe with a unicode path was "cannot read the recipe file (UnicodeDecodeError)"). Python turns the mode on
    itself under the C and POSIX locales unless told not to (PEP 540). The variable also reaches the ranks and every
    command this one starts. Before any import of weight: a start of Python is what it costs, where it happens."""
    import locale

    if sys.flags.utf8_mode or locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
        return
    if os.environ.get("PYTHONUTF8") == "1":  # started again already, and `-X utf8=0` wins over the variable: no loop
        return
    os.environ["PYTHONUTF8"] = "1"
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


class Commands(click.Group):
    """The command group; a path the user chose that cannot be read or written (a folder without permission, a
    read-only or full disk, a file where a folder must be) is one message naming the path, exit status 2, whichever
    command met it: checked by each command where it can be before any work, and here for what only the attempt
    finds. Ctrl-C in any command is one line and INTERRUPTED (click's own answer is "Aborted!" and status 1), a
    preemption signal one line and PREEMPTED (a run's own answers are train/lifetime.py's and the launcher's): every
    writer removes what it had half-written on the way out (files.py: write_with, atomic_folder), so the same
    command can simply run again."""

    def main(self, args=None, *rest, **kwargs):
        """As the program (`accel-fsdp`, `python -m accel_fsdp`: no `args` given), in Python's UTF-8 mode."""
        if args is None:
            reexec_in_utf8_mode()
        return super().main(args, *rest, **kwargs)

    def invoke(self, ctx):
        words = [*getattr(ctx, "_protected_args", ()), *ctx.args]  # click empties both as it goes down

        def named() -> click.Context:
            """The context of the command as the user named it, down to the last group's command (`accel-fsdp
            tokenizer train`)."""
            named, group = ctx, self
            for word in words:
                group = group.commands.get(word) if isinstance(group, click.Group) else None
                if group is None:
                    break
                named = click.Context(group, info_name=word, parent=named)
            return named

        def command() -> str:
            return named().command_path

        try:
            with _preemption_unwinds():
                return super().invoke(ctx)
        except click.UsageError as e:
            if e.ctx is None:  # click's parser says "Option '--x' requires an argument" with no command: the fix line
                e.ctx = named()  # points to the help of the command the option belongs to, not to the program's
            raise
        except KeyboardInterrupt:
            if not inside_launch():  # in a rank still starting: the launcher says it, once for all of them
                click.echo(f"{command()}: interrupted (Ctrl-C); nothing half-written was left: run the same command "
                           "again", err=True)
            sys.exit(INTERRUPTED)
        except _Stopped as stopped:
            click.echo(f"{command()}: preempted ({stopped.args[0]}); nothing half-written was left: run the same "
                       "command again", err=True)
            sys.exit(PREEMPTED)
        except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
            kind = out_of_memory(e)
            if kind is None or inside_launch():  # a rank says its own (train/lifetime.py run_rank)
                raise
            own = COMMAND_MEMORY_FIX.get((command().rsplit(" ", 1)[-1], kind))
            raise UserError(Problem(command(), f"out of {kind} memory ({allocation_figures(e)})",
                                    f"{own + ', ' if own else ''}{ONE_PROCESS_MEMORY_FIX[kind]}")) from None
        except OSError as e:
            problem = path_problem(e) if e.filename else None
            if problem is None:
                raise
            raise UserError(problem) from None


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="accel-fsdp")
def main() -> None:
    """Fine-tune GPT-2 and Llama models with PyTorch FSDP through Hugging Face Accelerate.

    \b
    accel-fsdp recipe list                      what can be trained
    accel-fsdp recipe run quickstart            a tiny model, anywhere, in about a minute
    accel-fsdp recipe run gpt2-xl --accelerate-config fsdp_2gpu
    accel-fsdp data prepare quickstart-mix      tokenize ahead of a run; `data show` to look inside
    accel-fsdp checkpoint consolidate runs/gpt2-xl out/gpt2-xl
    """
    # Every command: library warnings about their own internals, and their loggers and progress bars (transformers'
    # "Loading weights" bar on a consolidate --merge was a line of carriage returns in a log).
    quiet_libraries()
    settle_thread_environment(os.environ)  # before any command imports torch (libgomp reads it then)


# The commands, each in the module of its kind.
main.add_command(recipe.recipe)
main.add_command(checkpoint.checkpoint)
main.add_command(data.data)
main.add_command(tools.tokenizer)
main.add_command(plan.estimate_command)
main.add_command(tools.bench_command)
main.add_command(tools.verify_command)
main.add_command(plan.slurm_command)
main.add_command(tools.report_command)
main.add_command(tools.generate_command)
