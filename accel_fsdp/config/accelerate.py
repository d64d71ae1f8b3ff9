"""Accelerate launch configs (hardware) and the effective FSDP settings of a run, each with where it came from.

`accelerate_configs/*.yaml` are plain Accelerate config files: `accelerate launch --config_file` reads them,
and so does this module, to check them before anything launches and to know how many processes to start.
Inside a launched rank the same settings are read back from the file (when the CLI launched itself) or from
the `FSDP_*` variables that `accelerate launch` exported (when the user ran it). The recipe may override the
few settings that depend on the model (wrap class, state-dict type, activation checkpointing, precision).

The result, `FsdpSettings`, records for every setting its value and its source (config file, recipe, --set,
default, detected), is printed at the start of a run and saved in the run folder. This module decides; it
must not build models or touch torch.distributed.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from accel_fsdp.errors import Problem, UserError, raise_if
from accel_fsdp.config.shipped import display, resolve_accelerate_config
from accel_fsdp.config.yaml_file import load_yaml

CONFIG_PATH_ENV = "ACCEL_FSDP_ACCELERATE_CONFIG"
"""Set by the CLI when it launches itself, so each rank reads the same file (and can name it in messages)."""

FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
MODEL_DEFAULT = "<model default>"
"""wrap_classes before the model is known: its own _no_split_modules."""
PRECISION_FROM_ACCELERATE = {"no": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}

# Environment variables `accelerate launch` exports for each fsdp_config key (accelerate/utils/launch.py).
_ENV_OF_KEY = {
    "fsdp_version": "FSDP_VERSION",
    "fsdp_sharding_strategy": "FSDP_SHARDING_STRATEGY",
    "fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_min_num_params": "FSDP_MIN_NUM_PARAMS",
    "fsdp_auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "fsdp_backward_prefetch": "FSDP_BACKWARD_PREFETCH",
    "fsdp_state_dict_type": "FSDP_STATE_DICT_TYPE",
    "fsdp_forward_prefetch": "FSDP_FORWARD_PREFETCH",
    "fsdp_use_orig_params": "FSDP_USE_ORIG_PARAMS",
    "fsdp_cpu_ram_efficient_loading": "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "fsdp_sync_module_states": "FSDP_SYNC_MODULE_STATES",
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
    "parallelism_config_dp_replicate_size": "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
    "parallelism_config_dp_shard_size": "PARALLELISM_CONFIG_DP_SHARD_SIZE",
}


# Keys Accelerate itself accepts in a config file (checked with accelerate 1.15.0; tests/test_launch_config.py
# compares them with accelerate's ClusterConfig fields and `accelerate launch` options, so a drift is caught).
# Kept as data: importing accelerate to ask costs two seconds on every command that reads a config.
TOP_LEVEL_KEYS = frozenset([
    "command_file", "commands", "compute_environment", "debug", "deepspeed_config", "distributed_type",
    "downcast_bf16", "dynamo_config", "enable_cpu_affinity", "fp8_config", "fsdp_config", "gpu_ids", "machine_rank",
    "main_process_ip", "main_process_port", "main_training_function", "megatron_lm_config", "mixed_precision",
    "mpirun_config", "num_machines", "num_processes", "parallelism_config", "rdzv_backend", "same_network",
    "tpu_env", "tpu_name", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_zone", "use_cpu"])
FSDP_KEYS = frozenset([
    "fsdp_activation_checkpointing", "fsdp_activation_checkpointing_offload", "fsdp_auto_wrap_policy",
    "fsdp_backward_prefetch", "fsdp_cpu_offload", "fsdp_cpu_ram_efficient_loading", "fsdp_forward_prefetch",
    "fsdp_fsdp_version", "fsdp_ignored_modules", "fsdp_limit_all_gathers", "fsdp_min_num_params",
    "fsdp_mixed_precision_policy", "fsdp_offload_params", "fsdp_optim_state_dict_config", "fsdp_param_init_fn",
    "fsdp_reshard_after_forward", "fsdp_sharding_strategy", "fsdp_state_dict_config", "fsdp_state_dict_type",
    "fsdp_sync_module_states", "fsdp_transformer_cls_names_to_wrap", "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_use_orig_params", "fsdp_version"])
PARALLELISM_KEYS = frozenset([
    "parallelism_config_cp_backend", "parallelism_config_cp_comm_strategy", "parallelism_config_cp_size",
    "parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size",
    "parallelism_config_sp_attn_implementation", "parallelism_config_sp_backend", "parallelism_config_sp_seq_length",
    "parallelism_config_sp_seq_length_is_variable", "parallelism_config_sp_size", "parallelism_config_tp_size"])


def accelerate_known_keys() -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """The same three sets, asked of the installed accelerate (for the test that keeps the tables true)."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin

    top = frozenset(f.name for f in dataclasses.fields(ClusterConfig))
    dests = [a.dest for a in launch_command_parser()._actions]
    fsdp = {d for d in dests if d.startswith("fsdp_")}
    fsdp |= {"fsdp_" + f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}
    parallel = frozenset(d for d in dests if d.startswith("parallelism_config_"))
    return top, frozenset(fsdp), parallel


