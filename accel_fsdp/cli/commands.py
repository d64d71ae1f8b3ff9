"""The `accel-fsdp` command line. Thin: each command parses, loads, and calls one library function.

User mistakes are `UserError`s (click exceptions with exit status 2): one message naming the file or key, the
value and the fix; never a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import click

from accel_fsdp import __version__
from accel_fsdp.config.precision import MEMORY, MEMORY_CHOICES
from accel_fsdp.errors import Problem, UserError, raise_if, show_usage_error

click.UsageError.show = show_usage_error  # one format for every user mistake, click's own included

SET_HELP = "Override a recipe key, typed as YAML: --set training.lr=3e-4 --set model.lora.enabled=true (repeatable)."
CONFIG_HELP = ("Accelerate config: a shipped name (fsdp_2gpu) or a path. Default: fsdp_cpu (2 CPU ranks) without a "
               "GPU, else fsdp_1gpu with one process per local GPU.")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="accel-fsdp")
def main() -> None:
    """Fine-tune GPT-2 and Llama models with PyTorch FSDP through Hugging Face Accelerate.

    \b
    accel-fsdp recipe list                      what can be trained
    accel-fsdp recipe run quickstart            a tiny model, anywhere, in about a minute
    accel-fsdp recipe run gpt2-xl --accelerate-config fsdp_2gpu
    accel-fsdp checkpoint consolidate runs/gpt2-xl out/gpt2-xl
    """
    from accel_fsdp.quiet import quiet_warnings

    quiet_warnings()


# ---------------------------------------------------------------------------------------------- recipe


@main.group()
def recipe() -> None:
    """List, show, copy, validate and run recipes (what to train)."""


@recipe.command("list")
def recipe_list() -> None:
    """Shipped recipes: name, model, parameter count, description.

    \b
    accel-fsdp recipe list
    """
    from accel_fsdp.config.catalog import recipe_rows

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
    from accel_fsdp.config.recipe import key_reference

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
    from accel_fsdp.config.shipped import resolve_recipe

    path = resolve_recipe(name)
    try:
        click.echo(path.read_text(), nl=False)
    except (UnicodeDecodeError, OSError) as e:
        raise UserError(Problem(str(path), f"cannot be shown ({type(e).__name__}): not a UTF-8 text file",
                                "give a .yaml recipe")) from None


@recipe.command("copy")
@click.argument("name")
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Replace DEST if it exists.")
def recipe_copy(name: str, dest: Path, force: bool) -> None:
    """Copy a shipped recipe to DEST (a file or a folder) to edit it.

    \b
    accel-fsdp recipe copy gpt2-xl my-gpt2.yaml
    accel-fsdp recipe run my-gpt2.yaml --set data.path=mydata.jsonl
    """
    from accel_fsdp.config.shipped import resolve_recipe

    src = resolve_recipe(name)
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
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--accelerate-config", "accelerate_config", metavar="NAME|PATH", help=CONFIG_HELP)
@click.option("--num-processes", type=click.IntRange(1, 1 << 20), help="All ranks of the job, overriding the config "
              "(what the SLURM script passes for its allocation).")
@click.option("--num-machines", type=click.IntRange(1, 4096), help="Machines of the job, overriding the config.")
@click.option("--output-dir", type=click.Path(path_type=Path), help="Run folder, to say where its checkpoints go. "
              "Default: runs/<recipe name>.")
def recipe_validate(name_or_path: str, overrides: tuple[str, ...], accelerate_config: str | None,
                    num_processes: int | None, num_machines: int | None, output_dir: Path | None) -> None:
    """Check a recipe with an accelerate config, offline: keys, types, ranges, batch arithmetic, wrap class,
    context length, data fields. Exit status 2 with every problem listed when something is wrong.

    \b
    accel-fsdp recipe validate gpt2-xl --accelerate-config fsdp_2gpu
    accel-fsdp recipe validate my.yaml --set training.global_batch_size=64
    """
    from accel_fsdp.preflight import load_config_or_default, preflight
    from accel_fsdp.run.layout import RunLayout

    r = _load_recipe(name_or_path, overrides)
    config, n, why = load_config_or_default(accelerate_config)
    if num_machines is not None:
        config.values["num_machines"] = num_machines
    if num_processes is not None:
        config.values["num_processes"] = n = num_processes
    report = preflight(r, config, num_processes=n, for_target_hardware=True)
    s = report.settings
    click.echo(f"ok: {r.source} with {config.label}" + ("" if why == "given" else f" ({why})"))
    if report.parameters:
        click.echo(f"  model: {report.model_class}, {report.parameters:,} parameters")
    t = r.training
    k = t.accumulation_steps(s.num_processes.value)
    click.echo(f"  batch: global {t.global_batch_size} = micro {t.micro_batch_size} x {s.num_processes.value} "
               f"processes x {k} accumulation steps")
    if report.data_rows is not None:
        click.echo(f"  data: {r.data.path}: {report.data_rows:,} rows, format {r.data.format}")
    click.echo(f"  checkpoints: {RunLayout.of(r, output_dir).checkpoints}")
    click.echo("  FSDP settings (value, source):")
    click.echo(s.format(indent=4))
    for note in report.notes:
        click.echo(f"  note: {note}")


@recipe.command("run")
@click.argument("name_or_path")
@click.option("--accelerate-config", "accelerate_config", metavar="NAME|PATH", help=CONFIG_HELP)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--output-dir", type=click.Path(path_type=Path), help="Run folder. Default: runs/<recipe name>.")
@click.option("--resume", type=click.Choice(["latest", "auto"]), is_flag=False, flag_value="latest", default=None,
              help="Continue this run from its newest complete checkpoint. --resume auto: continue if the run folder "
              "holds this run with a complete checkpoint, else start it; refuse a folder of another run (what "
              "requeued SLURM jobs use).")
@click.option("--resume-from", type=click.Path(), help="Continue from this checkpoint folder.")
@click.option("--overwrite", is_flag=True, help="Replace a run already in the run folder.")
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
@click.option("--verbose", is_flag=True, help="Also print the resolved recipe and every FSDP setting with its source "
              "(they are always saved in the run folder: recipe.yaml, fsdp_settings.json).")
@click.option("--benchmark", is_flag=True, hidden=True, help="(accel-fsdp bench) No final evaluation, checkpoint or "
              "export.")
def recipe_run(name_or_path, accelerate_config, overrides, output_dir, resume, resume_from, overwrite, dry_run,
               gpu_memory, machine_rank, main_process_ip, main_process_port, num_machines, num_processes,
               rendezvous_timeout, verbose, benchmark) -> None:
    """Train a recipe on the hardware an accelerate config describes.

    Outside a distributed launch this launches itself through Accelerate's launcher (one process per rank);
    under `accelerate launch ... -m accel_fsdp recipe run ...` it trains in each rank.

    \b
    accel-fsdp recipe run quickstart
    accel-fsdp recipe run gpt2-xl --accelerate-config fsdp_2gpu --set training.max_steps=500
    accelerate launch --config_file accelerate_configs/fsdp_2gpu.yaml -m accel_fsdp recipe run gpt2-xl
    accel-fsdp recipe run quickstart --resume
    accel-fsdp recipe run llama-3.1-8b --dry-run --accelerate-config llama_fsdp_8gpu --gpu-memory 80GB
    """
    from accel_fsdp.launch.launcher import inside_launch
    from accel_fsdp.train.metrics import START_ENV
    from accel_fsdp.run.folder import RunLayout

    os.environ.setdefault(START_ENV, repr(time.time()))  # the ranks measure time to first step from here

    if resume and resume_from:
        raise UserError(Problem("--resume-from", "cannot be combined with --resume", "use one of them"))
    if overwrite and (resume or resume_from):
        raise UserError(Problem("--overwrite", f"cannot be combined with {'--resume' if resume else '--resume-from'}",
                                "use one of them"))
    r = _load_recipe(name_or_path, overrides)
    run_dir = RunLayout.of(r, output_dir).root
    if gpu_memory and not dry_run:
        raise UserError(Problem("--gpu-memory", "only applies to --dry-run (the plan is checked against it)",
                                "add --dry-run, or drop --gpu-memory"))
    if dry_run:
        from accel_fsdp.planning.plan import print_plan
        from accel_fsdp.quiet import quiet_libraries

        quiet_libraries()
        print_plan(r, accelerate_config, gpu_memory)
        return
    if inside_launch():
        from accel_fsdp.train.loop import RunRequest, run_training

        from accel_fsdp.train.lifetime import PREEMPTED, Preempted, die_with_launcher

        die_with_launcher()
        try:
            run_training(RunRequest(recipe=r, run_dir=run_dir, resume=resume, resume_from=resume_from,
                                    overwrite=overwrite, benchmark=benchmark, verbose=verbose))
        except UserError as e:
            # Every rank hits the same mistake; the first rank of each machine says it once.
            if int(os.environ.get("LOCAL_RANK", "0")) == 0 or e.rank_local:
                e.show()
            _leave_rank(e.exit_code)
        except Preempted as p:
            from accel_fsdp.config.accelerate import CONFIG_PATH_ENV

            if int(os.environ.get("RANK", "0")) == 0 and CONFIG_PATH_ENV not in os.environ:  # else our launcher says it
                click.echo(f"preempted ({p.signal_name}) after step {p.step}: checkpoint {p.checkpoint}; continue "
                           "with the same command and --resume (or --resume auto)", err=True)
            _leave_rank(PREEMPTED)
        except KeyboardInterrupt:  # Ctrl-C reaches every rank; the launcher says what to do next
            _leave_rank(130)
        _leave_rank(0)

    from accel_fsdp.config.accelerate import check_accelerate_config
    from accel_fsdp.launch.launcher import MachineOptions, launch
    from accel_fsdp.preflight import load_config_or_default, preflight

    config, n, why = load_config_or_default(accelerate_config)
    if num_processes is not None:
        config.values["num_processes"] = n = num_processes
    machine = MachineOptions(machine_rank, main_process_ip, main_process_port, num_machines, rendezvous_timeout)
    machine.apply(config)
    raise_if(check_accelerate_config(config), f"{config.label} with these options has problems")
    machines, rank = int(config.get("num_machines", 1) or 1), int(config.get("machine_rank", 0) or 0)
    main_machine = rank == 0
    # Only the main machine looks at the (shared) run folder: the others would race with its ranks writing there.
    report = preflight(r, config, num_processes=n, run_dir=run_dir if main_machine else None, resume=resume,
                       resume_from=resume_from, overwrite=overwrite, check_hub=True)
    where = f" ({report.num_processes // machines} on this machine, machine_rank {rank} of {machines})" \
        if machines > 1 else ""
    click.echo(f"accel-fsdp: launching {report.num_processes} process(es){where} with {config.label}"
               + ("" if why == "given" else f" ({why})"), err=True)
    for note in report.notes:
        click.echo(f"note: {note}", err=True)
    # The ranks run this same command: what the user gave, with the paths the ranks must not resolve again (they
    # may start elsewhere) made absolute, and without what the launcher alone consumes.
    argv = child_argv(click.get_current_context(), parent_only=LAUNCHER_OPTIONS, given={
        "name_or_path": str(Path(r.source).absolute()), "output_dir": str(run_dir),
        "resume_from": str(Path(resume_from).absolute()) if resume_from else None})
    sys.exit(launch(config, argv, num_processes=n, machine=machine, run_dir=run_dir))


LAUNCHER_OPTIONS = frozenset({"accelerate_config", "num_processes", "num_machines", "machine_rank", "main_process_ip",
                              "main_process_port", "rendezvous_timeout", "dry_run", "gpu_memory"})
"""Options of `recipe run` the launching process consumes (the accelerate config, the machines; a dry run never
launches): never passed on to the ranks."""


def child_argv(ctx: click.Context, *, parent_only=frozenset(), given: dict | None = None) -> list[str]:
    """The argv that runs this command again in a child process, derived from the command's own parameters: its
    subcommand path, then every parameter the user gave (not a default) in declaration order, each written as click
    reads it back; `given` sets parameters the child must receive whatever the user typed (None: leave out), and
    `parent_only` names those the parent alone consumes. A new option is forwarded without being listed here."""
    from click.core import ParameterSource

    given = given or {}
    path, c = [], ctx
    while c.parent is not None:
        path.insert(0, c.info_name)
        c = c.parent
    argv = list(path)
    for param in ctx.command.params:
        name = param.name
        if name in parent_only:
            continue
        if name in given:
            value = given[name]
        elif ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT,
                                                ParameterSource.PROMPT):
            value = ctx.params.get(name)
        else:
            continue
        if value is None or (param.multiple and not value):
            continue
        if isinstance(param, click.Argument):
            argv += [str(v) for v in value] if param.nargs != 1 else [str(value)]
            continue
        opt = next((o for o in param.opts if o.startswith("--")), param.opts[0])
        if param.is_flag:  # a switch: written when on (or its --no- form when off), never with a value
            on = param.flag_value if not param.is_bool_flag or isinstance(param.flag_value, bool) else True
            if value == on:
                argv.append(opt)
            elif param.secondary_opts:
                argv.append(next((o for o in param.secondary_opts if o.startswith("--")), param.secondary_opts[0]))
            continue
        for v in (value if param.multiple else [value]):
            argv += [opt, *map(str, v)] if param.nargs != 1 else [opt, str(v)]
    return argv


def _finite(param, value):
    import math

    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", param=param)
    return value


def _leave_rank(status: int) -> None:
    """End a rank: destroy the process group, flush, and exit without interpreter finalization, where gloo's
    worker threads can still hold tensors and abort the process (SIGABRT, "terminate called without an active
    exception"; see pytorch/pytorch#179291) after the work is done and saved."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _load_recipe(name_or_path: str, overrides):
    from accel_fsdp.config.shipped import display, resolve_recipe
    from accel_fsdp.config.recipe import load_recipe

    path = resolve_recipe(name_or_path)
    r = load_recipe(path, overrides)
    r.source = display(path)
    return r


# ------------------------------------------------------------------------------------------ checkpoint


@main.group()
def checkpoint() -> None:
    """Inspect checkpoints and consolidate them into Hugging Face model folders."""


@checkpoint.command("consolidate")
@click.argument("checkpoint_or_run", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Weight dtype of the export. Default: the recipe's checkpoint.export_dtype.")
@click.option("--max-shard-size", default="2GB", show_default=True, help="Split the weights into files of at most "
              "this size (with an index file); also bounds the memory used.")
@click.option("--merge", is_flag=True, help="LoRA checkpoints: also write the base model with the adapter merged "
              "into OUT_DIR/merged.")
@click.option("--base-model", help="LoRA with --merge: the base model (default: the one the adapter names).")
def checkpoint_consolidate(checkpoint_or_run, out_dir, dtype, max_shard_size, merge, base_model) -> None:
    """Turn a checkpoint (or a run folder's newest complete one) into a folder `from_pretrained` loads.

    \b
    accel-fsdp checkpoint consolidate runs/gpt2-xl out/gpt2-xl --dtype bf16
    accel-fsdp checkpoint consolidate runs/x/checkpoints/step-000200 out/x --max-shard-size 500MB
    """
    import yaml

    from accel_fsdp.checkpoint.store import resolve_checkpoint
    from accel_fsdp.checkpoint.consolidate import consolidate
    from accel_fsdp.planning.memory import parse_bytes, size_problem
    from accel_fsdp.run.layout import RECIPE_FILE

    try:
        size = parse_bytes(max_shard_size)
    except ValueError:
        raise UserError(size_problem("--max-shard-size", max_shard_size, "2GB or 500MB")) from None
    info = resolve_checkpoint(checkpoint_or_run, verify=True)
    if out_dir.resolve().is_relative_to(info.path.resolve()):
        raise UserError(Problem(str(out_dir), f"is inside the checkpoint {info.path}", "write the export elsewhere"))
    if dtype is None:
        try:
            saved = yaml.safe_load((info.path / RECIPE_FILE).read_text()) or {}
            dtype = saved.get("checkpoint", {}).get("export_dtype", "fp32")
        except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
            dtype = "fp32"
    if merge and not info.manifest.lora:
        raise UserError(Problem("--merge", f"{info.path} is not a LoRA checkpoint", "drop --merge"))
    click.echo(f"consolidating {info.path} (step {info.manifest.step}, {info.manifest.state_dict_type}) -> {out_dir}")
    report = consolidate(info, out_dir, dtype=dtype, max_shard_size=size, merge_lora=merge, base_model=base_model)
    click.echo(report.summary())


@checkpoint.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def checkpoint_inspect(path: Path, as_json: bool) -> None:
    """Describe a checkpoint, or every checkpoint of a run folder: step, world size, type, parameters, bytes,
    recipe, complete or not.

    \b
    accel-fsdp checkpoint inspect runs/quickstart
    """
    from accel_fsdp.checkpoint.store import (MANIFEST, _checkpoint_folders_of, describe, format_description,
                                       inspect_checkpoint, list_checkpoints)

    if not path.exists():
        raise UserError(Problem(str(path), "does not exist", "give a checkpoint or run folder"))
    if not path.is_dir():
        raise UserError(Problem(str(path), "is a file, not a checkpoint or run folder",
                                "give a step-NNNNNN folder or a run folder"))
    if (path / MANIFEST).exists() or path.name.startswith(("step-", ".tmp-step-")):
        infos = [inspect_checkpoint(path, verify=True)]
    else:
        folders = _checkpoint_folders_of(path)  # the run's own checkpoint folder first (RunLayout.at)
        folder = next((f for f in folders if list_checkpoints(f)), folders[0])
        infos = [inspect_checkpoint(c.path, verify=True) for c in list_checkpoints(folder)]
        infos += [inspect_checkpoint(p) for p in sorted(folder.glob(".tmp-step-*"))]
    if not infos:
        raise UserError(Problem(str(path), "holds no checkpoints", "give a run folder or a step-NNNNNN folder"))
    described = [describe(i) for i in infos]
    if as_json:
        click.echo(json.dumps(described if len(described) > 1 else described[0], indent=1))
        return
    click.echo("\n".join(format_description(d) for d in described))


# ------------------------------------------------------------------------------------------- tokenizer


@main.group()
def tokenizer() -> None:
    """Tokenizers of your own text, for models trained from scratch without a hub tokenizer."""


@tokenizer.command("train")
@click.argument("name_or_path")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--vocab-size", default=8192, show_default=True, type=click.IntRange(300, 1_000_000),
              help="Tokens in the vocabulary (special tokens included).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def tokenizer_train(name_or_path, out_dir, vocab_size, overrides) -> None:
    """Train a byte-level BPE tokenizer on a recipe's data (data.path and its fields) and write it to OUT_DIR, a
    folder `model.tokenizer` (and transformers) can load. Byte-level: every text is covered, no <unk>. A recipe can
    also say `model.tokenizer: bpe:8192` to train (and cache) one when it starts.

    \b
    accel-fsdp tokenizer train my.yaml tokenizers/mine --vocab-size 8192
    accel-fsdp recipe run my.yaml --set model.tokenizer=tokenizers/mine
    """
    from accel_fsdp.quiet import quiet_libraries
    from accel_fsdp.model.tokenizer import trained_tokenizer

    r = _load_recipe(name_or_path, [*overrides, f"model.tokenizer=bpe:{vocab_size}"])
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(Problem(str(out_dir), "exists and is not an empty folder", "give a new folder (nothing was "
                                "written)"))
    quiet_libraries()
    tok = trained_tokenizer(r, out_dir=out_dir.absolute())
    sample = r.data.path
    click.echo(f"wrote a byte-level BPE tokenizer of {len(tok):,} tokens trained on {sample} to {out_dir}")


# -------------------------------------------------------------------------------------------- estimate


class _NegativeNumberArgument(click.Command):
    """`estimate -5` would be read as an option "-5" with no fix offered: name it as the bad count it is."""

    def parse_args(self, ctx, args):
        import re

        takes_value = {name for p in self.params if isinstance(p, click.Option) and not p.is_flag for name in p.opts}
        for i, arg in enumerate(args):
            is_value = i > 0 and args[i - 1] in takes_value  # e.g. --gpus -2: click reports it as --gpus's value
            if not is_value and re.fullmatch(r"-[\d.,_]+([eE][-+]?\d+)?[KMBTkmbt]?", arg):
                raise UserError(Problem(arg, "is not a parameter count: it must be positive",
                                        "give e.g. 7B or 104960000, a model name (gpt2-xl) or a recipe"))
        return super().parse_args(ctx, args)


@main.command("estimate", cls=_NegativeNumberArgument)
@click.argument("what", metavar="MODEL|RECIPE|PARAM_COUNT")
@click.option("--gpus", default=1, show_default=True, type=click.IntRange(1, 4096), help="GPUs per node.")
@click.option("--nodes", default=1, show_default=True, type=click.IntRange(1, 4096))
@click.option("--gpu-memory", default="80GB", show_default=True, metavar="SIZE", help="Memory of one GPU.")
@click.option("--precision", default=MEMORY["bf16"], show_default=True, type=click.Choice(MEMORY_CHOICES))
@click.option("--strategy", "strategies", multiple=True,
              type=click.Choice(["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD"]),
              help="Only these strategies (repeatable). Default: all.")
@click.option("--offload/--no-offload", default=None, help="Only with (or without) CPU offload. Default: both.")
@click.option("--activation-checkpointing/--no-activation-checkpointing", default=None,
              help="Keep only each block's input for the backward. Default: the recipe's setting, else off.")
@click.option("--micro-batch", type=click.IntRange(0, 1 << 20), help="Rows per GPU per micro-step (0: no "
              "activations). Default: the recipe's, 1 for a model, 0 for a bare count.")
@click.option("--seq-len", type=click.IntRange(1, 1 << 24), help="Tokens per row. Default: the recipe's, else "
              "min(context, 2048).")
@click.option("--defer-reduce", is_flag=True, help="Gradient accumulation with fsdp.reduce_every_micro_step: false: "
              "count the unsharded fp32 gradients every rank holds between micro-steps.")
def estimate_command(what, gpus, nodes, gpu_memory, precision, strategies, offload, activation_checkpointing,
                     micro_batch, seq_len, defer_reduce) -> None:
    """Per-rank memory of each FSDP strategy (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, with and
    without CPU offload), which fit, and the cheapest that fits with the accelerate config to use.

    \b
    accel-fsdp estimate 104960000 --gpus 4 --precision fp32      # the seeds' calculator: 1.56 / 0.39 GiB
    accel-fsdp estimate gpt2-xl --gpus 2 --gpu-memory 24GB --micro-batch 4 --seq-len 1024
    accel-fsdp estimate llama-3.1-70b --gpus 8 --nodes 4 --activation-checkpointing
    accel-fsdp estimate llama-3.1-8b-lora --gpus 1 --gpu-memory 40GB
    """
    from accel_fsdp.planning.estimate import format_report, resolve_target, table
    from accel_fsdp.planning.memory import STRATEGIES, parse_bytes, size_problem

    try:
        budget = parse_bytes(gpu_memory)
    except ValueError:
        raise UserError(size_problem("--gpu-memory", gpu_memory)) from None
    if "HYBRID_SHARD" in strategies and nodes == 1:
        raise UserError(Problem("--strategy HYBRID_SHARD", "needs more than one node (it shards within a node and "
                                "replicates across nodes)", "add --nodes 2 or more, or use FULL_SHARD"))
    target = resolve_target(what, micro_batch, seq_len)
    if activation_checkpointing is None:
        activation_checkpointing = target.activation_checkpointing
    if target.context and target.seq_len > target.context:
        raise UserError(Problem("--seq-len", f"{target.seq_len} exceeds {target.name}'s context of {target.context} "
                                "tokens", f"use at most {target.context}"))
    if target.micro_batch and target.shape is None:
        raise UserError(Problem("--micro-batch", "activations need the model's shape, and a bare parameter count "
                                "has none", "name a model (gpt2-xl, llama-3.1-8b) or a recipe, or drop --micro-batch"))
    rows = table(target, gpus=gpus, nodes=nodes, precision=precision, activation_checkpointing=activation_checkpointing,
                 strategies=list(strategies) or list(STRATEGIES), offload=offload, gpu_memory=budget,
                 deferred_reduce=defer_reduce)
    click.echo(format_report(target, rows, gpus=gpus, nodes=nodes, precision=precision, gpu_memory=budget,
                             activation_checkpointing=activation_checkpointing, deferred_reduce=defer_reduce))


# ----------------------------------------------------------------------------------------------- bench


@main.command("bench")
@click.argument("name_or_path")
@click.option("--accelerate-config", "accelerate_config", metavar="NAME|PATH", help=CONFIG_HELP)
@click.option("--steps", default=10, show_default=True, type=click.IntRange(1, 100_000),
              help="Optimizer steps measured, after the warm-up.")
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(1, 1000))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--compare-baseline", is_flag=True, help="Also run a minimal hand-written Accelerate FSDP loop on the "
              "same model, batch and config, alternating the two, and print the throughput ratio ours / baseline.")
