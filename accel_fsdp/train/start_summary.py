"""The start summary: what a person checks before walking away (model, data, the method and its loss path, the
knobs, batch arithmetic, sharding, the 4-bit base, where files go), said once by the main process when the run is
built (train/setup.py). Every setting with its source is in fsdp_settings.json (and printed by --verbose)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel_fsdp.config.settings import Source
from accel_fsdp.layout import RunLayout
from accel_fsdp.model.checks import human_count
from accel_fsdp.train.sharding import ShardingRecord

if TYPE_CHECKING:
    from accel_fsdp.train.methods import Objective
    from accel_fsdp.train.setup import ShardedModel


def startup_summary(recipe, settings, layout: RunLayout, data, built: ShardedModel, held: list[int],
                    total_steps: int, sampler, objective: Objective | None = None,
                    dropout_off: dict[str, float] | None = None) -> str:
    """What a person checks before walking away: model, data, batch arithmetic, sharding, where files go. Every
    setting with its source is in fsdp_settings.json (and printed by --verbose)."""
    s, t = settings, recipe.training
    parameters, trainable = built.parameters, built.trainable_parameters
    source = ("from scratch" if recipe.model.architecture else
              "read by rank 0 only, shards sent to the others" if built.rank0_only_loading else "read by every rank")
    trained = "all trainable" if trainable == parameters else f"{trainable:,} trainable (LoRA)"
    epochs = total_steps * t.global_batch_size / max(1, len(data))
    every = recipe.checkpoint.every_steps
    lines = [
        f"  model     {built.model_class}, {human_count(parameters)} parameters ({trained}); weights {source}",
        *data_summary(recipe, data, sampler, total_steps),
        *([objective.summary()] if objective is not None and objective.summary() else []),
        *([objective.loss_path.describe()] if objective is not None else []),
        *dropout_summary(recipe, dropout_off or {}),
        *built.knobs.summary(),
        f"  batch     global {t.global_batch_size}{' pairs' if data.pairs else ''} = micro {t.micro_batch_size} x "
        f"{s.num_processes.value} rank(s) x "
        f"{sampler.accumulation_steps} accumulation step(s); {total_steps:,} optimizer steps ({epochs:.2f} epochs)",
        f"  sharding  FSDP{s.fsdp_version.value} {s.sharding_strategy.value} on {s.device.value}: ranks hold "
        f"{' / '.join(f'{n:,}' for n in held)} of {parameters:,} parameters; units "
        f"{', '.join(s.wrap_classes.value) or s.wrap_policy.value}; {s.mixed_precision.value} compute"
        + (f" ({s.mixed_precision.source_text})" if s.mixed_precision.source == Source.DETECTED else "")
        + (", CPU offload" if s.cpu_offload.value else "") + (", activation checkpointing"
                                                              if s.activation_checkpointing.value else ""),
        f"  files     {layout.root}: recipe.yaml, fsdp_settings.json (every setting and its source), metrics.jsonl; "
        f"checkpoints {'every ' + str(every) + ' steps and ' if every else ''}at the end in {layout.checkpoints}",
    ]
    return "\n".join(lines)


def quantize_summary(recipe, sharding: ShardingRecord) -> str:
    """The line saying what the 4-bit base is and what each rank holds of it (model.quantize), or nothing."""
    base, held = sharding.quantized_base, sharding.quantized_bytes
    if not base or not held:
        return ""
    copy = sum(held) * sharding.expected_shards / len(held)  # replicas (hybrid sharding) hold the same shards
    each = " / ".join(f"{h / 2**20:,.2f}" for h in held)
    return (f"\n  quantize  {base['method']}: {base['layers']} decoder-block linear layers in 4 bits, "
            f"{copy / 2**20:,.2f} MiB of codes and scales; ranks hold {each} MiB; base fingerprint "
            f"{base['fingerprint'][:12]}")


def dropout_summary(recipe, dropout_off: dict[str, float]) -> list[str]:
    """The line saying which dropout a method that trains without it turned off."""
    if not dropout_off:
        return []
    each = ", ".join(f"{key} {p:g}" for key, p in dropout_off.items())
    return [f"  dropout   off for {recipe.training.method} (preference.keep_dropout: true keeps it): {each} -> 0"]


def data_summary(recipe, data, sampler, steps: int) -> list[str]:
    """The data lines of the start summary: each source, its share of the mixture and the epochs of it the run
    reads."""
    if len(data.sources) == 1:
        return [f"  data      {data.sources[0].config.path}: {data.stats.summary()}"]
    epochs = sampler.epochs(steps, data.mean_costs())
    lines = [f"  data      a mixture of {len(data.sources)} sources by {recipe.data.mix_by} "
             f"({'loss-carrying tokens' if recipe.data.mix_by == 'tokens' else 'sequences'} shared by weight):"]
    for s, w, e in zip(data.sources, sampler.weights, epochs):
        lines.append(f"    {s.name:<16} {w:.2f} of the mixture, about {e:.2f} epochs of it: {s.config.path}: "
                     f"{s.stats.summary()}")
    return lines