@dataclass
class AccelerateConfig:
    """An Accelerate config, flattened: top-level keys plus the fsdp_config and parallelism_config keys."""

    values: dict[str, Any]
    label: str
    """How to name it in messages: the file, or `accelerate launch environment`."""
    path: Path | None = None

    def get(self, key: str, default=None):
        return self.values.get(key, default)

    def where(self, key: str) -> str:
        return f"{self.label}: {key}"


def load_accelerate_config(name_or_path: str | os.PathLike) -> AccelerateConfig:
    """Read and check an Accelerate config file; raise one `UserError` with every problem."""
    path = resolve_accelerate_config(str(name_or_path))
    label = display(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(Problem(label, f"cannot read the accelerate config ({e.__class__.__name__})",
                                "give a readable UTF-8 .yaml file")) from None
    data, _, duplicates = load_yaml(text, label)
    if not isinstance(data, dict):
        raise UserError(Problem(label, "an accelerate config must be a mapping of keys",
                                "start from accelerate_configs/fsdp_1gpu.yaml"))
    top, fsdp_keys, parallel_keys = TOP_LEVEL_KEYS, FSDP_KEYS, PARALLELISM_KEYS
    problems = list(duplicates)
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in top:
            close = difflib.get_close_matches(str(key), sorted(top), n=1)
            problems.append(Problem(f"{label}: {key}", "not an Accelerate config key",
                                    f"did you mean {close[0]}?" if close else "remove it"))
        elif key in ("fsdp_config", "parallelism_config"):
            known = fsdp_keys if key == "fsdp_config" else parallel_keys
            if value is not None and not isinstance(value, dict):
                problems.append(Problem(f"{label}: {key}", f"must be a mapping of keys, found {type(value).__name__}",
                                        f"write `{key}:` followed by indented keys"))
                continue
            for sub, subval in (value or {}).items():
                if sub not in known:
                    close = difflib.get_close_matches(str(sub), sorted(known), n=1)
                    problems.append(Problem(f"{label}: {key}.{sub}", f"not an Accelerate {key} key",
                                            f"did you mean {close[0]}?" if close else "remove it"))
                else:
                    values[sub] = subval
        else:
            values[key] = value
    config = AccelerateConfig(values=values, label=label, path=path)
    if not duplicates:  # with a key given twice the values below are a guess: say only that
        problems += check_accelerate_config(config)
    raise_if(problems, f"accelerate config {label} has {len(problems)} problems")
    return config


def config_from_environment(env: os._Environ | dict) -> AccelerateConfig:
    """The settings `accelerate launch` exported to this rank (when the user ran `accelerate launch` directly)."""
    values: dict[str, Any] = {}
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        values["distributed_type"] = "FSDP"
    for key, var in _ENV_OF_KEY.items():
        if var in env:
            values[key] = env[var]
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        values.pop("parallelism_config_dp_replicate_size", None)
        values.pop("parallelism_config_dp_shard_size", None)
    if "ACCELERATE_MIXED_PRECISION" in env:
        values["mixed_precision"] = env["ACCELERATE_MIXED_PRECISION"]
    if env.get("ACCELERATE_USE_CPU", "false").lower() == "true":
        values["use_cpu"] = True
    world = int(env.get("WORLD_SIZE", "1"))
    local = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    values["num_processes"] = world
    values["num_machines"] = max(1, world // max(1, local))
    return AccelerateConfig(values=values, label="accelerate launch environment")


def check_accelerate_config(c: AccelerateConfig) -> list[Problem]:
    p: list[Problem] = []

    def bad(key, msg, fix):
        p.append(Problem(c.where(key), msg, fix))

    dt = str(c.get("distributed_type", "NO"))
    if dt != "FSDP":
        bad("distributed_type", f"is {dt!r}; accel-fsdp trains with FSDP", "set distributed_type: FSDP")
    version = _as_int(c.get("fsdp_version", 1))
    if version not in (1, 2):
        bad("fsdp_config.fsdp_version", f"{c.get('fsdp_version')!r} is not 1 or 2", "use 2 (FSDP2, the default)")
    mp = str(c.get("mixed_precision", "no"))
    if mp not in ("no", "bf16", "fp16"):
        bad("mixed_precision", f"{mp!r} is not supported", "use bf16, fp16 or no")
    for key in ("num_processes", "num_machines"):
        if key in c.values and (_as_int(c.get(key)) is None or _as_int(c.get(key)) < 1):
            bad(key, f"{c.get(key)!r} must be a whole number of at least 1", f"e.g. {key}: 2")
    n, m = _as_int(c.get("num_processes", 1)) or 1, _as_int(c.get("num_machines", 1)) or 1
    if n % m:
        bad("num_processes", f"{n} processes cannot be split evenly over num_machines = {m}",
            f"use a multiple of {m} (num_processes counts all ranks on all machines)")
    rank = _as_int(c.get("machine_rank", 0))
    if rank is None or not 0 <= rank < m:
        bad("machine_rank", f"{c.get('machine_rank')!r} must be between 0 and num_machines - 1 = {m - 1}",
            "set 0 on the main machine, 1..N-1 on the others")
    if m > 1 and not c.get("main_process_ip"):
        bad("main_process_ip", f"is not set, but num_machines = {m}",
            "set the address of the machine with machine_rank 0 (`recipe run --main-process-ip ADDR`, or "
            "main_process_ip in the config)")
    if version == 1:
        s = _fsdp1_strategy(c.get("fsdp_sharding_strategy", c.get("fsdp_reshard_after_forward", "FULL_SHARD")))
        if s not in FSDP1_STRATEGIES:
            bad("fsdp_config.fsdp_sharding_strategy", f"{s!r} is not an FSDP1 strategy",
                "use " + ", ".join(FSDP1_STRATEGIES[:4]))
        bp = c.get("fsdp_backward_prefetch")
        if bp is not None and str(bp).upper() not in BACKWARD_PREFETCH:
            bad("fsdp_config.fsdp_backward_prefetch", f"{bp!r} is not valid", "use " + ", ".join(BACKWARD_PREFETCH))
    else:
        raf = c.get("fsdp_reshard_after_forward", True)
        if _as_bool(raf) is None:
            bad("fsdp_config.fsdp_reshard_after_forward", f"{raf!r} is not true or false in FSDP2",
                "true = FULL_SHARD, false = SHARD_GRAD_OP; HYBRID_SHARD comes from parallelism_config")
        for key in ("fsdp_backward_prefetch", "fsdp_use_orig_params", "fsdp_sync_module_states",
                    "fsdp_forward_prefetch"):
            if key in c.values and c.get(key) not in (None, False, "false", "False", "NO_PREFETCH"):
                bad(f"fsdp_config.{key}", f"{c.get(key)!r} has no effect in FSDP2 (fsdp_version: 2)",
                    "remove it, or use fsdp_version: 1 (see accelerate_configs/fsdp1_2gpu.yaml)")
    sdt = str(c.get("fsdp_state_dict_type", "SHARDED_STATE_DICT")).upper()
    if sdt not in STATE_DICT_TYPES:
        bad("fsdp_config.fsdp_state_dict_type", f"{sdt!r} is not supported",
            "use SHARDED_STATE_DICT or FULL_STATE_DICT")
    policy = str(c.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    if policy not in WRAP_POLICIES:
        bad("fsdp_config.fsdp_auto_wrap_policy", f"{policy!r} is not a wrap policy", "use " + ", ".join(WRAP_POLICIES))
    elif policy == "SIZE_BASED_WRAP" and version == 2:
        # Accelerate's size-based policy under FSDP2 also picks ModuleList containers, which fully_shard refuses.
        bad("fsdp_config.fsdp_auto_wrap_policy", "SIZE_BASED_WRAP does not work with FSDP2 through Accelerate (it "
            "would shard the ModuleList of blocks, which fully_shard refuses)",
            "use TRANSFORMER_BASED_WRAP (one unit per block, or name the classes you want as units in "
            "fsdp_transformer_layer_cls_to_wrap), or fsdp_version: 1 for size-based wrapping")
    if "fsdp_min_num_params" in c.values and (_as_int(c.get("fsdp_min_num_params")) or 0) < 1:
        bad("fsdp_config.fsdp_min_num_params", f"{c.get('fsdp_min_num_params')!r} is not a positive whole number",
            "e.g. 100000000 (modules with at least this many parameters become units)")
    for key in ("fsdp_offload_params", "fsdp_activation_checkpointing", "fsdp_cpu_ram_efficient_loading", "use_cpu"):
        if key in c.values and _as_bool(c.get(key)) is None:
            bad(key if key == "use_cpu" else f"fsdp_config.{key}", f"{c.get(key)!r} is not true or false",
                "use true or false")
    rep, shard = c.get("parallelism_config_dp_replicate_size"), c.get("parallelism_config_dp_shard_size")
    if rep is not None or shard is not None:
        if version != 2:
            bad("parallelism_config", "needs FSDP2", "set fsdp_config.fsdp_version: 2")
        r, s = _as_int(rep or 1), _as_int(shard or 1)
        if r is None or s is None or r < 1 or s < 1:
            bad("parallelism_config", f"dp_replicate_size={rep!r}, dp_shard_size={shard!r} must be whole numbers >= 1",
                "e.g. dp_replicate_size: 2 (nodes), dp_shard_size: 8 (GPUs per node)")
        elif r * s != n:
            bad("parallelism_config", f"dp_replicate_size x dp_shard_size = {r} x {s} = {r * s}, "
                f"but num_processes = {n}",
                f"make the product equal the number of processes, e.g. dp_replicate_size: {m}, dp_shard_size: {n // m}")
        elif m > 1 and s != n // m:
            bad("parallelism_config", f"the hybrid shard group of {s} ranks does not match the {n // m} ranks of each "
                f"machine (num_processes {n} / num_machines {m}), so shards would cross machines",
                f"for {m} machines set dp_replicate_size: {m} and dp_shard_size: {n // m}, or run on {n // s} machines")
    return p


# ------------------------------------------------------------------------------------------- settings


@dataclass
class Setting:
    value: Any
    source: str

    def __str__(self) -> str:
        v = ", ".join(self.value) if isinstance(self.value, (list, tuple)) else self.value
        return f"{v}  ({self.source})"


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
    fsdp1_options: Setting = field(default_factory=lambda: Setting({}, "default"))
    """backward_prefetch, forward_prefetch, limit_all_gathers, use_orig_params, sync_module_states (FSDP1)."""

    def rows(self) -> list[tuple[str, Setting]]:
        rows = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        if self.fsdp_version.value == 2:
            rows = [r for r in rows if r[0] != "fsdp1_options"]
        if self.wrap_policy.value != "SIZE_BASED_WRAP":
            rows = [r for r in rows if r[0] != "min_num_params"]
        return rows

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: {"value": s.value, "source": s.source} for name, s in self.rows()}

    def format(self, indent: int = 2) -> str:
        width = max(len(n) for n, _ in self.rows())
        return "\n".join(f"{'':<{indent}}{n:<{width}}  {s}" for n, s in self.rows())


def resolve_settings(recipe, config: AccelerateConfig, *, cuda_available: bool, num_processes: int | None = None,
                     num_machines: int | None = None) -> FsdpSettings:
    """Combine recipe, accelerate config, detection and defaults; the first that says something wins.

    `num_processes` / `num_machines` are what the launch really has (inside a rank: WORLD_SIZE; for the CLI
    without a config: the local GPUs); they win over the config's numbers. With no wrap class named anywhere,
    `wrap_classes` is left as MODEL_DEFAULT until `detect_wrap_classes` sees the model.
    """
    cfg = config.label

    def from_recipe(key: str) -> str:
        return "--set" if key in recipe.overridden else f"recipe {recipe.source or recipe.name}"

    def pick(recipe_key: str | None, recipe_value, config_key: str | None, convert, default, default_source="default"):
        if recipe_key and recipe_value is not None:
            return Setting(recipe_value, from_recipe(recipe_key))
        if config_key and config_key in config.values and config.values[config_key] is not None:
            return Setting(convert(config.values[config_key]), cfg)
        return Setting(default, default_source)

    use_cpu = _as_bool(config.get("use_cpu", False)) or False
    if use_cpu:
        device = Setting("cpu", f"{cfg} (use_cpu)")
    elif cuda_available:
        device = Setting("cuda", "detected")
    else:
        device = Setting("cpu", "detected: no CUDA device")
    nproc = pick(None, None, "num_processes", lambda v: _as_int(v) or 1, 1)
    if num_processes is not None and num_processes != nproc.value:
        nproc = Setting(num_processes, "detected: the launch's WORLD_SIZE" if "WORLD_SIZE" in os.environ
                        else "detected: local GPUs")
    nmach = pick(None, None, "num_machines", lambda v: _as_int(v) or 1, 1)
    if num_machines is not None and num_machines != nmach.value:
        nmach = Setting(num_machines, "detected: the launch's WORLD_SIZE / LOCAL_WORLD_SIZE")
    version = pick(None, None, "fsdp_version", int, 1 if config.values else 2)

    # Sharding strategy: FSDP1 names it; FSDP2 says reshard_after_forward (true = FULL_SHARD, false = SHARD_GRAD_OP)
    # and gets HYBRID_SHARD from the parallelism config's replicate x shard mesh.
    rep = _as_int(config.get("parallelism_config_dp_replicate_size") or 1)
    if version.value == 1:
        strategy = pick(None, None, "fsdp_sharding_strategy", lambda v: _fsdp1_strategy(v), "FULL_SHARD")
    elif rep and rep > 1:
        strategy = Setting("HYBRID_SHARD", f"{cfg} (parallelism_config)")
    else:
        strategy = pick(None, None, "fsdp_reshard_after_forward",
                        lambda v: "FULL_SHARD" if _as_bool(v) in (True, None) else "SHARD_GRAD_OP", "FULL_SHARD")
    if recipe.fsdp.sharding_strategy is not None:
        strategy = Setting(recipe.fsdp.sharding_strategy, from_recipe("fsdp.sharding_strategy"))
    n = nproc.value
    if strategy.value == "HYBRID_SHARD":
        if rep and rep > 1 and strategy.source.startswith(cfg):
            dp_rep = Setting(rep, f"{cfg} (parallelism_config)")
            dp_shard = Setting(_as_int(config.get("parallelism_config_dp_shard_size") or 1),
                               f"{cfg} (parallelism_config)")
        else:
            machines = nmach.value
            dp_rep = Setting(machines, "derived: one replica per machine")
            dp_shard = Setting(n // machines, "derived: shard within a machine")
    elif strategy.value == "NO_SHARD":
        dp_rep, dp_shard = Setting(n, "derived: every rank holds everything"), Setting(1, "derived")
    else:
        dp_rep, dp_shard = Setting(1, "derived"), Setting(n, "derived: shard over all ranks")

    policy = pick(None, None, "fsdp_auto_wrap_policy", lambda v: str(v).upper(), "TRANSFORMER_BASED_WRAP")
    if recipe.fsdp.wrap_class:
        classes = Setting(_split(recipe.fsdp.wrap_class), from_recipe("fsdp.wrap_class"))
        policy = Setting("TRANSFORMER_BASED_WRAP", from_recipe("fsdp.wrap_class"))
    elif policy.value == "TRANSFORMER_BASED_WRAP" and config.get("fsdp_transformer_layer_cls_to_wrap"):
        classes = Setting(_split(config.get("fsdp_transformer_layer_cls_to_wrap")), cfg)
    elif policy.value == "TRANSFORMER_BASED_WRAP":
        classes = Setting([MODEL_DEFAULT], "default: the model's _no_split_modules")
    else:
        classes = Setting([], f"{cfg} ({policy.value})")

    min_params = pick(None, None, "fsdp_min_num_params", lambda v: _as_int(v) or 100_000_000, 100_000_000)
    offload = pick("fsdp.cpu_offload", recipe.fsdp.cpu_offload, "fsdp_offload_params", _as_bool, False)
    sdt = pick("checkpoint.state_dict_type", recipe.checkpoint.state_dict_type, "fsdp_state_dict_type",
               lambda v: str(v).upper(), "SHARDED_STATE_DICT")
    ac = pick("model.activation_checkpointing", recipe.model.activation_checkpointing,
              "fsdp_activation_checkpointing", _as_bool, False)
    mp = pick("training.mixed_precision", recipe.training.mixed_precision, "mixed_precision",
              lambda v: PRECISION_FROM_ACCELERATE.get(str(v), str(v)), "bf16")
    if device.value == "cpu" and mp.value == "bf16" and not mp.source.startswith(("recipe", "--set")):
        native, cpu_name = cpu_bf16()
        if not native:
            mp = Setting("fp32", f"detected: {cpu_name} has no native bf16 matrix units (AVX512-BF16, AMX or Arm "
                                 "BF16), where bf16 is emulated and about 4x slower; training.mixed_precision: bf16 "
                                 "asks for it anyway")
    ram = pick(None, None, "fsdp_cpu_ram_efficient_loading", _as_bool, False)
    reduce_each = Setting(recipe.fsdp.reduce_every_micro_step,
                          from_recipe("fsdp.reduce_every_micro_step") if "fsdp.reduce_every_micro_step" in
                          recipe.overridden or "fsdp.reduce_every_micro_step" in recipe.lines else "default")
    timeout = Setting(recipe.fsdp.collective_timeout_minutes,
                      from_recipe("fsdp.collective_timeout_minutes") if "fsdp.collective_timeout_minutes" in
                      recipe.overridden or "fsdp.collective_timeout_minutes" in recipe.lines else "default")

    fsdp1 = {}
    fsdp1_source = cfg
    if version.value == 1:
        bp = config.get("fsdp_backward_prefetch")
        fsdp1 = {
            "backward_prefetch": str(bp).upper() if bp else "NO_PREFETCH",
            "forward_prefetch": bool(_as_bool(config.get("fsdp_forward_prefetch", False))),
            "limit_all_gathers": bool(_as_bool(config.get("fsdp_limit_all_gathers", True))),
            "use_orig_params": bool(_as_bool(config.get("fsdp_use_orig_params", True))),
            "sync_module_states": bool(_as_bool(config.get("fsdp_sync_module_states", False))),
        }
        if device.value == "cpu" and (fsdp1["sync_module_states"] or ram.value):
            # Accelerate's FSDP1 plugin looks for a GPU to broadcast from; on CPU every rank loads the weights.
            fsdp1["sync_module_states"] = False
            ram = Setting(False, f"{cfg}; off on CPU (Accelerate's FSDP1 broadcast needs a GPU)")
            fsdp1_source = f"{cfg}; sync_module_states off on CPU"
    return FsdpSettings(
        device=device, num_processes=nproc, num_machines=nmach, fsdp_version=version, sharding_strategy=strategy,
        wrap_policy=policy, wrap_classes=classes, min_num_params=min_params, cpu_offload=offload, state_dict_type=sdt,
        activation_checkpointing=ac, mixed_precision=mp, cpu_ram_efficient_loading=ram,
        dp_replicate_size=dp_rep, dp_shard_size=dp_shard, reduce_every_micro_step=reduce_each,
        collective_timeout_minutes=timeout, fsdp1_options=Setting(fsdp1, fsdp1_source if fsdp1 else "default"),
    )


CPU_BF16_ENV = "ACCEL_FSDP_CPU_BF16"
"""1 or 0: what to assume about this CPU's native bf16 support instead of detecting it (tests, odd platforms)."""


def cpu_bf16() -> tuple[bool, str]:
    """(this CPU computes bf16 matrix products natively, its name). x86: the avx512_bf16 or amx_bf16 flags; Arm:
    the bf16 feature (Linux /proc/cpuinfo, macOS sysctl). Without them PyTorch emulates bf16 on the CPU."""
    forced = os.environ.get(CPU_BF16_ENV)
    name = "this CPU"
    if forced in ("0", "1"):
        return forced == "1", f"this CPU ({CPU_BF16_ENV}={forced})"
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        info = ""
    if info:
        for line in info.splitlines():
            if line.lower().startswith(("model name", "cpu model", "hardware")):
                name = line.split(":", 1)[1].strip() or name
                break
        flags = set()
        for line in info.splitlines():
            if line.lower().startswith(("flags", "features")):
                flags |= set(line.split(":", 1)[1].split())
        return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}), name
    import platform
    import subprocess

    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16", "machdep.cpu.brand_string"],
                                 capture_output=True, text=True, timeout=5).stdout.split("\n")
            return out[0].strip() == "1", out[1].strip() or name
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    return False, name