@click.option("--compare", "compare", type=click.Choice(["strategies", "wrapping"]),
              help="strategies: NO_SHARD vs SHARD_GRAD_OP vs FULL_SHARD; wrapping: per block vs whole model vs "
              "per Linear.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 50),
              help="With --compare-baseline: alternate ours and the baseline this many times; medians are reported.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def bench_command(name_or_path, accelerate_config, steps, warmup, overrides, compare_baseline, compare, rounds,
                  as_json) -> None:
    """Measure tokens/s per rank, step time, peak memory per rank (and MFU on GPUs) of a recipe.

    \b
    accel-fsdp bench quickstart --steps 20
    accel-fsdp bench quickstart --compare-baseline --rounds 3
    accel-fsdp bench quickstart --compare strategies
    accel-fsdp bench gpt2-xl --accelerate-config fsdp_1gpu --set data.path=builtin:quickstart --steps 20
    """
    from accel_fsdp.tools import bench
    from accel_fsdp.preflight import load_config_or_default, preflight

    r = _load_recipe(name_or_path, overrides)
    config, n, _ = load_config_or_default(accelerate_config)
    preflight(r, config, num_processes=n, check_hub=True)
    result, text = bench.run(r, config, list(overrides), steps=steps, warmup=warmup, compare=compare,
                             baseline_rounds=rounds if compare_baseline else 0)
    click.echo(bench.to_json(result) if as_json else text)


