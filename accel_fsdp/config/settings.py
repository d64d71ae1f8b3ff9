"""The effective FSDP settings of a run, each with where it came from, and the checks of recipe x hardware.

`resolve_settings` combines the accelerate config (config/accelerate.py: the file, or what `accelerate launch`
exported), the recipe (which may override the few settings that depend on the model: wrap class, state-dict type,
activation checkpointing, precision), `--set`, detection and defaults; the first that says something wins.
The result, `FsdpSettings`, records for every setting its value and its `Source` (a kind plus a detail), is
printed at the start of a run and saved in the run folder. `check_settings` reports what neither file shows
alone (the batch arithmetic against the rank count, fp16 on CPU, a hybrid mesh that does not fit).

This module decides; it must not build models, import torch or touch torch.distributed.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from dataclasses import dataclass, field
from typing import Any

from accel_fsdp import hardware
from accel_fsdp.config import precision
from accel_fsdp.config.accelerate import (
    FULL_SHARD,
    HYBRID_SHARD,
    NO_SHARD,
    SHARD_GRAD_OP,
    AccelerateConfig,
    as_bool,
    as_int,
    fsdp1_strategy,
)
from accel_fsdp.errors import Problem, read_json_object

MODEL_DEFAULT = "<model default>"
"""wrap_classes before the model is known: its own _no_split_modules."""


class Source(enum.Enum):
    """What decided a setting's value; `Setting.detail` says which file, or what was seen or derived."""

    ACCELERATE_CONFIG = "accelerate_config"
    """The accelerate config: the file, or the environment `accelerate launch` exported (detail: which, as shown,
    with the part of it that decided, e.g. `(use_cpu)`)."""
    RECIPE = "recipe"
    """The recipe file (detail: the file)."""
    OVERRIDE = "override"
    """`--set` on the command line."""
    TARGET_HARDWARE = "target_hardware"
    """The hardware the accelerate config is written for, not this machine (detail: why they differ)."""
    DETECTED = "detected"
    """This machine, this launch or the model (detail: what was seen)."""
    DERIVED = "derived"
    """Computed from other settings (detail: how)."""
    DEFAULT = "default"
    """Nothing said otherwise."""

    @property
    def in_recipe(self) -> bool:
        """The user set it in the recipe (or with --set): messages then name the recipe's key."""
        return self in (Source.RECIPE, Source.OVERRIDE)


@dataclass
class Setting:
    value: Any
    source: Source
    detail: str = ""

    @property
    def source_text(self) -> str:
        """The source as printed and saved: `recipe recipes/x.yaml`, `--set`, `detected: no CUDA device`."""
        if self.source == Source.ACCELERATE_CONFIG:
            return self.detail
        if self.source == Source.RECIPE:
            return f"recipe {self.detail}"
        if self.source == Source.OVERRIDE:
            return "--set"
        if self.source == Source.TARGET_HARDWARE:
            return f"the config's target hardware ({self.detail})"
        return f"{self.source.value}: {self.detail}" if self.detail else self.source.value

    def where(self, recipe, key: str, config_key: str | None = None) -> str:
        """Where to change it, named by the key the user wrote there: the recipe's `key`, or the config's."""
        if self.source.in_recipe:
            return recipe.where(key)
        return f"{self.source_text}: {config_key or key}"

    def __str__(self) -> str:
        v = ", ".join(self.value) if isinstance(self.value, (list, tuple)) else self.value
        return f"{v}  ({self.source_text})"

    def to_dict(self) -> dict[str, Any]:
        """As fsdp_settings.json holds it."""
        return {"value": self.value, "source": self.source_text, "source_kind": self.source.value}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> Setting:
        """The setting `to_dict` saved (its detail recovered from the source text, which it prefixes)."""
        source = Source(saved.get("source_kind", Source.DEFAULT.value))
        text = str(saved.get("source", ""))
        if source == Source.ACCELERATE_CONFIG:
            detail = text
        elif source == Source.RECIPE:
            detail = text.removeprefix("recipe ")
        elif source == Source.OVERRIDE:
            detail = ""
        elif source == Source.TARGET_HARDWARE:
            detail = text.removeprefix("the config's target hardware (").removesuffix(")")
        else:
            detail = text.removeprefix(f"{source.value}: ") if text != source.value else ""
        return cls(saved.get("value"), source, detail)


