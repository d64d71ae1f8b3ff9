"""The dry run: the FSDP plan of a recipe on an accelerate config, with no weights, no GPU and no network.

The model is built on the meta device (structure only). Its FSDP units are found the way Accelerate's FSDP2
preparation finds them (`accelerate.utils.fsdp_utils`: the wrap policy applied bottom-up to every submodule,
then the input embedding and the [final norm, output head] tail as units of their own, the root taking what
is left); FSDP1 wraps the policy's modules and the root. Per-rank memory comes from `memory.estimate`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import click

from accel_fsdp.config.accelerate import HYBRID_SHARD
from accel_fsdp.config.methods import METHODS
from accel_fsdp.config.precision import BYTES, MEMORY
from accel_fsdp.data.sources import locate, source_key
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.model.facts import facts_for, shape_of
from accel_fsdp.model.quantize import quantized_terms
from accel_fsdp.model.tokenizer import offline_tokenizer
from accel_fsdp.planning.knob_advice import advice, recipe_settings
from accel_fsdp.planning.memory import (
    MemoryBreakdown,
    MemoryInputs,
    describe_logits,
    estimate,
    gib,
    gpu_memory_bytes,
)
from accel_fsdp.preflight import load_config_or_default, preflight


@dataclass
class Unit:
    name: str
    """Module path ('' for the root)."""
    kind: str
    """Class name, or a label for Accelerate's grouped units."""
    params: int


@dataclass
class Plan:
    recipe: object
    settings: object
    config_label: str
    model_class: str
    parameters: int
    trainable: int
    units: list[Unit]
    memory: MemoryBreakdown
    memory_inputs: MemoryInputs
    notes: list[str]

    @property
    def largest_unit(self) -> Unit:
        return max(self.units, key=lambda u: u.params)


def fsdp_units(model, settings) -> list[Unit]:
    """The FSDP units Accelerate would create for `model` under `settings` (meta-device model is fine)."""
    from accelerate.utils.fsdp_utils import _find_final_norm, fsdp2_prepare_auto_wrap_policy
    from accelerate.utils.other import get_module_children_bottom_up

    from accel_fsdp.train.accelerator import build_fsdp_plugin

    plugin = build_fsdp_plugin(settings, for_planning=True)
    plugin.set_auto_wrap_policy(model)
    if settings.fsdp_version.value == 2:
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    else:
        policy = _fsdp1_policy(plugin)
    names = {m: n for n, m in model.named_modules()}
    owner: dict[int, str] = {}  # parameter id -> unit name, bottom-up like fully_shard
    units: list[Unit] = []

    def claim(name: str, kind: str, modules) -> None:
        count = 0
        for module in modules:
            for p in module.parameters():
                if id(p) not in owner:
                    owner[id(p)] = name
                    count += p.numel()
        units.append(Unit(name, kind, count))

    if policy is not None:
        for module in get_module_children_bottom_up(model)[:-1]:
            if policy(module):
                claim(names[module], type(getattr(module, "_checkpoint_wrapped_module", module)).__name__, [module])
    if settings.fsdp_version.value == 2:
        embed = getattr(model, "get_input_embeddings", lambda: None)()
        head = getattr(model, "get_output_embeddings", lambda: None)()
        tied = embed is not None and head is not None and getattr(embed, "weight", None) is getattr(head, "weight", 0)
        if embed is not None and not tied:
            claim(names[embed], f"embedding ({type(embed).__name__})", [embed])
        norm = _find_final_norm(model)
        tail = [m for m in ((norm, embed, head) if tied else (norm, head)) if m is not None]
        if tail:
            label = "tail [" + ", ".join(names[m].split(".")[-1] for m in tail) + "]" + (" (tied)" if tied else "")
            claim("+".join(names[m] for m in tail), label, tail)
    claim("", f"root ({type(model).__name__})", [model])
    return [u for u in units if u.params > 0 or u.name == ""]