# ---------------------------------------------------------------------------------------------- verify


@main.command("verify")
@click.argument("name_or_path")
@click.option("--accelerate-config", "accelerate_config", metavar="NAME|PATH", help=CONFIG_HELP)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--quick", is_flag=True, help="Fewer probes: no comparison on fewer ranks.")
@click.option("--steps", default=4, show_default=True, type=click.IntRange(2, 100),
              help="Optimizer steps of each probe (resume is checked from step 2 when there are 3 or more).")
@click.option("--layers", type=click.IntRange(1, 1000), help="Verify the same settings on a copy of the architecture "
              "with this many blocks (for models too large to probe whole; pretrained weights of the first blocks).")
@click.option("--num-processes", type=click.IntRange(1, 1 << 20), help="Ranks, overriding the config.")
@click.option("--only", "only", multiple=True, type=click.Choice(
    ["sharding", "precision", "equivalence", "resume", "packing", "activation-checkpointing", "memory",
     "throughput"]), help="Only these checks (repeatable). Default: all.")
@click.option("--output-dir", type=click.Path(path_type=Path), help="Where the probes and report.json go. Default: "
              "runs/<recipe name>-verify.")
def verify_command(name_or_path, accelerate_config, overrides, quick, steps, layers, num_processes, only,
                   output_dir) -> None:
    """Prove on this hardware that the recipe trains correctly: sharding, precision, the same loss however the
    global batch is split, exact resume, packed documents kept apart, activation checkpointing with dropout,
    memory against the estimate, throughput. Each check prints PASS/FAIL with what was measured and the tolerance;
    exit status 1 when any fails. docs/VERIFY.md says what each proves, and what it cannot.

    \b
    accel-fsdp verify quickstart                                     # 2 CPU ranks: what CI runs
    accel-fsdp verify gpt2-xl --accelerate-config fsdp_2gpu
    accel-fsdp verify my.yaml --accelerate-config llama_fsdp_8gpu --quick --layers 4
    """
    from accel_fsdp.preflight import load_config_or_default
    from accel_fsdp.tools.verify import format_table, verify

    r = _load_recipe(name_or_path, overrides)
    config, n, _ = load_config_or_default(accelerate_config)
    if num_processes is not None:
        config.values["num_processes"] = n = num_processes
    out = (output_dir or Path(f"runs/{r.name}-verify")).expanduser().absolute()
    result = verify(r, config, n, list(overrides), out_dir=out, quick=quick, layers=layers, steps=steps,
                    only=list(only))
    click.echo(format_table(result))
    if any(c.status == "FAIL" for c in result.checks):
        sys.exit(1)