def batch_problem(where: str, global_batch: int, micro_batch: int, ranks: list[int], ranks_name: str
                  ) -> Problem | None:
    """The seeds' batch arithmetic: global / (micro x ranks) gradient accumulation steps must be a whole number.
    `ranks` are the factors of the rank count as the user sees them ([2] processes, or [nodes, gpus])."""
    total = 1
    for r in ranks:
        total *= r
    per_step = micro_batch * total
    if global_batch % per_step == 0:
        return None
    down = global_batch // per_step * per_step
    examples = " or ".join(str(x) for x in (down, down + per_step) if x > 0)
    factors = " x ".join(str(r) for r in [micro_batch, *ranks])
    return Problem(where, f"{global_batch} is not divisible by micro_batch_size x {ranks_name} = {factors} = "
                   f"{per_step}, so gradient accumulation steps would not be a whole number",
                   f"use a multiple of {per_step} (e.g. {examples}), or change training.micro_batch_size")


def detect_wrap_classes(settings: FsdpSettings, no_split_modules: list[str]) -> None:
    """Fill in the model's own block classes where nothing named a wrap class."""
    if settings.wrap_classes.value == [MODEL_DEFAULT]:
        settings.wrap_classes = Setting(sorted(no_split_modules), "detected: model._no_split_modules")