def _fsdp1_policy(plugin):
    """FSDP1 wraps each module its policy accepts; express that as a module -> bool predicate."""
    import functools

    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    fn = plugin.auto_wrap_policy
    base = fn.func if isinstance(fn, functools.partial) else fn
    if base is transformer_auto_wrap_policy:
        classes = tuple(fn.keywords["transformer_layer_cls"])
        return lambda m: isinstance(m, classes)
    if base is size_based_auto_wrap_policy:
        return lambda m: sum(p.numel() for p in m.parameters()) >= plugin.min_num_params
    return None


def build_plan(recipe, config, *, num_processes: int | None = None) -> Plan:
    from accel_fsdp.model import build as model_lib

    report = preflight(recipe, config, num_processes=num_processes, check_data=False, for_target_hardware=True)
    settings = report.settings
    config_obj = model_lib.model_config(recipe, tokenizer=offline_tokenizer(recipe), offline=True)
    if config_obj is None:
        raise UserError(Problem(recipe.where("model.name_or_path"),
                                f"{recipe.model.name_or_path!r} is not a known architecture and not in the local "
                                "cache, so it cannot be planned offline",
                                "use a known name (accel-fsdp estimate --help lists them), a local folder, or "
                                "model.architecture"))
    meta = model_lib.meta_model(config_obj, recipe.model.trust_remote_code)
    if recipe.model.lora.enabled:
        meta = model_lib.apply_lora(meta, recipe)
    parameters = model_lib.count_parameters(meta)
    trainable = model_lib.count_parameters(meta, trainable_only=True)
    units = fsdp_units(meta, settings)
    strategy = settings.sharding_strategy.value
    shard_group = settings.dp_shard_size.value if strategy == HYBRID_SHARD else settings.num_processes.value
    frozen_bytes = BYTES[settings.mixed_precision.value] if recipe.model.lora.enabled else 4  # LoRA: compute dtype
    inputs = MemoryInputs(
        params=parameters, trainable=trainable, largest_unit=max(u.params for u in units),
        world=settings.num_processes.value, shard_group=shard_group, strategy=strategy,
        precision=MEMORY[settings.mixed_precision.value],
        offload=bool(settings.cpu_offload.value),
        activation_checkpointing=bool(settings.activation_checkpointing.value),
        micro_batch=recipe.training.sequences_per_micro_step(), seq_len=recipe.data.seq_len, shape=shape_of(config_obj),
        frozen_bytes=frozen_bytes, quantized=_quantized_terms(recipe, BYTES[settings.mixed_precision.value]),
        deferred_reduce=not settings.reduce_every_micro_step.value
        and recipe.training.accumulation_steps(settings.num_processes.value) > 1,
        **recipe_settings(recipe, settings.mixed_precision.value))
    return Plan(recipe, settings, config.label, type(meta).__name__, parameters, trainable, units, estimate(inputs),
                inputs, report.notes)


def _quantized_terms(recipe, compute: int):
    """model.quantize's terms of the memory plan, from the model's facts (GPT-2 and Llama; others are refused)."""
    facts = facts_for(recipe) if recipe.model.quantize else None
    return quantized_terms(facts, compute) if facts is not None else None


