"""`accel-fsdp estimate`: per-rank memory of every sharding strategy for a model, recipe or parameter count, which
fit, and the cheapest that fits. The arithmetic is in memory.py; this module picks the inputs and the words."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from accel_fsdp.config import precision
from accel_fsdp.config.accelerate import FULL_SHARD, HYBRID_SHARD, NO_SHARD, SHARD_GRAD_OP, load_accelerate_config
from accel_fsdp.config.methods import METHODS
from accel_fsdp.config.recipe import load_recipe
from accel_fsdp.config.shipped import display, resolve_recipe, shipped_recipes
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.model import architectures
from accel_fsdp.model.checks import model_folder_problems, raise_problems
from accel_fsdp.model.facts import Shape, facts_for, facts_from_values, facts_of
from accel_fsdp.model.quantize import QuantizedTerms, quantized_terms
from accel_fsdp.planning.knob_advice import advice, recipe_settings
from accel_fsdp.planning.memory import (
    MemoryBreakdown,
    MemoryInputs,
    compute_bytes,
    describe_logits,
    estimate,
    gib,
    simple_bytes,
)
from accel_fsdp.planning.plan import build_plan, reference_cost
from accel_fsdp.preflight import model_view

HEADROOM = 0.9  # keep 10% of the GPU for the CUDA context, NCCL buffers and allocator fragmentation


@dataclass
class Target:
    name: str
    params: int
    trainable: int
    largest_unit: int
    shape: Shape | None
    micro_batch: int
    seq_len: int
    frozen_in_compute: bool = False
    """LoRA: the frozen base is kept in the compute dtype of the precision estimated (--precision), not fp32."""
    note: str = ""
    activation_checkpointing: bool = False
    """The recipe's setting (a model or a count: off unless asked for)."""
    context: int | None = None
    """The model's context length, when known."""
    activation_offload: bool = False
    """training.activation_offload (a model or a count: off)."""
    fp8: bool = False
    """training.mixed_precision: fp8."""
    chunked_loss: bool = True
    """training.chunked_loss (a model or a count: the default, on)."""
    loss_chunk_tokens: int | None = None
    pairs: bool = False
    """A preference method: its plain path counts the pairs' log-softmax."""
    quantized: QuantizedTerms | None = None
    """model.quantize: the 4-bit base's terms (planning/memory.py)."""


QUANTIZED_NOTE = ("QLoRA: decoder-block projections in NF4 (0.5 byte a weight plus scales), the rest of the base in "
                  "the compute dtype, one 4-bit weight dequantized in flight")


MAX_PARAMS = 10**15
"""The largest count `estimate` plans (1,000T, about 500 times today's largest models): past it a count is a typo,
and past 2**53 a float count (1e30) would print digits nobody typed."""


def parse_count(text: str) -> float | None:
    """'104960000', '104,960,000', '1.5B', '7 B', '175e9', '350M' -> a parameter count, else None; inf for a count
    too large for a float (1e400). A comma only groups thousands: '1,5B' (a decimal comma) is not a count, where
    dropping it would read 15B. Range checks are `resolve_target`'s."""
    t = text.strip()
    if "," in t:
        if not re.fullmatch(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?\s*[KMBT]?", t, re.I | re.ASCII):
            return None
        t = t.replace(",", "")
    t = t.replace("_", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMBT])?", t, re.I | re.ASCII)
    if m:
        scale = {None: 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}[m.group(2).upper() if m.group(2) else None]
        whole, _, fraction = m.group(1).partition(".")
        return int(whole) * scale + round(float("0." + (fraction or "0")) * scale)  # exact for long digit strings
    try:
        value = float(t)
    except ValueError:
        return None
    if value != value:
        return None  # nan is not a count (it may be a folder's name)
    return value if value == float("inf") else int(value)