def check_settings(settings: FsdpSettings, recipe, *, visible_gpus: int | None = None) -> list[Problem]:
    """Problems of the combination (recipe x hardware) that neither file shows alone.

    `visible_gpus`: the GPUs this machine shows (CUDA_VISIBLE_DEVICES applied), when the run is about to start
    here; None when judging a config for other hardware (`recipe validate` on a laptop)."""
    p: list[Problem] = []
    s = settings
    n, machines = s.num_processes.value, s.num_machines.value
    t = recipe.training
    batch = batch_problem(recipe.where("training.global_batch_size"), t.global_batch_size, t.micro_batch_size,
                          [n], "processes")
    if batch:
        p.append(batch)
    if s.mixed_precision.value == "fp16" and s.device.value == "cpu":
        p.append(Problem(_where(recipe, s.mixed_precision, "training.mixed_precision", "mixed_precision"),
                         "fp16 needs a GPU (its grad scaler does not run on CPU)",
                         "use bf16 (same memory, no scaler) or fp32"))
    if s.mixed_precision.value not in ("bf16", "fp32", "fp16"):
        p.append(Problem(_where(recipe, s.mixed_precision, "training.mixed_precision", "mixed_precision"),
                         f"{s.mixed_precision.value!r} is not supported", "use bf16, fp32 or fp16"))
    strategy = s.sharding_strategy.value
    if strategy == "HYBRID_SHARD":
        if s.dp_replicate_size.value * s.dp_shard_size.value != n:
            p.append(Problem(_where(recipe, s.sharding_strategy, "fsdp.sharding_strategy"),
                             f"hybrid group of {s.dp_shard_size.value} x {s.dp_replicate_size.value} replicas "
                             f"does not match the world size {n}",
                             "make dp_replicate_size x dp_shard_size equal num_processes"))
        if s.dp_shard_size.value > n:
            p.append(Problem(_where(recipe, s.sharding_strategy, "fsdp.sharding_strategy"),
                             f"hybrid shard group of {s.dp_shard_size.value} ranks is larger than the world size {n}",
                             f"use a shard group of at most {n} ranks"))
    if strategy == "NO_SHARD" and s.fsdp_version.value == 2:
        p.append(Problem(_where(recipe, s.sharding_strategy, "fsdp.sharding_strategy"),
                         "NO_SHARD is an FSDP1 strategy; FSDP2 has no unsharded mode",
                         "use accelerate_configs/fsdp1_2gpu.yaml with fsdp_sharding_strategy: NO_SHARD, "
                         "or SHARD_GRAD_OP (shards gradients and optimizer state only)"))
    if strategy == "HYBRID_SHARD" and s.fsdp_version.value == 1 and n > 1 and machines == 1 \
            and s.device.value == "cpu":
        p.append(Problem(_where(recipe, s.sharding_strategy, "fsdp.sharding_strategy"),
                         "FSDP1 HYBRID_SHARD needs several machines", "use FSDP2 with a parallelism_config"))
    attn = recipe.model.attn_implementation or ""
    if "flash" in attn and s.device.value == "cpu":
        p.append(Problem(recipe.where("model.attn_implementation"), f"{attn} needs a CUDA GPU, and this run is on CPU",
                         "use sdpa on CPU (packed documents stay apart there too)"))
    if s.device.value == "cuda" and visible_gpus is not None:
        p += gpu_count_problems(settings, visible_gpus)
    if s.fsdp_version.value == 1 and recipe.model.lora.enabled:
        # FSDP1 flattens each unit into one parameter of one dtype: the frozen base would be upcast to fp32 and
        # get gradients for every element (use_orig_params only hides it), which is what LoRA exists to avoid.
        p.append(Problem(f"{s.fsdp_version.source}: fsdp_config.fsdp_version",
                         "LoRA with FSDP1 upcasts the frozen base weights to fp32 and computes gradients for the "
                         "whole flat parameter of each unit", "use an FSDP2 config (fsdp_version: 2, e.g. "
                         "fsdp_2gpu.yaml, llama_fsdp_8gpu.yaml, fsdp_multinode.yaml)"))
    elif s.fsdp_version.value == 1 and not s.fsdp1_options.value.get("use_orig_params"):
        where = settings.fsdp1_options.source + ": fsdp_config.fsdp_use_orig_params"
        if t.weight_decay:
            p.append(Problem(where, f"false flattens every weight into one parameter, so weight decay "
                             f"({t.weight_decay}) could not skip biases and norms",
                             "set fsdp_use_orig_params: true, or training.weight_decay: 0"))
    return p