# ----------------------------------------------------------------------------------------------- slurm


@main.command("slurm")
@click.argument("name_or_path")
@click.option("--nodes", required=True, type=click.IntRange(1, 4096), help="Machines to allocate.")
@click.option("--gpus-per-node", required=True, type=click.IntRange(1, 64))
@click.option("--global-batch-size", type=click.IntRange(1, 1 << 24), help="Override the recipe's global batch.")
@click.option("--time", "time_limit", default="24:00:00", show_default=True, help="Wall-clock limit (HH:MM:SS).")
@click.option("--partition", help="SLURM partition.")
@click.option("--cpus-per-node", default=32, show_default=True, type=click.IntRange(1, 1024),
              help="CPU cores per node (data loading, tokenization, offload).")
@click.option("--signal-lead", default=300, show_default=True, type=click.IntRange(30, 86400),
              help="Seconds before the time limit at which SLURM signals the job to checkpoint and requeue: more "
              "than one optimizer step plus one checkpoint save.")
@click.option("--accelerate-config", "accelerate_config", default="fsdp_multinode", show_default=True,
              metavar="NAME|PATH", help="Accelerate config; node counts and addresses are set by the script.")
@click.option("--output-dir", type=click.Path(path_type=Path), help="Run folder, on a filesystem every node sees. "
              "Default: runs/<recipe name>.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("-o", "--output", "script", type=click.Path(path_type=Path), default=None,
              help="Where to write the script. Default: <recipe name>.sbatch.")