def format_plan(plan: Plan, gpu_memory: float | None) -> str:
    s, r = plan.settings, plan.recipe
    lines = [f"plan: {r.source} on {plan.config_label}: {s.num_processes.value} rank(s) on {s.num_machines.value} "
             f"machine(s), FSDP{s.fsdp_version.value} {s.sharding_strategy.value}, {s.mixed_precision.value}"
             + (", CPU offload" if s.cpu_offload.value else "")
             + (", activation checkpointing" if s.activation_checkpointing.value else ""),
             f"model: {plan.model_class}, {plan.parameters:,} parameters ({plan.trainable:,} trainable), "
             "built on the meta device (no weights loaded)",
             f"FSDP units: {len(plan.units)} (wrap classes: {', '.join(s.wrap_classes.value) or 'none'})"]
    counts = Counter((u.kind, u.params) for u in plan.units)
    for (kind, params), n in sorted(counts.items(), key=lambda kv: (-kv[1], -kv[0][1])):
        examples = [u.name or "<root>" for u in plan.units if (u.kind, u.params) == (kind, params)]
        where = examples[0] if n == 1 else f"{examples[0]} .. {examples[-1]}"
        each = " each" if n > 1 else "     "
        lines.append(f"  {n:>4} x {kind:<36} {params:>15,} params{each}   ({where})")
    m = plan.memory
    largest = plan.largest_unit
    lines.append(f"largest unit gathered: {largest.kind} with {largest.params:,} params")
    t = r.training
    pairs = f" pairs ({t.sequences_per_micro_step()} sequences)" if METHODS[t.method].pairs else ""
    lines.append(f"per-rank memory (GiB), micro batch {t.micro_batch_size}{pairs} x seq_len {r.data.seq_len}:")
    lines.append(f"  params {gib(m.params)}   grads {gib(m.grads)}   optimizer {gib(m.optimizer)}   "
                 f"gathered units {gib(m.gathered)}   activations {gib(m.activations)}   total {gib(m.total)}"
                 + (f"   (+ {gib(m.host)} in CPU memory, offloaded)" if m.host else ""))
    logits = describe_logits(plan.memory_inputs)
    if logits:
        lines.append(f"  activations include the {logits}")
    if gpu_memory:
        verdict = "fits" if m.total <= 0.9 * gpu_memory else "does NOT fit"
        lines.append(f"{verdict} in {gib(gpu_memory)} GiB per GPU (keeping 10% for the CUDA context and "
                     f"fragmentation): {100 * m.total / gpu_memory:.0f}% used")
        if m.total > 0.9 * gpu_memory:
            lines += advice(plan.memory_inputs, 0.9 * gpu_memory)
            lines.append("  try: a smaller micro batch, more GPUs, or CPU offload "
                         "(accelerate_configs/fsdp_2gpu_offload.yaml); `accel-fsdp estimate` compares them")
    cost = reference_cost(r)
    if cost:
        lines.append(f"note: {cost}")
    if plan.memory_inputs.deferred_reduce:
        lines.append(f"note: fsdp.reduce_every_micro_step is false: grads above are the unsharded fp32 gradients of "
                     f"the whole model, held between micro-steps ({gib(m.grads)} GiB per rank)")
    for note in plan.notes:
        if "tokenizer" not in note and "dataset" not in note:
            lines.append(f"note: {note}")
    return "\n".join(lines)


def reference_cost(recipe) -> str | None:
    """What a preference run's reference costs (train/reference.py), for the dry run and `estimate`."""
    spec = METHODS[recipe.training.method]
    if not spec.reference:
        return f"{spec.name} needs no reference model" if spec.pairs else None
    if recipe.model.lora.enabled:
        return (f"{spec.name.upper()} reference: the base model with the LoRA adapters switched off, one more "
                "forward per micro-step (no gradients kept; about +50% compute over LoRA's forward and backward), no "
                "second model in memory")
    return (f"{spec.name.upper()} reference: before the first step, one forward over every training and held-out pair "
            "(about a third of one epoch's compute, in the activations above), cached with the data; no second model "
            "in memory")


def print_plan(recipe, accelerate_config: str | None, gpu_memory: str | None) -> None:

    budget = None
    if gpu_memory:
        budget = gpu_memory_bytes(gpu_memory)
    config, n, _ = load_config_or_default(accelerate_config)
    click.echo(format_plan(build_plan(recipe, config, num_processes=n), budget))
    for note in missing_data_notes(recipe):
        click.echo(f"note: {note}")


def missing_data_notes(recipe) -> list[str]:
    """The local data files a run would stop for: a plan is made for another machine as often as for this one, so
    a missing file is said, not refused (`recipe validate` and the run itself refuse it)."""
    notes = []
    for i, source in enumerate(recipe.data.resolved_sources()):
        found = locate(recipe, source, source_key(recipe, i))
        if found.kind == "file" and not Path(found.path).exists():
            notes.append(f"{recipe.where(source_key(recipe, i))}: {found.path} is not on this machine; a run here "
                         "would stop before launch (`accel-fsdp recipe validate` checks the data)")
    return notes