def resolve_target(what: str, micro_batch: int | None, seq_len: int | None) -> Target:
    if not what.strip():
        raise UserError(Problem("MODEL|RECIPE|PARAM_COUNT", "is empty",
                                "give e.g. 7B or 104960000, a model name (gpt2-xl) or a recipe"))
    count = parse_count(what)
    if count is not None and count > MAX_PARAMS:
        raise UserError(Problem(what, f"is more parameters than estimate plans (at most {MAX_PARAMS // 10**12:,}T)",
                                "check the count's unit: 7B is 7 billion, 7000M the same"))
    count = None if count is None else int(count)
    if count is None and "," in what and re.fullmatch(r"[\d.,_]+[KMBT]?", what.strip(), re.I | re.ASCII):
        raise UserError(Problem(what, "is not a parameter count: a comma only groups thousands (104,960,000)",
                                "write a fraction with a point, e.g. 1.5B"))
    if count is not None and count < 1:
        raise UserError(Problem(what, "is not a parameter count: it must be at least 1",
                                "give e.g. 7B or 104960000, a model name (gpt2-xl) or a recipe"))
    if count is not None:
        return Target(what.strip(), count, count, 0, None, micro_batch or 0, seq_len or 0,  # as typed: 7B, 1.5e9
                      note="a bare parameter count: no activations or gathered units unless a model is named")
    arch = architectures.lookup(what)
    if arch is not None:
        facts = facts_of(arch)
        unit = max(facts.block_params(), facts.vocab * facts.hidden)
        same_name = arch.name in shipped_recipes()  # gpt2-xl, llama-3.1-8b: a model and a recipe of one name
        note = (f"the model {arch.name}, full fine-tune; the shipped recipe of that name, with its batch, sequence "
                f"length and settings: accel-fsdp estimate {display(resolve_recipe(arch.name))}" if same_name else "")
        return Target(arch.name, facts.params(), facts.params(), unit, facts.shape(),
                      1 if micro_batch is None else micro_batch,
                      min(arch.context, 2048) if seq_len is None else seq_len, note=note, context=arch.context)

    if what in shipped_recipes() or what.endswith((".yaml", ".yml")):
        return _recipe_target(resolve_recipe(what), micro_batch, seq_len)
    if Path(what).expanduser().is_dir():
        return _folder_target(what, micro_batch, seq_len)
    known = ", ".join(architectures.KNOWN)
    raise UserError(Problem(what, "is not a parameter count, a known model or a recipe",
                            f"give e.g. 7B or 104960000, one of {known}, or a recipe name or .yaml path"))


def _folder_target(what: str, micro_batch, seq_len) -> Target:
    """A local model folder, read as `recipe validate` reads it (model/checks.py `model_folder_problems`): a GPT-2 or
    Llama config is arithmetic; another model type needs a recipe (its model is built to be measured)."""
    import json

    folder = Path(what).expanduser()
    raise_problems(model_folder_problems(what, folder))
    values = json.loads((folder / "config.json").read_text())
    facts = facts_from_values(values["model_type"], values)
    if facts is None:
        raise UserError(Problem(what, f"estimate reads GPT-2 and Llama model folders by their config.json, and this "
                                f"one is {values['model_type']!r}", "write a recipe with model.name_or_path: "
                                f"{what} and give it to estimate (its model is built on the meta device)"))
    context = facts.context
    return Target(f"{folder.name} ({values['model_type']})", facts.params(), facts.params(),
                  max(facts.block_params(), facts.vocab * facts.hidden), facts.shape(),
                  1 if micro_batch is None else micro_batch, min(context, 2048) if seq_len is None else seq_len,
                  context=context)


def _recipe_target(path, micro_batch, seq_len) -> Target:

    recipe = load_recipe(path)
    recipe.source = display(path)
    facts = facts_for(recipe)
    if facts is not None:  # checked as `recipe validate` checks the model: shapes that cannot build are named
        model_view(recipe)
    t = recipe.training
    if micro_batch is not None:  # --micro-batch counts what the recipe's micro batch counts (pairs, for preference)
        t = replace(t, micro_batch_size=micro_batch)
    notes = [n for n in (QUANTIZED_NOTE if recipe.model.quantize else
                         "LoRA: frozen base weights in the compute dtype" if recipe.model.lora.enabled else "",
                         f"{t.method}: 2 sequences per pair, micro batch {t.micro_batch_size} pairs"
                         if METHODS[t.method].pairs else "", reference_cost(recipe) or "") if n]
    knobs = recipe_settings(recipe, recipe.training.mixed_precision or precision.DEFAULT)
    if facts is not None:  # arithmetic: no model built (tests/test_model_facts.py holds the facts)
        lora = recipe.model.lora
        adapters = facts.lora_params(lora.target_modules, lora.r) if lora.enabled else 0
        params = facts.params() + adapters
        compute = precision.BYTES[recipe.training.mixed_precision or precision.DEFAULT]
        return Target(recipe.name, params, adapters if lora.enabled else params,
                      max(facts.block_params(), facts.vocab * facts.hidden), facts.shape(),
                      t.sequences_per_micro_step(), recipe.data.seq_len if seq_len is None else seq_len,
                      lora.enabled, note="; ".join(notes),
                      activation_checkpointing=bool(recipe.model.activation_checkpointing), context=facts.context,
                      quantized=quantized_terms(facts, compute) if recipe.model.quantize else None,
                      **knobs)

    plan = build_plan(recipe, load_accelerate_config("fsdp_1gpu"))
    m = plan.memory_inputs
    return Target(recipe.name, m.params, m.trainable, m.largest_unit, m.shape, t.sequences_per_micro_step(),
                  m.seq_len if seq_len is None else seq_len, recipe.model.lora.enabled, note="; ".join(notes),
                  activation_checkpointing=m.activation_checkpointing, quantized=m.quantized, **knobs)