def gpu_count_problems(settings: FsdpSettings, visible_gpus: int) -> list[Problem]:
    """One process per GPU: more processes than visible GPUs put two ranks on one device (NCCL then fails with
    "Duplicate GPU detected" at the first collective); fewer leave GPUs idle, which is allowed but said."""
    per_machine = settings.num_processes.value // max(1, settings.num_machines.value)
    source = settings.num_processes.source
    if per_machine > visible_gpus:
        return [Problem(f"{source}: num_processes", f"{per_machine} processes per machine, but this machine shows "
                        f"{visible_gpus} GPU(s) (CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
                        f"use one process per GPU: num_processes: {visible_gpus * settings.num_machines.value} "
                        f"(or an accelerate config for {visible_gpus} GPU(s)), or make more GPUs visible")]
    return []


def idle_gpu_note(settings: FsdpSettings, visible_gpus: int) -> str | None:
    per_machine = settings.num_processes.value // max(1, settings.num_machines.value)
    if settings.device.value == "cuda" and 0 < per_machine < visible_gpus:
        return (f"{per_machine} process(es) per machine on {visible_gpus} visible GPUs: {visible_gpus - per_machine} "
                f"GPU(s) stay idle (num_processes: {visible_gpus * settings.num_machines.value} would use them all)")
    return None


