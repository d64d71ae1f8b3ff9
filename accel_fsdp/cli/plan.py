"""`accel-fsdp estimate` (memory per GPU for each strategy) and `accel-fsdp slurm` (an sbatch script)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from accel_fsdp.cli.options import GivenPath, load_recipe, names_a_folder, not_empty, set_option
from accel_fsdp.config.accelerate import BY_SHARDING, HYBRID_SHARD, load_accelerate_config
from accel_fsdp.config.precision import MEMORY, MEMORY_CHOICES
from accel_fsdp.config.settings import batch_problem
from accel_fsdp.errors import Problem, UserError, raise_if
from accel_fsdp.files import write_atomic
from accel_fsdp.launch.slurm import GENERATED, edited_since_written, node_local_note, render
from accel_fsdp.layout import RunLayout
from accel_fsdp.planning.estimate import format_report, resolve_target, table
from accel_fsdp.planning.memory import gpu_memory_bytes
from accel_fsdp.preflight import preflight
from accel_fsdp.run.folder import decide

# -------------------------------------------------------------------------------------------- estimate


class _NegativeNumberArgument(click.Command):
    """`estimate -5` would be read as an option "-5" with no fix offered: name it as the bad count it is."""
    def parse_args(self, ctx, args):
        import re

        takes_value = {name for p in self.params if isinstance(p, click.Option) and not p.is_flag for name in p.opts}
        for i, arg in enumerate(args):
            is_value = i > 0 and args[i - 1] in takes_value  # e.g. --gpus -2: click reports it as --gpus's value
            if not is_value and re.fullmatch(r"-([\d.,_]+([eE][-+]?\d+)?[KMBTkmbt]?|inf|nan)", arg, re.I):
                raise UserError(Problem(arg, "is not a parameter count: it must be positive",
                                        "give e.g. 7B or 104960000, a model name (gpt2-xl) or a recipe"))
        return super().parse_args(ctx, args)


@click.command("estimate", cls=_NegativeNumberArgument)
@click.argument("what", metavar="MODEL|RECIPE|PARAM_COUNT")
@click.option("--gpus", "--gpus-per-node", "gpus", default=1, show_default=True, type=click.IntRange(1, 4096),
              help="GPUs per node (--gpus-per-node, as `slurm` spells it, is the same option).")
@click.option("--nodes", default=1, show_default=True, type=click.IntRange(1, 4096))
@click.option("--gpu-memory", default="80GB", show_default=True, metavar="SIZE", help="Memory of one GPU.")
@click.option("--precision", default=MEMORY["bf16"], show_default=True, type=click.Choice(MEMORY_CHOICES))
@click.option("--strategy", "strategies", multiple=True,
              type=click.Choice(BY_SHARDING),
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
    accel-fsdp estimate 104960000 --gpus 4 --precision fp32      # 16 bytes/parameter: 1.56 / 0.39 GiB
    accel-fsdp estimate gpt2-xl --gpus 2 --gpu-memory 24GB --micro-batch 4 --seq-len 1024
    accel-fsdp estimate llama-3.1-70b --gpus 8 --nodes 4 --activation-checkpointing
    accel-fsdp estimate llama-3.1-8b-lora --gpus 1 --gpu-memory 40GB
    accel-fsdp estimate ./my-llama --gpus 2                      # a local GPT-2 or Llama model folder
    """
    budget = gpu_memory_bytes(gpu_memory)
    if HYBRID_SHARD in strategies and nodes == 1:
        raise UserError(Problem("--strategy HYBRID_SHARD", "needs more than one node (it shards within a node and "
                                "replicates across nodes)", "add --nodes 2 or more, or use FULL_SHARD"))
    target = resolve_target(what, micro_batch, seq_len)
    if activation_checkpointing is None:
        activation_checkpointing = target.activation_checkpointing
    if target.context and target.seq_len > target.context:
        raise UserError(Problem("--seq-len", f"{target.seq_len} exceeds {target.name}'s context of {target.context} "
                                "tokens", f"use at most {target.context}"))
    for option, given in (("--micro-batch", target.micro_batch), ("--seq-len", seq_len)):
        if given and target.shape is None:  # --seq-len was ignored without a word
            raise UserError(Problem(option, "activations need the model's shape, and a bare parameter count has none",
                                    f"name a model (gpt2-xl, llama-3.1-8b) or a recipe, or drop {option}"))
    rows = table(target, gpus=gpus, nodes=nodes, precision=precision, activation_checkpointing=activation_checkpointing,
                 strategies=list(strategies) or list(BY_SHARDING), offload=offload, gpu_memory=budget,
                 deferred_reduce=defer_reduce)
    click.echo(format_report(target, rows, gpus=gpus, nodes=nodes, precision=precision, gpu_memory=budget,
                             activation_checkpointing=activation_checkpointing, deferred_reduce=defer_reduce))


# ----------------------------------------------------------------------------------------------- slurm