def slurm_command(name_or_path, nodes, gpus_per_node, global_batch_size, time_limit, partition, cpus_per_node,
                  signal_lead, accelerate_config, output_dir, overrides, script) -> None:
    """Write an sbatch script that trains a recipe on N nodes x G GPUs (one `accelerate launch` per node),
    checks the recipe on the allocation at job start, checkpoints and requeues itself on SLURM's warning signal
    before the time limit, and resumes when requeued (`--resume auto`: the CLI decides, never bash).

    \b
    accel-fsdp slurm llama-3.1-8b --nodes 4 --gpus-per-node 8 --time 12:00:00 --partition gpu -o job.sbatch
    accel-fsdp slurm gpt2-xl --nodes 2 --gpus-per-node 8 --accelerate-config fsdp_hybrid_multinode
    sbatch job.sbatch
    """
    import shlex

    from accel_fsdp.config.accelerate import load_accelerate_config
    from accel_fsdp.config.settings import batch_problem
    from accel_fsdp.preflight import preflight
    from accel_fsdp.run.folder import RunLayout
    from accel_fsdp.launch.slurm import render

    all_overrides = list(overrides) + ([f"training.global_batch_size={global_batch_size}"]
                                       if global_batch_size else [])
    r = _load_recipe(name_or_path, all_overrides)
    config = load_accelerate_config(accelerate_config)
    config.values.update(num_machines=nodes, machine_rank=0)
    from accel_fsdp.run.folder import decide
    from accel_fsdp.launch.slurm import GENERATED

    script = script or Path(f"{r.name}.sbatch")
    if script.is_dir() or not script.parent.is_dir():
        where = "is a folder" if script.is_dir() else \
            (f"is under {script.parent}, which is a file" if script.parent.exists()
             else "is in a folder that does not exist")
        raise UserError(Problem(str(script), where, "give the path of the script file to write (-o job.sbatch)"))
    if script.exists():
        try:
            ours = script.read_text(errors="replace").splitlines()[1].startswith(GENERATED)
        except (OSError, IndexError):
            ours = False
        if not ours:
            raise UserError(Problem(str(script), "exists and was not written by `accel-fsdp slurm`",
                                    "give another -o (nothing was changed)"))
    layout = RunLayout.of(r, output_dir)
    decide(layout, r, resume="auto")  # the folder the job will write: not a file, not another run's
    run_dir = layout.root
    t = r.training
    where = "--global-batch-size" if global_batch_size else r.where("training.global_batch_size")
    batch = batch_problem(where, t, [nodes, gpus_per_node], "GPUs")
    problems = [batch] if batch else []
    try:
        text = render(r, config, nodes=nodes, gpus_per_node=gpus_per_node, time_limit=time_limit,
                      partition=partition, output_dir=run_dir, overrides=all_overrides, script_name=script.name,
                      command=shlex.join(["accel-fsdp", "slurm"] + sys.argv[2:]), cpus_per_task=cpus_per_node,
                      signal_lead=signal_lead)
    except UserError as e:
        problems += e.problems
    raise_if(problems, f"{len(problems)} problems with this job")
    preflight(r, config, num_processes=nodes * gpus_per_node, for_target_hardware=True)
    script.write_text(text)
    script.chmod(0o755)
    k = t.accumulation_steps(nodes * gpus_per_node)
    click.echo(f"wrote {script}: {nodes} node(s) x {gpus_per_node} GPU(s), global batch {t.global_batch_size} = micro "
               f"{t.micro_batch_size} x {nodes * gpus_per_node} GPUs x {k} accumulation steps; run folder {run_dir}")
    click.echo(f"submit with: sbatch {script}")