@dataclass
class Row:
    strategy: str
    offload: bool
    memory: MemoryBreakdown
    fits: bool | None
    """None: nothing the GPU would hold is known (a bare count under CPU offload keeps only gathered units and
    activations on it, and a count has neither), so no verdict."""
    inputs: MemoryInputs | None = None
    """What the row was estimated from (for the knobs' advice)."""

    @property
    def label(self) -> str:
        return self.strategy + (" + offload" if self.offload else "")


def table(target: Target, *, gpus: int, nodes: int, precision: str, activation_checkpointing: bool,
          strategies: list[str], offload: bool | None, gpu_memory: float, deferred_reduce: bool = False) -> list[Row]:
    world = gpus * nodes
    base = inputs_of(target, world=world, precision=precision, activation_checkpointing=activation_checkpointing,
                     deferred_reduce=deferred_reduce)
    rows = []
    for strategy in strategies:
        if strategy == HYBRID_SHARD and nodes == 1:
            continue
        if strategy == NO_SHARD and target.frozen_in_compute:
            continue  # NO_SHARD is FSDP1's, and a LoRA base under FSDP1 is refused (config/settings.py)
        group = gpus if strategy == HYBRID_SHARD else (1 if strategy == NO_SHARD else world)
        for off in ((False, True) if offload is None else (offload,)):
            if off and strategy == NO_SHARD:
                continue
            inputs = replace(base, strategy=strategy, shard_group=group, offload=off)
            mem = estimate(inputs)
            fits = None if mem.total == 0 else mem.total <= HEADROOM * gpu_memory
            rows.append(Row(strategy, off, mem, fits, inputs))
    if not rows:
        asked = ", ".join(strategies) + (" with --offload" if offload else "")
        why = ("NO_SHARD needs FSDP1, which a LoRA recipe cannot use" if target.frozen_in_compute
               and NO_SHARD in strategies else "NO_SHARD has no CPU offload setting here")
        raise UserError(Problem("--strategy", f"{asked} leaves nothing to estimate: {why}",
                                "add --strategy FULL_SHARD (or drop --strategy and --offload for every setting)"))
    return rows


def inputs_of(target: Target, *, world: int, precision: str, activation_checkpointing: bool,
              deferred_reduce: bool = False) -> MemoryInputs:
    """The memory formulas' inputs for a target on `world` ranks (the strategy's own fields are set per row)."""
    return MemoryInputs(params=target.params, trainable=target.trainable, largest_unit=target.largest_unit,
                        world=world, shard_group=world, precision=precision,
                        activation_checkpointing=activation_checkpointing, micro_batch=target.micro_batch,
                        seq_len=target.seq_len, shape=target.shape,
                        frozen_bytes=compute_bytes(precision) if target.frozen_in_compute else 4,
                        deferred_reduce=deferred_reduce, quantized=target.quantized, chunked_loss=target.chunked_loss,
                        loss_chunk_tokens=target.loss_chunk_tokens, pairs=target.pairs,
                        activation_offload=target.activation_offload, fp8=target.fp8)


# Least communication first: DDP-like NO_SHARD (one all-reduce of the gradients), SHARD_GRAD_OP (the same
# volume, split into reduce-scatter + all-gather), HYBRID_SHARD (ZeRO-3 traffic inside a node only), FULL_SHARD
# (an extra all-gather in the backward, across all ranks). Offload comes last: every step crosses PCIe.
PREFERENCE = (NO_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, FULL_SHARD)


def cheapest(rows: list[Row]) -> Row | None:
    fitting = [r for r in rows if r.fits]
    return min(fitting, key=lambda r: (r.offload, PREFERENCE.index(r.strategy)), default=None)