def _where(recipe, setting: Setting, key: str, config_key: str | None = None) -> str:
    """Where a setting came from, named by the key the user wrote there: the recipe's key, or the config's."""
    if setting.source.startswith("recipe") or setting.source == "--set":
        return recipe.where(key)
    return f"{setting.source}: {config_key or key}"


def _fsdp1_strategy(v) -> str:
    """FSDP1's strategy by name, or by Accelerate's 1-based number (1 = FULL_SHARD); anything else is kept as given
    and reported by check_accelerate_config."""
    s = str(v).upper()
    if s.isdigit() and 1 <= int(s) <= len(FSDP1_STRATEGIES):
        return FSDP1_STRATEGIES[int(s) - 1]
    return s


def _split(v) -> list[str]:
    if isinstance(v, (list, tuple)):
        return [str(x).strip() for x in v if str(x).strip()]
    return [x.strip() for x in str(v).split(",") if x.strip()]


def _as_bool(v) -> bool | None:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("true", "1", "yes"):
        return True
    if s in ("false", "0", "no"):
        return False
    return None


def _as_int(v) -> int | None:
    if isinstance(v, bool):
        return None
    try:
        f = float(v)
        return int(f) if f == int(f) else None
    except (TypeError, ValueError, OverflowError):  # not a number, NaN, infinity
        return None