@dataclass
class FsdpSettings:
    """Effective distributed settings of a run, each with its source."""

    device: Setting
    num_processes: Setting
    num_machines: Setting
    fsdp_version: Setting
    sharding_strategy: Setting
    wrap_policy: Setting
    wrap_classes: Setting
    min_num_params: Setting
    """Smallest module that becomes its own unit under SIZE_BASED_WRAP."""
    cpu_offload: Setting
    state_dict_type: Setting
    activation_checkpointing: Setting
    mixed_precision: Setting
    cpu_ram_efficient_loading: Setting
    dp_replicate_size: Setting
    dp_shard_size: Setting
    reduce_every_micro_step: Setting
    """Reduce-scatter gradients after every micro-step (each rank holds only its gradient shard)."""
    collective_timeout_minutes: Setting
    """Timeout of every collective, passed to the process group with its backend."""
    fsdp1_options: Setting = field(default_factory=lambda: Setting({}, Source.DEFAULT))
    """backward_prefetch, forward_prefetch, limit_all_gathers, use_orig_params, sync_module_states (FSDP1)."""

    def rows(self) -> list[tuple[str, Setting]]:
        rows = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        if self.fsdp_version.value == 2:
            rows = [r for r in rows if r[0] != "fsdp1_options"]
        if self.wrap_policy.value != "SIZE_BASED_WRAP":
            rows = [r for r in rows if r[0] != "min_num_params"]
        return rows

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: s.to_dict() for name, s in self.rows()}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> FsdpSettings:
        """The settings `to_dict` saved (a run's fsdp_settings.json); one it leaves out (fsdp1_options under FSDP2,
        min_num_params without size-based wrapping) is None, by default."""
        return cls(**{f.name: Setting.from_dict(saved[f.name]) if isinstance(saved.get(f.name), dict)
                      else Setting(None, Source.DEFAULT) for f in dataclasses.fields(cls)})

    @classmethod
    def read(cls, path) -> FsdpSettings:
        """A run's fsdp_settings.json; a damaged one is one UserError naming it."""
        return cls.from_dict(read_json_object(path, what="is unreadable or corrupt",
                                              fix="run again to write it (it is written at the start of a run)"))

    def format(self, indent: int = 2) -> str:
        width = max(len(n) for n, _ in self.rows())
        return "\n".join(f"{'':<{indent}}{n:<{width}}  {s}" for n, s in self.rows())