# ---------------------------------------------------------------------------------------------- report


@main.command("report")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def report_command(run_dir: Path, as_json: bool) -> None:
    """Summarize a run (steps, final and best eval loss, tokens/s, peak memory) and draw its loss curve into
    RUN_DIR/loss_curve.png (needs matplotlib: pip install "accel-fsdp[plot]").

    \b
    accel-fsdp report runs/quickstart
    """
    from accel_fsdp.run.layout import RunLayout
    from accel_fsdp.tools.report import format_summary, plot, summarize

    summary = summarize(run_dir)
    try:
        png = plot(run_dir)
        RunLayout.at(run_dir).report_file.write_text(json.dumps({**summary, "loss_curve": str(png) if png else None},
                                                        indent=1) + "\n")
    except OSError as e:  # a read-only run folder (someone else's run): report, write nothing
        png = None
        click.echo(f"note: cannot write report.json / loss_curve.png into {run_dir} ({e.strerror or e})", err=True)
    summary["loss_curve"] = str(png) if png else None
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    click.echo(format_summary(summary))
    click.echo(f"  loss curve: {png}" if png else '  loss curve: install matplotlib (pip install "accel-fsdp[plot]")')


# -------------------------------------------------------------------------------------------- generate


@main.command("generate")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Text to continue (with --chat: the user's message).")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0, 10.0),
              callback=lambda ctx, param, v: _finite(param, v), help="0 is greedy; above 0 samples.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True),
              callback=lambda ctx, param, v: _finite(param, v),
              help="Nucleus sampling: keep the most likely tokens up to this probability mass.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for sampling.")
@click.option("--chat", is_flag=True, help="Render the prompt as a user turn with the tokenizer's chat template.")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
def generate_command(model_dir, prompt, max_new_tokens, temperature, top_p, seed, chat, device) -> None:
    """Sample from an exported model (a run folder, a consolidated folder, or a LoRA adapter folder).

    \b
    accel-fsdp generate runs/quickstart --prompt "alice has a"
    accel-fsdp generate out/llama-lora --chat --prompt "Name three prime numbers." --temperature 0.7 --top-p 0.9
    """
    from accel_fsdp.tools.generate import generate, load_model, resolve_model_dir
    from accel_fsdp.quiet import quiet_libraries

    if not prompt.strip():
        raise UserError(Problem("--prompt", "is empty", 'give some text to continue, e.g. --prompt "alice has a"'))
    quiet_libraries()
    folder = resolve_model_dir(model_dir)
    model, tokenizer = load_model(folder, device)
    text = generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                    seed=seed, chat=chat)
    click.echo(f"{prompt} {text}" if not chat else text)


if __name__ == "__main__":  # pragma: no cover
    main()