@click.command("slurm")
@click.argument("name_or_path")
@click.option("--nodes", required=True, type=click.IntRange(1, 4096), help="Machines to allocate.")
@click.option("--gpus-per-node", required=True, type=click.IntRange(1, 64))
@click.option("--global-batch-size", type=click.IntRange(1, 1 << 24), help="Override the recipe's global batch.")
@click.option("--time", "time_limit", default="24:00:00", show_default=True,
              help="Wall-clock limit, in any form sbatch takes (HH:MM:SS, D-HH:MM:SS, minutes, MM:SS, D-HH, D-HH:MM).")
@click.option("--partition", help="SLURM partition.")
@click.option("--cpus-per-node", default=32, show_default=True, type=click.IntRange(1, 1024),
              help="CPU cores per node (data loading, tokenization, offload).")
@click.option("--signal-lead", default=300, show_default=True, type=click.IntRange(30, 86400),
              help="Seconds before the time limit at which SLURM signals the job to checkpoint and requeue: more "
              "than one optimizer step plus one checkpoint save.")
@click.option("--accelerate-config", "accelerate_config", default="fsdp_multinode", show_default=True,
              callback=not_empty,
              metavar="NAME|PATH", help="Accelerate config; node counts and addresses are set by the script.")
@click.option("--output-dir", type=GivenPath(path_type=Path), help="Run folder, on a filesystem every node sees. "
              "Default: runs/<recipe name>.")
@set_option
@click.option("-o", "--output", "script", type=GivenPath(), default=None,
              help="Where to write the script. Default: <recipe name>.sbatch. An existing file is replaced only if "
              "this command wrote it and it was not edited since.")
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

    given = [item for item in overrides if item.partition("=")[0].strip() == "training.global_batch_size"]
    if global_batch_size and given and given[0].partition("=")[2].strip() != str(global_batch_size):
        raise UserError(Problem("--global-batch-size", f"{global_batch_size} and --set {given[0].strip()} both set "
                                "the global batch", "give one of them"))
    all_overrides = list(overrides) + ([f"training.global_batch_size={global_batch_size}"]
                                       if global_batch_size else [])
    r = load_recipe(name_or_path, all_overrides)
    config = load_accelerate_config(accelerate_config)
    config.values.update(num_machines=nodes, machine_rank=0)

    script = _script_path(script, default=f"{r.name}.sbatch")
    replacing = script.exists() and _replaceable_script(script)
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
    write_atomic(script, text)
    script.chmod(0o755)
    k = t.accumulation_steps(nodes * gpus_per_node)
    ranks = "CPU ranks" if config.uses_cpu() else "GPUs"
    folders = {"the run folder": run_dir, **({"checkpoint.dir": layout.checkpoints} if layout.external_checkpoints
                                              else {})}
    if note := node_local_note(folders, os.environ):
        click.echo(f"note: {note}", err=True)
    if replacing:
        click.echo(f"note: {script} was replaced: an earlier script of `accel-fsdp slurm`, not edited since",
                   err=True)
    click.echo(f"wrote {script}: {nodes} node(s) x {gpus_per_node} {ranks}, global batch {t.global_batch_size} = "
               f"micro {t.micro_batch_size} x {nodes * gpus_per_node} {ranks} x {k} accumulation steps; run folder "
               f"{run_dir}")
    click.echo(f"submit with: sbatch {script}")


def _script_path(typed: str | None, *, default: str) -> Path:
    """The file -o names (else `default`), refused where it cannot be a file written in a folder that exists."""
    script = Path(typed or default)
    if script.is_dir() or not script.parent.is_dir() or (typed and names_a_folder(typed)):
        where = ("is a folder" if script.is_dir() else "ends with a separator, so it names a folder"
                 if typed and names_a_folder(typed) else
                 f"is under {script.parent}, which is a file" if script.parent.exists() else
                 "is in a folder that does not exist")
        raise UserError(Problem(typed or str(script), where,
                                "give the path of the script file to write (-o job.sbatch)"))
    return script


def _replaceable_script(script: Path) -> bool:
    """An existing -o file is replaced only where nothing of the user's is lost: a script this command wrote and
    nobody edited since (the digest in its header says so). Anything else is one message, and it stays as it is."""
    try:
        text = script.read_text(errors="replace")
    except OSError:
        text = ""
    lines = text.split("\n", 2)
    if len(lines) < 3 or not lines[1].startswith(GENERATED):
        raise UserError(Problem(str(script), "exists and was not written by `accel-fsdp slurm`",
                                "give another -o (nothing was changed)"))
    edited = edited_since_written(text)
    if edited is not False:
        why = ("was edited since `accel-fsdp slurm` wrote it: replacing it would lose the edits" if edited else
               "was written by an older `accel-fsdp slurm`, which kept no checksum: edits to it cannot be told")
        raise UserError(Problem(str(script), why, "give another -o, or move it away first (nothing was changed)"))
    return True