def config_for(row: Row, gpus: int, nodes: int) -> str:
    """The shipped accelerate config (and the override) that gives this setting."""
    if row.strategy == NO_SHARD:  # FSDP1's (FSDP2 always shards; on one GPU it gathers as FULL_SHARD does)
        machines = f"num_machines: {nodes}, " if nodes > 1 else ""  # every rank of every node, as `extra` counts
        return (f"accelerate_configs/fsdp1_2gpu.yaml with fsdp_sharding_strategy: NO_SHARD ({machines}num_processes: "
                f"{gpus * nodes})")
    if gpus * nodes == 1:
        base, extra = "fsdp_1gpu.yaml", ""
    elif nodes > 1:
        base = "fsdp_hybrid_multinode.yaml" if row.strategy == HYBRID_SHARD else "fsdp_multinode.yaml"
        extra = f" (num_machines: {nodes}, num_processes: {gpus * nodes})"
    elif row.offload:
        base, extra = "fsdp_2gpu_offload.yaml", "" if gpus == 2 else f" (num_processes: {gpus})"
    else:
        base = {1: "fsdp_1gpu.yaml", 2: "fsdp_2gpu.yaml", 8: "fsdp_8gpu.yaml"}.get(gpus, "fsdp_8gpu.yaml")
        extra = "" if gpus in (1, 2, 8) else f" (num_processes: {gpus})"
    if row.strategy == SHARD_GRAD_OP:
        extra += " + --set fsdp.sharding_strategy=SHARD_GRAD_OP"
    if row.offload and (nodes > 1 or gpus == 1):  # configs without offload of their own
        extra += " + --set fsdp.cpu_offload=true"
    return f"accelerate_configs/{base}{extra}"


def format_report(target: Target, rows: list[Row], *, gpus: int, nodes: int, precision: str, gpu_memory: float,
                  activation_checkpointing: bool, deferred_reduce: bool = False) -> str:
    world = gpus * nodes
    lines = [f"estimate: {target.name}: {target.params:,} parameters ({target.trainable:,} trainable) on {nodes} "
             f"node(s) x {gpus} GPU(s), {precision}"
             + (f", micro batch {target.micro_batch} x {target.seq_len} tokens" if target.micro_batch else "")
             + (", activation checkpointing" if activation_checkpointing else "")
             + (", gradient reduction deferred to the last micro-step (unsharded fp32 gradients held)"
                if deferred_reduce else "")]
    if target.note:
        lines.append(f"  ({target.note})")
    logits = describe_logits(inputs_of(target, world=world, precision=precision,
                                       activation_checkpointing=activation_checkpointing))
    if logits:
        lines.append(f"  (activations include the {logits})")
    one, each = simple_bytes(target.params, 1, False), simple_bytes(target.params, world, True)
    full = "a full fine-tune of every parameter, " if target.trainable < target.params else ""  # LoRA, QLoRA
    lines.append(f"{full}fp32 AdamW at 16 bytes/parameter: {one:,.2f} GiB on 1 GPU; "
                 f"{each:,.2f} GiB per GPU with FSDP on {world}")
    head = (f"{'strategy':<24}{'params':>9}{'grads':>9}{'optim':>9}{'gathered':>10}{'activ.':>9}{'GPU total':>11}"
            f"{'CPU':>9}  fits {gib(gpu_memory)} GiB")
    lines += ["per-rank memory in GiB:", head, "-" * len(head)]
    for r in rows:
        m = r.memory
        lines.append(f"{r.label:<24}{gib(m.params):>9}{gib(m.grads):>9}{gib(m.optimizer):>9}{gib(m.gathered):>10}"
                     f"{gib(m.activations):>9}{gib(m.total):>11}{gib(m.host):>9}  "
                     f"{'?' if r.fits is None else 'yes' if r.fits else 'no'}")
    if any(r.fits is None for r in rows):
        lines.append("?: with CPU offload the GPU keeps only the gathered units and the activations, which a bare "
                     "count does not give: name a model or recipe for these rows")
    best = cheapest(rows)
    if best is None:
        lines.append("nothing fits: add GPUs or nodes, lower micro batch or seq_len, or use LoRA")
        sharded = [r for r in rows if not r.offload and r.strategy == FULL_SHARD] or rows
        if sharded and sharded[0].inputs is not None:
            lines += advice(sharded[0].inputs, HEADROOM * gpu_memory)
    else:
        lines.append(f"cheapest that fits (least communication first): {best.label}, "
                     f"{gib(best.memory.total)} GiB per GPU -> {config_for(best, gpus, nodes)}")
    return "\n".join(lines)
