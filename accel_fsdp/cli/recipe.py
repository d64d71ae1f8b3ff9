"""`accel-fsdp recipe ...`: list, keys, show, copy, validate, run (and launch itself into ranks)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import click

from accel_fsdp.cli.catalog import recipe_rows
from accel_fsdp.cli.options import (CONFIG_HELP, CPU_HELP, GivenPath, child_argv, load_recipe, names_a_folder,
                                   not_empty, set_option)
from accel_fsdp.config.accelerate import check_accelerate_config
from accel_fsdp.config.recipe import key_reference
from accel_fsdp.config.shipped import resolve_recipe
from accel_fsdp.errors import Problem, UserError, raise_if
from accel_fsdp.launch import launcher
from accel_fsdp.launch.launcher import MachineOptions, inside_launch
from accel_fsdp.layout import COMPILE_CACHE_ENV, RunLayout, compile_cache_dir
from accel_fsdp.planning.plan import print_plan
from accel_fsdp.preflight import load_config_or_default, preflight
from accel_fsdp.quiet import outlive_closed_output
from accel_fsdp.run.folder import file_in_the_way
from accel_fsdp.train.lifetime import DIE_WITH_PARENT_ENV, die_with_launcher, run_rank
from accel_fsdp.train.metrics import START_ENV
from accel_fsdp.train.profiling import ProfileWindow

# ---------------------------------------------------------------------------------------------- recipe


@click.group()
def recipe() -> None:
    """List, show, copy, validate and run recipes (what to train)."""


@recipe.command("list")
def recipe_list() -> None:
    """Shipped recipes: name, model, parameter count, description.

    \b
    accel-fsdp recipe list
    """
    rows = recipe_rows()
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        click.echo(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}")


@recipe.command("keys")
@click.option("--markdown", is_flag=True, help="As the table in docs/RECIPES.md.")
def recipe_keys(markdown: bool) -> None:
    """Every recipe key with its type, default and meaning.

    \b
    accel-fsdp recipe keys | grep lora
    """
    rows = key_reference()
    if markdown:
        click.echo("| key | type | default | meaning |\n|---|---|---|---|")
        for key, typ, default, doc in rows:
            click.echo(f"| `{key}` | {typ.replace(' | ', ' or ')} | `{default}` | {doc.replace('|', '/')} |")
        return
    width = max(len(r[0]) for r in rows)
    for key, typ, default, doc in rows:
        click.echo(f"{key:<{width}}  {typ} = {default}\n{'':<{width}}  {doc}")


@recipe.command("show")
@click.argument("name")
def recipe_show(name: str) -> None:
    """Print a recipe file (shipped name or path), comments included.

    \b
    accel-fsdp recipe show gpt2-xl
    """
    path = resolve_recipe(name)
    try:
        click.echo(path.read_text(), nl=False)
    except (UnicodeDecodeError, OSError) as e:
        raise UserError(Problem(str(path), f"cannot be shown ({type(e).__name__}): not a UTF-8 text file",
                                "give a .yaml recipe")) from None


@recipe.command("copy")
@click.argument("name")
@click.argument("dest", type=GivenPath())
@click.option("--force", is_flag=True, help="Replace DEST if it exists.")
def recipe_copy(name: str, dest: str, force: bool) -> None:
    """Copy a shipped recipe to DEST (a file or a folder) to edit it.

    \b
    accel-fsdp recipe copy gpt2-xl my-gpt2.yaml
    accel-fsdp recipe run my-gpt2.yaml --set data.path=mydata.jsonl
    """
    src = resolve_recipe(name)
    if names_a_folder(dest) and Path(dest).exists() and not Path(dest).is_dir():  # mkdir -p would fail on it
        raise UserError(Problem(dest, f"names a folder, and {Path(dest)} is a file", f"give a folder, or {Path(dest)} "
                                "without the trailing separator (with --force) to replace the file"))
    if names_a_folder(dest) and not Path(dest).is_dir():
        raise UserError(Problem(dest, "folder does not exist", f"create it first (mkdir -p {dest}), or give a file "
                                "name to copy to"))
    dest = Path(dest)
    target = dest / src.name if dest.is_dir() else dest
    if target.exists() and target.resolve() == src.resolve():
        raise UserError(Problem(str(target), "is the recipe being copied", "give another destination"))
    if target.exists() and not force:
        raise UserError(Problem(str(target), "already exists", "choose another name, or add --force to replace it"))
    if not target.parent.is_dir():
        raise UserError(Problem(str(target.parent), "is a file" if target.parent.exists() else
                                "folder does not exist", "give a file in an existing folder"))
    shutil.copyfile(src, target)
    click.echo(f"copied {src.name} to {target}")


@recipe.command("validate")
@click.argument("name_or_path")
@set_option
@click.option("--accelerate-config", "accelerate_config", metavar="NAME|PATH", callback=not_empty, help=CONFIG_HELP)
@click.option("--num-processes", type=click.IntRange(1, 1 << 20), help="All ranks of the job, overriding the config "
              "(what the SLURM script passes for its allocation).")
@click.option("--num-machines", type=click.IntRange(1, 4096), help="Machines of the job, overriding the config.")
@click.option("--output-dir", type=GivenPath(path_type=Path), help="Run folder, to say where its checkpoints go. "
              "Default: runs/<recipe name>.")
def recipe_validate(name_or_path: str, overrides: tuple[str, ...], accelerate_config: str | None,
                    num_processes: int | None, num_machines: int | None, output_dir: Path | None) -> None:
    """Check a recipe with an accelerate config, offline: keys, types, ranges, batch arithmetic, wrap class,
    context length, data fields. Exit status 2 with every problem listed when something is wrong.

    \b
    accel-fsdp recipe validate gpt2-xl --accelerate-config fsdp_2gpu
    accel-fsdp recipe validate my.yaml --set training.global_batch_size=64
    """
    r = load_recipe(name_or_path, overrides)
    config, n, why = load_config_or_default(accelerate_config)
    if num_machines is not None:
        config.values["num_machines"] = num_machines
    if num_processes is not None:
        config.values["num_processes"] = n = num_processes
    if num_processes is not None or num_machines is not None:  # judged again with them, as `recipe run` does
        raise_if(check_accelerate_config(config, launching=False), f"{config.label} with these options has problems")
    if output_dir is not None and file_in_the_way(output_dir):  # its permissions are the machine's it runs on
        raise UserError(Problem(str(output_dir), f"{file_in_the_way(output_dir)} is a file, not a folder",
                                "choose another --output-dir"))
    report = preflight(r, config, num_processes=n, for_target_hardware=True, check_weights=True)
    s = report.settings
    click.echo(f"ok: {r.source} with {config.label}" + ("" if why == "given" else f" ({why})"))
    if report.parameters:
        click.echo(f"  model: {report.model_class}, {report.parameters:,} parameters")
    t = r.training
    k = t.accumulation_steps(s.num_processes.value)
    click.echo(f"  batch: global {t.global_batch_size} = micro {t.micro_batch_size} x {s.num_processes.value} "
               f"processes x {k} accumulation steps")
    if report.data_stats is not None:
        for source in report.data_stats.sources:
            click.echo(f"  data: {source.name} ({source.format}): {source.summary()}")
    click.echo(f"  checkpoints: {RunLayout.of(r, output_dir).checkpoints}")
    click.echo("  FSDP settings (value, source):")
    click.echo(s.format(indent=4))
    for note in report.notes:
        click.echo(f"  note: {note}")


@recipe.command("run")
@click.argument("name_or_path")
@click.option("--accelerate-config", "accelerate_config", metavar="NAME|PATH", callback=not_empty, help=CONFIG_HELP)
@set_option
@click.option("--output-dir", type=GivenPath(path_type=Path), help="Run folder. Default: runs/<recipe name>.")
@click.option("--resume", type=click.Choice(["latest", "auto"]), is_flag=False, flag_value="latest", default=None,
              help="Continue this run from its newest intact checkpoint. --resume auto: continue if the run folder "
              "holds this run with a checkpoint, start it if it saved none; refuse a folder of another run (what "
              "requeued SLURM jobs use).")
@click.option("--resume-from", type=GivenPath(), help="Continue from this checkpoint folder.")
@click.option("--overwrite", is_flag=True, help="Replace a run already in the run folder.")
@click.option("--accept-data-change", is_flag=True, help="Resume although a data source changed since the "
              "checkpoint (rows added or edited): go on with the data as it is now, read in a new order. Without it, "
              "such a resume is refused, naming the source and what changed.")
@click.option("--dry-run", is_flag=True, help="Plan only: build the model on the meta device and print the FSDP plan "
              "(units, per-rank memory); needs no weights and no network.")
@click.option("--gpu-memory", metavar="SIZE", help="With --dry-run: memory per GPU to check the plan against (80GB).")
@click.option("--machine-rank", type=click.IntRange(0, 4095), help="Multi-machine: this machine's rank (0 on the "
              "main one). Overrides the config's machine_rank.")
@click.option("--main-process-ip", help="Multi-machine: address of machine 0. Overrides the config.")
@click.option("--main-process-port", type=click.IntRange(1, 65535), help="Multi-machine: port on machine 0.")
@click.option("--num-machines", type=click.IntRange(1, 4096), help="Multi-machine: how many. Overrides the config.")
@click.option("--num-processes", type=click.IntRange(1, 1 << 20), help="All ranks of the job on all machines. "
              "Overrides the config (the SLURM script passes its allocation's).")
@click.option("--rendezvous-timeout", default=300, show_default=True, type=click.IntRange(1, 86400),
              help="Multi-machine: seconds to wait for the main process and for all machines to join.")
@click.option("--cpu", is_flag=True, help=CPU_HELP)
@click.option("--verbose", is_flag=True, help="Also print the resolved recipe and every FSDP setting with its source "
              "(they are always saved in the run folder: recipe.yaml, fsdp_settings.json).")
@click.option("--profile", metavar="K-L", help="Profile optimizer steps K to L (or step K) with torch's profiler on "
              "every rank: the time of the forward and backward, gradient clipping and optimizer step, the costliest "
              "operators, and a trace for https://ui.perfetto.dev, in <run>/profile/.")
@click.option("--benchmark", is_flag=True, hidden=True, help="(accel-fsdp bench) No final evaluation, checkpoint or "
              "export.")
def recipe_run(name_or_path, accelerate_config, overrides, output_dir, resume, resume_from, overwrite,
               accept_data_change, dry_run,
               gpu_memory, machine_rank, main_process_ip, main_process_port, num_machines, num_processes,
               rendezvous_timeout, cpu, verbose, profile, benchmark) -> None:
    """Train a recipe on the hardware an accelerate config describes.

    Outside a distributed launch this launches itself through Accelerate's launcher (one process per rank);
    under `accelerate launch ... -m accel_fsdp recipe run ...` it trains in each rank.

    \b
    accel-fsdp recipe run quickstart
    accel-fsdp recipe run gpt2-xl --accelerate-config fsdp_2gpu --set training.max_steps=500
    accelerate launch --config_file accelerate_configs/fsdp_2gpu.yaml -m accel_fsdp recipe run gpt2-xl
    accel-fsdp recipe run quickstart --resume
    accel-fsdp recipe run llama-3.1-8b --dry-run --accelerate-config llama_fsdp_8gpu --gpu-memory 80GB
    \f
    Long because it is the one place where a start's branches meet (inside a rank, a dry run, the launch with its
    machine options and preflight); each branch calls one function.
    """
    os.environ.setdefault(START_ENV, repr(time.time()))  # the ranks measure time to first step from here
    # `recipe run ... 2>&1 | head`: the launch and the run go on with their lines into /dev/null (a BrokenPipeError
    # ended the launcher before it launched, or a rank in the middle of a step).
    outlive_closed_output()
    # Before anything in this process asks inductor for its cache folder: the first ask sets the variable to /tmp's
    # default for the rest of the process (torch/_inductor/runtime/cache_dir_utils.py, cache_dir; torch 2.13.0).
    os.environ.setdefault(COMPILE_CACHE_ENV, str(compile_cache_dir()))

    def checked():
        """The recipe and what the command line alone can have wrong. In a launched rank it runs inside `run_rank`,
        so a mistake is said once for all ranks (under stock `accelerate launch` every rank meets it first)."""
        if resume and resume_from:
            raise UserError(Problem("--resume-from", "cannot be combined with --resume", "use one of them"))
        if overwrite and (resume or resume_from):
            raise UserError(Problem("--overwrite", f"cannot be combined with "
                                    f"{'--resume' if resume else '--resume-from'}", "use one of them"))
        r = load_recipe(name_or_path, overrides)
        if gpu_memory and not dry_run:
            raise UserError(Problem("--gpu-memory", "only applies to --dry-run (the plan is checked against it)",
                                    "add --dry-run, or drop --gpu-memory"))
        window = ProfileWindow.parse(profile) if profile is not None else None
        if window and dry_run:
            raise UserError(Problem("--profile", "a dry run trains no step to profile", "drop --profile or --dry-run"))
        return r, RunLayout.of(r, output_dir).root, window

    if inside_launch() and not dry_run:
        from accel_fsdp.train.loop import RunRequest, run_training

        die_with_launcher()

        def train() -> None:
            r, run_dir, window = checked()
            run_training(RunRequest(recipe=r, run_dir=run_dir, resume=resume, resume_from=resume_from,
                                    overwrite=overwrite, benchmark=benchmark, verbose=verbose, cpu=cpu,
                                    accept_data_change=accept_data_change, profile=window))

        run_rank(train)

    r, run_dir, window = checked()
    if dry_run:
        print_plan(r, accelerate_config, gpu_memory)
        return

    if DIE_WITH_PARENT_ENV in os.environ:
        die_with_launcher(DIE_WITH_PARENT_ENV)  # a probe of verify, a run of bench: it ends with them, its ranks too
        del os.environ[DIE_WITH_PARENT_ENV]
    with launcher.preemption_answered_until_launch():  # the checks before it can take minutes
        config, n, why = load_config_or_default(accelerate_config)
        if num_processes is not None:
            config.values["num_processes"] = n = num_processes
        if cpu:
            config.values["use_cpu"] = True  # as the ranks will read it (--cpu reaches them)
        machine = MachineOptions(machine_rank, main_process_ip, main_process_port, num_machines, rendezvous_timeout)
        machine.apply(config)
        raise_if(check_accelerate_config(config), f"{config.label} with these options has problems")
        machines, rank = config.num_machines(), config.machine_rank()
        if (problem := launcher.srun_step_problem(os.environ, config, machine)) is not None:
            raise UserError(problem)
        main_machine = rank == 0
        # Only the main machine looks at the (shared) run folder: the others would race with its ranks writing there.
        report = preflight(r, config, num_processes=n, run_dir=run_dir if main_machine else None, resume=resume,
                           resume_from=resume_from, overwrite=overwrite, check_hub=True, cpu_option=True,
                           accept_data_change=accept_data_change)
        if window and report.total_steps is not None and window.first > report.total_steps:
            # Known before launch, where the profiler would only say so after the whole run (train/profiling.py close).
            raise UserError(Problem("--profile", f"steps {window} begin after the run's {report.total_steps:,} "
                                    "optimizer steps: nothing would be profiled",
                                    f"give steps between 1 and {report.total_steps:,}, e.g. --profile "
                                    f"{min(5, report.total_steps)}-{min(6, report.total_steps)}"))
        where = (f" ({report.num_processes // machines} on this machine, machine_rank {rank} of {machines})"
                 if machines > 1 else "")
        click.echo(f"accel-fsdp: launching {report.num_processes} process(es){where} with {config.label}"
                   + ("" if why == "given" else f" ({why})"), err=True)
        for note in report.notes:
            click.echo(f"note: {note}", err=True)
        # The ranks run this same command: what the user gave, with the paths the ranks must not resolve again (they
        # may start elsewhere) made absolute, and without what the launcher alone consumes.
        argv = child_argv(click.get_current_context(), parent_only=LAUNCHER_OPTIONS, given={
            "name_or_path": str(Path(r.source).absolute()), "output_dir": str(run_dir),
            "resume_from": str(Path(resume_from).absolute()) if resume_from else None})
        # Through the module: tests replace `launcher.launch` to see what would be launched.
        sys.exit(launcher.launch(config, argv, num_processes=n, machine=machine, run_dir=run_dir))


LAUNCHER_OPTIONS = frozenset({"accelerate_config", "num_processes", "num_machines", "machine_rank", "main_process_ip",
                              "main_process_port", "rendezvous_timeout", "dry_run", "gpu_memory"})
"""Options of `recipe run` the launching process consumes (the accelerate config, the machines; a dry run never
launches): never passed on to the ranks."""
