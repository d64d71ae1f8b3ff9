"""`accel-fsdp checkpoint ...`: consolidate a checkpoint into a Hugging Face folder, inspect checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import click

from accel_fsdp.checkpoint.index import (
    CheckpointDescription,
    checkpoint_folders_of,
    describe,
    inspect_checkpoint,
    list_checkpoints,
)
from accel_fsdp.cli.options import GivenPath, not_empty
from accel_fsdp.config.precision import PRECISIONS
from accel_fsdp.config.recipe import read_saved_recipe
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.layout import CHECKPOINT_PREFIXES, MANIFEST, RECIPE_FILE, dangling_link_problem
from accel_fsdp.planning.memory import parse_bytes, size_problem

# ------------------------------------------------------------------------------------------ checkpoint


@click.group()
def checkpoint() -> None:
    """Inspect checkpoints and consolidate them into Hugging Face model folders."""


@checkpoint.command("consolidate")
@click.argument("checkpoint_or_run", type=GivenPath(path_type=Path))
@click.argument("out_dir", type=GivenPath(path_type=Path))
@click.option("--dtype", type=click.Choice(PRECISIONS), default=None,
              help="Weight dtype of the export. Default: the recipe's checkpoint.export_dtype.")
@click.option("--max-shard-size", default="2GB", show_default=True, help="Split the weights into files of at most "
              "this size (with an index file); also bounds the memory used.")
@click.option("--merge", is_flag=True, help="LoRA checkpoints: also write the base model with the adapter merged "
              "into OUT_DIR/merged.")
@click.option("--base-model", callback=not_empty,
              help="LoRA with --merge: the base model (default: the one the adapter names).")
def checkpoint_consolidate(checkpoint_or_run, out_dir, dtype, max_shard_size, merge, base_model) -> None:
    """Turn a checkpoint (or a run folder's newest complete one) into a folder `from_pretrained` loads.

    \b
    accel-fsdp checkpoint consolidate runs/gpt2-xl out/gpt2-xl --dtype bf16
    accel-fsdp checkpoint consolidate runs/x/checkpoints/step-000200 out/x --max-shard-size 500MB
    """
    from accel_fsdp.checkpoint.consolidate import consolidate
    from accel_fsdp.checkpoint.store import reading

    if base_model and not merge:
        raise UserError(Problem("--base-model", "only applies to --merge (the base the adapter is merged into)",
                                "add --merge, or drop --base-model"))
    try:
        size = parse_bytes(max_shard_size)
    except ValueError:
        raise UserError(size_problem("--max-shard-size", max_shard_size, "2GB or 500MB")) from None
    if (dangling := dangling_link_problem(out_dir)) is not None:  # resolve() below would raise on a loop
        raise UserError(dangling)
    with reading(checkpoint_or_run) as point:  # a live run's rotation passes over it meanwhile
        info = point.checkpoint
        for newer in point.passed_over:
            click.echo(f"note: {newer.path} is newer but not usable ({newer.reason}): exporting {info.name}", err=True)
        if out_dir.resolve().is_relative_to(info.path.resolve()):
            raise UserError(Problem(str(out_dir), f"is inside the checkpoint {info.path}",
                                    "write the export elsewhere"))
        if dtype is None:
            try:
                dtype = read_saved_recipe(info.path / RECIPE_FILE).get("checkpoint", {}).get("export_dtype", "fp32")
            except UserError:
                dtype = "fp32"
        if merge and not info.manifest.lora:
            raise UserError(Problem("--merge", f"{info.path} is not a LoRA checkpoint", "drop --merge"))
        click.echo(f"consolidating {info.path} (step {info.manifest.step}, {info.manifest.state_dict_type}) -> "
                   f"{out_dir}")
        report = consolidate(info, out_dir, dtype=dtype, max_shard_size=size, merge_lora=merge, base_model=base_model)
    click.echo(report.summary())


@checkpoint.command("inspect")
@click.argument("path", type=GivenPath(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def checkpoint_inspect(path: Path, as_json: bool) -> None:
    """Describe a checkpoint, or every checkpoint of a run folder: step, world size, type, parameters, bytes,
    recipe, complete or not. With --json: one object for a checkpoint folder, a list for a run folder.

    \b
    accel-fsdp checkpoint inspect runs/quickstart
    """
    if (dangling := dangling_link_problem(path)) is not None:
        raise UserError(dangling)
    if not path.exists():
        raise UserError(Problem(str(path), "does not exist", "give a checkpoint or run folder"))
    if not path.is_dir():
        raise UserError(Problem(str(path), "is a file, not a checkpoint or run folder",
                                "give a step-NNNNNN folder or a run folder"))
    one_checkpoint = (path / MANIFEST).exists() or path.name.startswith(CHECKPOINT_PREFIXES[:2])
    if one_checkpoint:
        infos = [inspect_checkpoint(path, verify=True)]
    else:
        folders = checkpoint_folders_of(path)  # the run's own checkpoint folder first (RunLayout.at)
        folder = next((f for f in folders if list_checkpoints(f)), folders[0])
        infos = [inspect_checkpoint(c.path, verify=True) for c in list_checkpoints(folder)]
        infos += [inspect_checkpoint(p) for p in sorted(folder.glob(f"{CHECKPOINT_PREFIXES[1]}*"))]
    if not infos and any((path / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise UserError(Problem(str(path), "is an exported model folder, which holds no checkpoints",
                                "give the run folder it came from, or a step-NNNNNN folder (`generate` and "
                                "from_pretrained read this one)"))
    if not infos:
        raise UserError(Problem(str(path), "holds no checkpoints", "give a run folder or a step-NNNNNN folder"))
    described = [describe(i) for i in infos]
    if as_json:
        # The shape follows what was given, never how many checkpoints a run holds: a script reads a run folder's
        # list the same way whether it saved one checkpoint or ten.
        records = [d.to_dict() for d in described]
        click.echo(json.dumps(records[0] if one_checkpoint else records, indent=1))
        return
    click.echo("\n".join(format_description(d) for d in described))


def format_description(d: CheckpointDescription) -> str:
    """The text `checkpoint inspect` prints for one checkpoint."""
    status = "complete" if d.complete else f"INCOMPLETE: {d.problem}"
    lines = [f"{d.path}: {status}"]
    if d.step is None or d.world_size is None:  # no (readable) manifest: nothing more is known
        return lines[0]
    params = f"{d.parameters:,}" if d.parameters else "?"
    lora = ", LoRA adapter" if d.lora else ""
    lines.append(f"  step {d.step} (epoch {d.epoch}), world size {d.world_size}, {d.state_dict_type}, "
                 f"FSDP{d.fsdp_version}{lora}")
    lines.append(f"  parameters {params}, {d.bytes / (1 << 20):,.1f} MB in {d.files} files, created {d.created}")
    r = d.recipe
    if r is not None:
        if len(r.sources) > 1:
            data = f"a mixture of {len(r.sources)} sources"
        else:
            data = r.sources[0].path if r.sources else None
        lines.append(f"  recipe {r.name}: model {r.model}, data {data}, global batch {r.global_batch_size}, "
                     f"lr {r.lr}, max_steps {r.max_steps}")
        if len(r.sources) > 1:
            lines += [f"    {s.name:<16} {s.share:.2f} of the mixture: {s.path}" for s in r.sources]
    return "\n".join(lines)