def resolve_settings(recipe, config: AccelerateConfig, *, cuda_available: bool, num_processes: int | None = None,
                     num_machines: int | None = None) -> FsdpSettings:
    """Combine recipe, accelerate config, detection and defaults; the first that says something wins.

    `num_processes` / `num_machines` are what the launch really has (inside a rank: WORLD_SIZE; for the CLI
    without a config: the local GPUs); they win over the config's numbers. With no wrap class named anywhere,
    `wrap_classes` is left as MODEL_DEFAULT until `detect_wrap_classes` sees the model.

    Long: one table, a setting a few lines, in FsdpSettings' order, each by the same precedence (`pick`); the few
    that depend on others (the shard sizes on the strategy, the precision and FSDP1 options on the device) follow
    them, so the whole precedence reads top to bottom in one place.
    """
    cfg = config.label

    def from_recipe(key: str, value) -> Setting:
        if recipe.is_overridden(key):
            return Setting(value, Source.OVERRIDE)
        return Setting(value, Source.RECIPE, recipe.source or recipe.name)

    def from_config(value, detail: str = cfg) -> Setting:
        return Setting(value, Source.ACCELERATE_CONFIG, detail)

    def recipe_or_default(key: str, value) -> Setting:
        """Settings only the recipe has: from the recipe when it (or --set) wrote the key, else its default."""
        return (from_recipe(key, value) if recipe.is_overridden(key) or key in recipe.lines else
                Setting(value, Source.DEFAULT))

    def pick(recipe_key: str | None, recipe_value, config_key: str | None, convert, default) -> Setting:
        if recipe_key and recipe_value is not None:
            return from_recipe(recipe_key, recipe_value)
        if config_key and config_key in config.values and config.values[config_key] is not None:
            return from_config(convert(config.values[config_key]))
        return Setting(default, Source.DEFAULT)

    if config.uses_cpu():
        device = from_config("cpu", f"{cfg} (use_cpu)")
    elif cuda_available:
        device = Setting("cuda", Source.DETECTED)
    else:
        device = Setting("cpu", Source.DETECTED, "no CUDA device")
    nproc = pick(None, None, "num_processes", lambda v: as_int(v) or 1, 1)
    if num_processes is not None and num_processes != nproc.value:
        nproc = Setting(num_processes, Source.DETECTED, "the launch's WORLD_SIZE" if "WORLD_SIZE" in os.environ
                        else "local GPUs")
    nmach = pick(None, None, "num_machines", lambda v: as_int(v) or 1, 1)
    if num_machines is not None and num_machines != nmach.value:
        nmach = Setting(num_machines, Source.DETECTED, "the launch's WORLD_SIZE / LOCAL_WORLD_SIZE")
    version = pick(None, None, "fsdp_version", int, 1 if config.values else 2)

    # Sharding strategy: FSDP1 names it; FSDP2 says reshard_after_forward (true = FULL_SHARD, false = SHARD_GRAD_OP)
    # and gets HYBRID_SHARD from the parallelism config's replicate x shard mesh.
    rep = as_int(config.get("parallelism_config_dp_replicate_size") or 1)
    if version.value == 1:
        strategy = pick(None, None, "fsdp_sharding_strategy", fsdp1_strategy, FULL_SHARD)
    elif rep and rep > 1:
        strategy = from_config(HYBRID_SHARD, f"{cfg} (parallelism_config)")
    else:
        strategy = pick(None, None, "fsdp_reshard_after_forward",
                        lambda v: FULL_SHARD if as_bool(v) in (True, None) else SHARD_GRAD_OP, FULL_SHARD)
    if recipe.fsdp.sharding_strategy is not None:
        strategy = from_recipe("fsdp.sharding_strategy", recipe.fsdp.sharding_strategy)
    n = nproc.value
    if version.value == 1 and n == 1 and strategy.value != NO_SHARD:
        # FSDP1 runs every strategy on one rank as NO_SHARD, and warns that it switched (torch/distributed/fsdp/
        # _init_utils.py, _init_core_state; torch 2.13.0): named here, so that the start summary says what runs.
        strategy = Setting(NO_SHARD, Source.DERIVED, f"{strategy.value} on one rank: FSDP1 holds whole parameters")
    if strategy.value == HYBRID_SHARD:
        if rep and rep > 1 and strategy.source == Source.ACCELERATE_CONFIG:
            dp_rep = from_config(rep, f"{cfg} (parallelism_config)")
            dp_shard = from_config(as_int(config.get("parallelism_config_dp_shard_size") or 1),
                                   f"{cfg} (parallelism_config)")
        else:
            machines = nmach.value
            dp_rep = Setting(machines, Source.DERIVED, "one replica per machine")
            dp_shard = Setting(n // machines, Source.DERIVED, "shard within a machine")
    elif strategy.value == NO_SHARD:
        dp_rep, dp_shard = Setting(n, Source.DERIVED, "every rank holds everything"), Setting(1, Source.DERIVED)
    else:
        dp_rep, dp_shard = Setting(1, Source.DERIVED), Setting(n, Source.DERIVED, "shard over all ranks")

    policy = pick(None, None, "fsdp_auto_wrap_policy", lambda v: str(v).upper(), "TRANSFORMER_BASED_WRAP")
    if recipe.fsdp.wrap_class:
        classes = from_recipe("fsdp.wrap_class", _split(recipe.fsdp.wrap_class))
        policy = from_recipe("fsdp.wrap_class", "TRANSFORMER_BASED_WRAP")
    elif policy.value == "TRANSFORMER_BASED_WRAP" and config.get("fsdp_transformer_layer_cls_to_wrap"):
        classes = from_config(_split(config.get("fsdp_transformer_layer_cls_to_wrap")))
    elif policy.value == "TRANSFORMER_BASED_WRAP":
        classes = Setting([MODEL_DEFAULT], Source.DEFAULT, "the model's _no_split_modules")
    else:
        classes = from_config([], f"{cfg} ({policy.value})")

    min_params = pick(None, None, "fsdp_min_num_params", lambda v: as_int(v) or 100_000_000, 100_000_000)
    offload = pick("fsdp.cpu_offload", recipe.fsdp.cpu_offload, "fsdp_offload_params", as_bool, False)
    sdt = pick("checkpoint.state_dict_type", recipe.checkpoint.state_dict_type, "fsdp_state_dict_type",
               lambda v: str(v).upper(), "SHARDED_STATE_DICT")
    ac = pick("model.activation_checkpointing", recipe.model.activation_checkpointing,
              "fsdp_activation_checkpointing", as_bool, False)
    mp = pick("training.mixed_precision", recipe.training.mixed_precision, "mixed_precision",
              lambda v: precision.FROM_ACCELERATE.get(str(v), str(v)), precision.DEFAULT)
    if device.value == "cpu" and mp.value == "bf16" and not mp.source.in_recipe:
        native, cpu_name = hardware.cpu_bf16()
        if not native:
            mp = Setting("fp32", Source.DETECTED, f"{cpu_name} has no native bf16 matrix units (AVX512-BF16, AMX or "
                         "Arm BF16), where bf16 is emulated and about 4x slower; set training.mixed_precision: bf16 to "
                         "have it anyway")
    ram = pick(None, None, "fsdp_cpu_ram_efficient_loading", as_bool, False)
    reduce_each = recipe_or_default("fsdp.reduce_every_micro_step", recipe.fsdp.reduce_every_micro_step)
    timeout = recipe_or_default("fsdp.collective_timeout_minutes", recipe.fsdp.collective_timeout_minutes)

    fsdp1 = {}
    fsdp1_detail = cfg
    if version.value == 1:
        bp = config.get("fsdp_backward_prefetch")
        fsdp1 = {
            "backward_prefetch": str(bp).upper() if bp else "NO_PREFETCH",
            "forward_prefetch": bool(as_bool(config.get("fsdp_forward_prefetch", False))),
            "limit_all_gathers": bool(as_bool(config.get("fsdp_limit_all_gathers", True))),
            "use_orig_params": bool(as_bool(config.get("fsdp_use_orig_params", True))),
            "sync_module_states": bool(as_bool(config.get("fsdp_sync_module_states", False))),
        }
        if device.value == "cpu" and (fsdp1["sync_module_states"] or ram.value):
            # Accelerate's FSDP1 plugin looks for a GPU to broadcast from; on CPU every rank loads the weights.
            fsdp1["sync_module_states"] = False
            ram = from_config(False, f"{cfg}; off on CPU (Accelerate's FSDP1 broadcast needs a GPU)")
            fsdp1_detail = f"{cfg}; sync_module_states off on CPU"
    return FsdpSettings(
        device=device, num_processes=nproc, num_machines=nmach, fsdp_version=version, sharding_strategy=strategy,
        wrap_policy=policy, wrap_classes=classes, min_num_params=min_params, cpu_offload=offload, state_dict_type=sdt,
        activation_checkpointing=ac, mixed_precision=mp, cpu_ram_efficient_loading=ram,
        dp_replicate_size=dp_rep, dp_shard_size=dp_shard, reduce_every_micro_step=reduce_each,
        collective_timeout_minutes=timeout,
        fsdp1_options=from_config(fsdp1, fsdp1_detail) if fsdp1 else Setting(fsdp1, Source.DEFAULT),
    )


def batch_problem(where: str, training, ranks: list[int], ranks_name: str) -> Problem | None:
    """The batch arithmetic (`TrainingConfig.accumulation_steps`) must come out whole on these ranks.
    `ranks` are the factors of the rank count as the user sees them ([2] processes, or [nodes, gpus])."""
    world = math.prod(ranks)
    if training.splits_evenly(world):
        return None
    global_batch, per_step = training.global_batch_size, training.rows_per_micro_step(world)
    down = training.accumulation_steps(world) * per_step
    examples = " or ".join(str(x) for x in (down, down + per_step) if x > 0)
    factors = " x ".join(str(r) for r in [training.micro_batch_size, *ranks])
    return Problem(where, f"{global_batch} is not divisible by micro_batch_size x {ranks_name} = {factors} = "
                   f"{per_step}, so gradient accumulation steps would not be a whole number",
                   f"use a multiple of {per_step} (e.g. {examples}), or change training.micro_batch_size")


def detect_wrap_classes(settings: FsdpSettings, no_split_modules: list[str]) -> None:
    """Fill in the model's own block classes where nothing named a wrap class."""
    if settings.wrap_classes.value == [MODEL_DEFAULT]:
        settings.wrap_classes = Setting(sorted(no_split_modules), Source.DETECTED, "model._no_split_modules")


def shard_group_size(settings: FsdpSettings) -> int:
    """Into how many pieces each rank's parameters are cut: the ranks of a shard group."""
    strategy = settings.sharding_strategy.value
    if strategy == NO_SHARD:
        return 1
    if strategy == HYBRID_SHARD:
        return settings.dp_shard_size.value
    return settings.num_processes.value


def check_settings(settings: FsdpSettings, recipe, *, visible_gpus: int | None = None) -> list[Problem]:
    """Problems of the combination (recipe x hardware) that neither file shows alone.

    `visible_gpus`: the GPUs this machine shows (CUDA_VISIBLE_DEVICES applied), when the run is about to start
    here; None when judging a config for other hardware (`recipe validate` on a laptop). (Long: a list of
    independent checks, each a few lines.)"""
    p: list[Problem] = []
    s = settings
    n, machines = s.num_processes.value, s.num_machines.value
    t = recipe.training
    batch = batch_problem(recipe.where("training.global_batch_size"), t, [n], "processes")
    if batch:
        p.append(batch)
    if s.mixed_precision.value == "fp16" and s.device.value == "cpu":
        p.append(Problem(s.mixed_precision.where(recipe, "training.mixed_precision", "mixed_precision"),
                         "fp16 needs a GPU (its grad scaler does not run on CPU)",
                         "use bf16 (same memory, no scaler) or fp32"))
    if s.mixed_precision.value not in precision.TRAINING:
        p.append(Problem(s.mixed_precision.where(recipe, "training.mixed_precision", "mixed_precision"),
                         f"{s.mixed_precision.value!r} is not supported", "use bf16, fp32, fp16 or fp8"))
    strategy = s.sharding_strategy.value
    if strategy == HYBRID_SHARD:
        if s.dp_replicate_size.value * s.dp_shard_size.value != n:
            p.append(Problem(s.sharding_strategy.where(recipe, "fsdp.sharding_strategy"),
                             f"hybrid group of {s.dp_shard_size.value} x {s.dp_replicate_size.value} replicas "
                             f"does not match the world size {n}",
                             "make dp_replicate_size x dp_shard_size equal num_processes"))
        if s.dp_shard_size.value > n:
            p.append(Problem(s.sharding_strategy.where(recipe, "fsdp.sharding_strategy"),
                             f"hybrid shard group of {s.dp_shard_size.value} ranks is larger than the world size {n}",
                             f"use a shard group of at most {n} ranks"))
    if strategy == NO_SHARD and s.fsdp_version.value == 2:
        p.append(Problem(s.sharding_strategy.where(recipe, "fsdp.sharding_strategy"),
                         "NO_SHARD is an FSDP1 strategy; FSDP2 has no unsharded mode",
                         "use accelerate_configs/fsdp1_2gpu.yaml with fsdp_sharding_strategy: NO_SHARD, "
                         "or SHARD_GRAD_OP (shards gradients and optimizer state only)"))
    if (strategy == HYBRID_SHARD and s.fsdp_version.value == 1 and n > 1 and machines == 1
            and s.device.value == "cpu"):
        p.append(Problem(s.sharding_strategy.where(recipe, "fsdp.sharding_strategy"),
                         "FSDP1 HYBRID_SHARD needs several machines", "use FSDP2 with a parallelism_config"))
    attn = recipe.model.attn_implementation or ""
    if "flash" in attn and s.device.value == "cpu":
        p.append(Problem(recipe.where("model.attn_implementation"), f"{attn} needs a CUDA GPU, and this run is on CPU",
                         "use sdpa on CPU (packed documents stay apart there too)"))
    elif "flash" in attn and s.mixed_precision.value == "fp32":
        # transformers picks the kernel's dtype from the first nn.Linear of the attention module when the inputs are
        # fp32 (integrations/flash_attention.py, get_target_dtype; 5.24.0): GPT-2 has none (Conv1D) and stops with
        # StopIteration at the first forward; others hand fp32 to flash-attn, which refuses it.
        p.append(Problem(recipe.where("model.attn_implementation"),
                         f"{attn} runs only in fp16 or bf16, and this run computes in fp32 "
                         f"({s.mixed_precision.source_text}): the first forward would fail",
                         "use training.mixed_precision: bf16 (the master weights stay fp32), or "
                         "model.attn_implementation: sdpa"))
    if s.device.value == "cuda" and visible_gpus is not None:
        p += gpu_count_problems(settings, visible_gpus)
    if s.fsdp_version.value == 1 and s.device.value == "cpu" and s.state_dict_type.value == "FULL_STATE_DICT":
        # torch 2.13.0's FSDP1 full state dict on CPU ranks ends rank 0 with SIGSEGV in the first save, cloning a
        # gathered parameter (fsdp/_state_dict_utils.py, _full_post_state_dict_hook's param_hook), offload or not.
        p.append(Problem(s.state_dict_type.where(recipe, "checkpoint.state_dict_type", "fsdp_state_dict_type"),
                         "FSDP1 cannot gather a FULL_STATE_DICT checkpoint on CPU ranks (torch's FSDP1 crashes "
                         "the first save there)", "use SHARDED_STATE_DICT (the exported model is the same; "
                         "`checkpoint consolidate` gathers it), or an FSDP2 config"))
    if (s.fsdp_version.value == 1 and not s.reduce_every_micro_step.value and s.mixed_precision.value != "fp32"
            and t.global_batch_size > t.micro_batch_size * n):
        # Under no_sync FSDP1's post-backward hook returns before it casts to reduce_dtype (torch 2.13.0
        # fsdp/_runtime_utils.py, _post_backward_hook), so autograd adds every micro-step's gradient into the
        # unsharded flat parameter's 16-bit .grad: the step's gradient is summed in bf16, not fp32 as documented
        # (FSDP2 accumulates in reduce_dtype, fp32: _fsdp_param.py, accumulate_unsharded_grad_if_needed).
        p.append(Problem(s.reduce_every_micro_step.where(recipe, "fsdp.reduce_every_micro_step"),
                         f"false under FSDP1 with {s.mixed_precision.value} compute would add the micro-steps' "
                         f"gradients up in {s.mixed_precision.value} (FSDP1 accumulates the unsharded gradient in its "
                         "compute dtype), not in fp32", "keep fsdp.reduce_every_micro_step: true (the default), use "
                         "an FSDP2 config (fsdp_version: 2, which accumulates in fp32), or training.mixed_precision: "
                         "fp32"))
    if s.fsdp_version.value == 1 and recipe.model.quantize:
        # FSDP1 flattens each unit into one tensor of one dtype: it cannot hold torchao's NF4Tensor, whose sharding
        # (fsdp_pre_all_gather / fsdp_post_all_gather) is FSDP2's extension point.
        p.append(Problem(f"{s.fsdp_version.source_text}: fsdp_config.fsdp_version",
                         f"model.quantize: {recipe.model.quantize} shards the 4-bit weights with FSDP2 only (FSDP1 "
                         "flattens every unit into one tensor of one dtype)", "use an FSDP2 config (fsdp_version: 2, "
                         "e.g. fsdp_2gpu.yaml, llama_fsdp_8gpu.yaml, fsdp_multinode.yaml)"))
    elif s.fsdp_version.value == 1 and recipe.model.lora.enabled:
        # FSDP1 flattens each unit into one parameter of one dtype: the frozen base would be upcast to fp32 and
        # get gradients for every element (use_orig_params only hides it), which is what LoRA exists to avoid.
        p.append(Problem(f"{s.fsdp_version.source_text}: fsdp_config.fsdp_version",
                         "LoRA with FSDP1 upcasts the frozen base weights to fp32 and computes gradients for the "
                         "whole flat parameter of each unit", "use an FSDP2 config (fsdp_version: 2, e.g. "
                         "fsdp_2gpu.yaml, llama_fsdp_8gpu.yaml, fsdp_multinode.yaml)"))
    elif s.fsdp_version.value == 1 and not s.fsdp1_options.value.get("use_orig_params"):
        where = settings.fsdp1_options.source_text + ": fsdp_config.fsdp_use_orig_params"
        if t.weight_decay:
            p.append(Problem(where, f"false flattens every weight into one parameter, so weight decay "
                             f"({t.weight_decay}) could not skip biases and norms",
                             "set fsdp_use_orig_params: true, or training.weight_decay: 0"))
    return p


def cuda_problems(settings: FsdpSettings, config, reason, *, cpu_option: bool = True) -> list[Problem]:
    """A config written for GPUs on a machine that cannot run CUDA would train on CPU ranks, a thousand times slower,
    with the word "cpu" in one line as its only sign. `config`: the AccelerateConfig; `reason`: a function saying
    why CUDA is unusable here (it imports torch, so it is called only when needed).

    Only a config read from its file is judged: the settings that stock `accelerate launch` exports to the ranks do
    not say use_cpu (accelerate 1.15, utils/launch.py: ACCELERATE_USE_CPU is set by the simple launcher alone, not
    by `prepare_multi_gpu_env`, which FSDP configs launch through), so there fsdp_cpu.yaml and fsdp_2gpu.yaml look
    the same; `cpu_guess_note` says what the ranks then do. `cpu_option`: the command has `--cpu` (recipe run)."""
    device = settings.device
    if device.value != "cpu" or device.source != Source.DETECTED or config.path is None:
        return []  # CUDA is used, the config (or --cpu) asked for CPU ranks, or no file says what it was written for
    return [Problem(f"{config.label}: use_cpu", f"is a GPU config (use_cpu is false) and this machine cannot run CUDA: "
                    f"{reason()}", "train on CPU ranks with --accelerate-config fsdp_cpu"
                    + (" (or this config with --cpu)" if cpu_option else "") + ", "
                    "or repair CUDA (a torch built for your CUDA version: pip install torch --index-url "
                    "https://download.pytorch.org/whl/cu124, a driver nvidia-smi can see)")]


def cpu_guess_note(settings: FsdpSettings, config, reason) -> str | None:
    """Under stock `accelerate launch` without CUDA the ranks train on CPU, which may or may not be what the config
    meant (see `cuda_problems`): said once, with why, so a broken CUDA install is not a silent thousandfold slowdown."""
    device = settings.device
    if device.value != "cpu" or device.source != Source.DETECTED or config.path is not None:
        return None
    return (f"note: training on CPU ranks: this machine cannot run CUDA ({reason()}), and the {config.label} does "
            "not say whether the config was written for GPUs (Accelerate's launcher does not pass use_cpu on)")


def gpu_count_problems(settings: FsdpSettings, visible_gpus: int) -> list[Problem]:
    """One process per GPU: more processes than visible GPUs put two ranks on one device (NCCL then fails with
    "Duplicate GPU detected" at the first collective); fewer leave GPUs idle, which is allowed but said."""
    per_machine = settings.num_processes.value // max(1, settings.num_machines.value)
    source = settings.num_processes.source_text
    if per_machine > visible_gpus:
        return [Problem(f"{source}: num_processes", f"{per_machine} processes per machine, but this machine shows "
                        f"{visible_gpus} GPU(s) ({hardware.visible_devices_said()})",
                        f"use one process per GPU: num_processes: {visible_gpus * settings.num_machines.value} "
                        f"(or an accelerate config for {visible_gpus} GPU(s)), or make more GPUs visible")]
    return []


def idle_gpu_note(settings: FsdpSettings, visible_gpus: int) -> str | None:
    per_machine = settings.num_processes.value // max(1, settings.num_machines.value)
    if settings.device.value == "cuda" and 0 < per_machine < visible_gpus:
        return (f"{per_machine} process(es) per machine on {visible_gpus} visible GPUs: {visible_gpus - per_machine} "
                f"GPU(s) stay idle (num_processes: {visible_gpus * settings.num_machines.value} would use them all)")
    return None


def _split(v) -> list[str]:
    if isinstance(v, (list, tuple)):
        return [str(x).strip() for x in v if str(x).strip()]
    return [x.strip() for x in str(v).split(",") if x.strip()]
