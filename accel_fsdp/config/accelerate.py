"""Accelerate launch configs (hardware): read, check, and know their keys.

`accelerate_configs/*.yaml` are plain Accelerate config files: `accelerate launch --config_file` reads them,
and so does this module, to check them before anything launches and to know how many processes to start.
Inside a launched rank the same settings are read back from the file (when the CLI launched itself) or from
the `FSDP_*` variables that `accelerate launch` exported (when the user ran it). Combining them with the recipe
into the effective settings of a run is config/settings.py's job. This module only reads and checks; it must
not import accelerate or torch at import time.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel_fsdp.config import precision
from accel_fsdp.config.shipped import display, resolve_accelerate_config
from accel_fsdp.config.yaml_file import load_yaml, read_text
from accel_fsdp.errors import Problem, UserError, raise_if

CONFIG_PATH_ENV = "ACCEL_FSDP_ACCELERATE_CONFIG"
"""Set by the CLI when it launches itself, so each rank reads the same file (and can name it in messages)."""

# The sharding strategies, in the order of torch's ShardingStrategy enum (1..4, as the FSDP1 config's digits name
# them; torch/distributed/fsdp/api.py). The one home of their names.
STRATEGIES = FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD",
                                                                  "HYBRID_SHARD")
BY_SHARDING = (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD)
"""Least sharded first: the order tables show them in."""
FSDP1_STRATEGIES = (*STRATEGIES, "_HYBRID_SHARD_ZERO2")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")

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
    "fsdp_activation_checkpointing_offload": "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
    "fsdp_ignored_modules": "FSDP_IGNORED_MODULES",
}

# fsdp_config keys Accelerate knows that accel-fsdp does not read (it builds the FSDP plugin from its own resolved
# settings: train/accelerator.py), with what to use instead. A setting that would be silently ignored is refused;
# two of them would even stop every rank: Accelerate's plugin reads FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD from the
# launch environment and refuses it without its own activation checkpointing, which accel-fsdp leaves off under
# FSDP2 (accelerate/utils/dataclasses.py, FullyShardedDataParallelPlugin.__post_init__; 1.15.0).
UNREAD_FSDP_KEYS = {
    "fsdp_activation_checkpointing_offload": "remove it; to move activations to host memory set "
                                             "training.activation_offload: true in the recipe",
    "fsdp_ignored_modules": "remove it (accel-fsdp decides which modules FSDP leaves alone)",
    "fsdp_mixed_precision_policy": "remove it, and set mixed_precision (or the recipe's training.mixed_precision)",
    "fsdp_cpu_offload": "use fsdp_offload_params (the key accelerate launch reads)",
    "fsdp_fsdp_version": "use fsdp_version",
    "fsdp_transformer_cls_names_to_wrap": "use fsdp_transformer_layer_cls_to_wrap (the key accelerate launch reads)",
    "fsdp_param_init_fn": "remove it (models are built and loaded by accel-fsdp)",
    "fsdp_state_dict_config": "remove it, and set fsdp_state_dict_type",
    "fsdp_optim_state_dict_config": "remove it, and set fsdp_state_dict_type",
}
UNREAD_SECTIONS = {
    # Accelerate would compile the whole prepared model from ACCELERATE_DYNAMO_BACKEND (accelerate/accelerator.py,
    # Accelerator.__init__ reads TorchDynamoPlugin from the launch environment; 1.15.0), past training.compile's
    # per-block compile and its checks.
    "dynamo_config": "remove it, and set training.compile: true in the recipe (each block compiled, checked)",
    "fp8_config": "remove it, and set training.mixed_precision: fp8 in the recipe",
    "deepspeed_config": "remove it: accel-fsdp trains with FSDP",
    "megatron_lm_config": "remove it: accel-fsdp trains with FSDP",
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

    def num_machines(self) -> int:
        """The machines of the job (1 where the config leaves it out or null, as `accelerate launch` takes it)."""
        return int(self.get("num_machines", 1) or 1)

    def machine_rank(self) -> int:
        """This machine's rank in the job (0 where the config leaves it out or null)."""
        return int(self.get("machine_rank", 0) or 0)

    def uses_cpu(self) -> bool:
        """Whether the ranks run on CPUs: use_cpu as `as_bool` reads it, the one rule for every reader (the ranks'
        settings, the launcher, the SLURM script; Accelerate's own str_to_bool agrees): `use_cpu: 1` is true and
        `use_cpu: "false"` false, where str(value) == "true" and the value's truth in Python read them the other
        way."""
        return as_bool(self.get("use_cpu", False)) is True


def load_accelerate_config(name_or_path: str | os.PathLike) -> AccelerateConfig:
    """Read and check an Accelerate config file; raise one `UserError` with every problem."""
    path = resolve_accelerate_config(str(name_or_path))
    label = display(path)
    try:
        text = read_text(path, label, "the accelerate config")
    except FileNotFoundError:
        raise UserError(Problem(label, "cannot read the accelerate config: it does not exist",
                                "give a readable .yaml file")) from None
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
    config = AccelerateConfig(values=values, label="accelerate launch environment")
    # Judged as a file is (accelerate launch checks almost nothing: fsdp_version 3 reached the plugin), less what it
    # exports whatever the file says, and the address it does not pass on.
    problems = check_accelerate_config(config, launching=False)
    raise_if(problems, f"{config.label} has {len(problems)} problems")
    return config


def unread_key_problems(c: AccelerateConfig) -> list[Problem]:
    """Keys set that accel-fsdp would not read (UNREAD_FSDP_KEYS, UNREAD_SECTIONS); `false`, null, an empty section
    and dynamo_backend: NO are as unset."""
    p = [Problem(c.where(f"fsdp_config.{key}"), f"{shown(c.get(key))} is not read by accel-fsdp", fix)
         for key, fix in UNREAD_FSDP_KEYS.items() if c.get(key) is not None and as_bool(c.get(key)) is not False]
    for key, fix in UNREAD_SECTIONS.items():
        value = c.get(key)
        if isinstance(value, dict) and str(value.get("dynamo_backend", "")).upper() in ("NO", "") and (
                key == "dynamo_config" or not value):
            continue
        if value is not None and value != {}:
            p.append(Problem(c.where(key), f"{_brief(value)} is not read by accel-fsdp", fix))
    return p


def _brief(value) -> str:
    text = shown(value)
    return text if len(text) <= 60 else text[:57] + "..."


def shown(value) -> str:
    """A config value as a message quotes it: YAML's null, else Python's repr ('two', 3)."""
    return "null" if value is None else repr(value)


def check_accelerate_config(c: AccelerateConfig, *, launching: bool = True) -> list[Problem]:
    """Every problem of one config's values, alone and between them. `launching` False: judged for a job that is
    not launched from here (`recipe validate`), whose main_process_ip `recipe run --main-process-ip` may still give.
    (Long: one check a few lines, read as a list.)"""
    p: list[Problem] = unread_key_problems(c)

    def bad(key, msg, fix):
        p.append(Problem(c.where(key), msg, fix))

    dt = str(c.get("distributed_type", "NO"))
    if dt != "FSDP":
        bad("distributed_type", f"is {dt!r}; accel-fsdp trains with FSDP", "set distributed_type: FSDP")
    version = as_int(c.get("fsdp_version", 1))
    if version not in (1, 2):
        bad("fsdp_config.fsdp_version", f"{shown(c.get('fsdp_version'))} is not 1 or 2",
            "set fsdp_version to 2 (FSDP2, the default), or 1 (FSDP1)")
    mp = str(c.get("mixed_precision", "no"))
    if mp not in precision.FROM_ACCELERATE:
        bad("mixed_precision", f"{mp!r} is not supported", "use bf16, fp16 or no")
    for key in ("num_processes", "num_machines"):
        if key in c.values and (as_int(c.get(key)) is None or as_int(c.get(key)) < 1):
            bad(key, f"{shown(c.get(key))} must be a whole number of at least 1",
                f"set {key} to a whole number of at least 1, e.g. {key}: 2")
    n, m = as_int(c.get("num_processes", 1)) or 1, as_int(c.get("num_machines", 1)) or 1
    if n % m:
        bad("num_processes", f"{n} processes cannot be split evenly over num_machines = {m}",
            f"use a multiple of {m} (num_processes counts all ranks on all machines)")
    rank = as_int(c.get("machine_rank", 0))
    if rank is None or not 0 <= rank < m:
        bad("machine_rank", f"{shown(c.get('machine_rank'))} must be between 0 and num_machines - 1 = {m - 1}",
            "set 0 on the main machine, 1..N-1 on the others")
    p += _launcher_problems(c, m)
    if m > 1 and not c.get("main_process_ip") and launching:
        bad("main_process_ip", f"is not set, but num_machines = {m}",
            "set the address of the machine with machine_rank 0 (`recipe run --main-process-ip ADDR`, or "
            "main_process_ip in the config)")
    if version == 1:
        s = fsdp1_strategy(c.get("fsdp_sharding_strategy", c.get("fsdp_reshard_after_forward", FULL_SHARD)))
        if s not in FSDP1_STRATEGIES:
            bad("fsdp_config.fsdp_sharding_strategy", f"{s!r} is not an FSDP1 strategy",
                "use " + ", ".join(STRATEGIES))
        bp = c.get("fsdp_backward_prefetch")
        if bp is not None and str(bp).upper() not in BACKWARD_PREFETCH:
            bad("fsdp_config.fsdp_backward_prefetch", f"{bp!r} is not valid", "use " + ", ".join(BACKWARD_PREFETCH))
    else:
        exported = c.path is None  # `accelerate launch` exports FSDP1's options with their defaults under FSDP2 too
        raf = c.get("fsdp_reshard_after_forward", True)
        if as_bool(raf) is None:
            bad("fsdp_config.fsdp_reshard_after_forward", f"{raf!r} is not true or false in FSDP2",
                "set fsdp_reshard_after_forward to true (FULL_SHARD) or false (SHARD_GRAD_OP); HYBRID_SHARD comes "
                "from parallelism_config")
        p.extend(_fsdp2_strategy_problems(c, as_bool(raf)))
        for key in ("fsdp_backward_prefetch", "fsdp_use_orig_params", "fsdp_sync_module_states",
                    "fsdp_forward_prefetch", "fsdp_limit_all_gathers"):
            if key in c.values and not exported and c.get(key) not in (None, False, "false", "False", "NO_PREFETCH"):
                bad(f"fsdp_config.{key}", f"{shown(c.get(key))} has no effect in FSDP2 (fsdp_version: 2)",
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
    if "fsdp_min_num_params" in c.values and (as_int(c.get("fsdp_min_num_params")) or 0) < 1:
        bad("fsdp_config.fsdp_min_num_params", f"{shown(c.get('fsdp_min_num_params'))} is not a positive whole "
            "number", "set fsdp_min_num_params to a whole number of at least 1, e.g. 100000000 (modules with at "
            "least this many parameters become units)")
    for key in ("fsdp_offload_params", "fsdp_activation_checkpointing", "fsdp_cpu_ram_efficient_loading", "use_cpu"):
        if key in c.values and as_bool(c.get(key)) is None:
            bad(key if key == "use_cpu" else f"fsdp_config.{key}", f"{c.get(key)!r} is not true or false",
                "use true or false")
    rep, shard = c.get("parallelism_config_dp_replicate_size"), c.get("parallelism_config_dp_shard_size")
    if rep is not None or shard is not None:
        if version != 2:
            bad("parallelism_config", "needs FSDP2", "set fsdp_config.fsdp_version: 2")
        r, s = as_int(rep or 1), as_int(shard or 1)
        if r is None or s is None or r < 1 or s < 1:
            bad("parallelism_config", f"dp_replicate_size={rep!r}, dp_shard_size={shard!r} must be whole numbers >= 1",
                "set both to whole numbers of at least 1, e.g. dp_replicate_size: 2 (nodes), dp_shard_size: 8 (GPUs "
                "per node)")
        elif r * s != n:
            bad("parallelism_config", f"dp_replicate_size x dp_shard_size = {r} x {s} = {r * s}, "
                f"but num_processes = {n}",
                f"make the product equal the number of processes, e.g. dp_replicate_size: {m}, dp_shard_size: {n // m}")
        elif m > 1 and s != n // m:
            bad("parallelism_config", f"the hybrid shard group of {s} ranks does not match the {n // m} ranks of each "
                f"machine (num_processes {n} / num_machines {m}), so shards would cross machines",
                f"for {m} machines set dp_replicate_size: {m} and dp_shard_size: {n // m}, or run on {n // s} machines")
    return p


def _fsdp2_strategy_problems(c: AccelerateConfig, reshard: bool | None) -> list[Problem]:
    """FSDP2 takes its strategy from fsdp_reshard_after_forward (and parallelism_config), never from
    fsdp_sharding_strategy: a strategy named there that differs would be silently ignored. `accelerate launch` exports
    FSDP_SHARDING_STRATEGY=FULL_SHARD whatever the file says (accelerate/utils/launch.py; 1.15.0), so in the launch
    environment only another name is the user's."""
    given = c.get("fsdp_sharding_strategy")
    if given is None or reshard is None:
        return []
    named = fsdp1_strategy(given)
    hybrid = (as_int(c.get("parallelism_config_dp_replicate_size") or 1) or 1) > 1
    effective = HYBRID_SHARD if hybrid else FULL_SHARD if reshard else SHARD_GRAD_OP
    if named == effective or (c.path is None and named == FULL_SHARD):
        return []
    how = {FULL_SHARD: "fsdp_reshard_after_forward: true", SHARD_GRAD_OP: "fsdp_reshard_after_forward: false",
           HYBRID_SHARD: "a parallelism_config (see accelerate_configs/fsdp_hybrid_multinode.yaml)",
           NO_SHARD: "fsdp_version: 1 (FSDP2 always shards)"}
    what = (f"is not a sharding strategy (use {', '.join(STRATEGIES)})" if named not in FSDP1_STRATEGIES else
            f"is ignored by FSDP2, which runs {effective} here "
            f"({'parallelism_config' if hybrid else f'fsdp_reshard_after_forward: {str(reshard).lower()}'})")
    fix = (f"for {named} set {how[named]}, and remove fsdp_sharding_strategy" if named in how else
           "remove fsdp_sharding_strategy; FSDP2's strategy is fsdp_reshard_after_forward (true: FULL_SHARD, "
           "false: SHARD_GRAD_OP)")
    return [Problem(c.where("fsdp_config.fsdp_sharding_strategy"), f"{shown(given)} {what}", fix)]


RENDEZVOUS_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
"""rdzv_backend values torchrun knows (torch/distributed/run.py; torch 2.13.0)."""


def _launcher_problems(c: AccelerateConfig, machines: int) -> list[Problem]:
    """Values `accelerate launch` itself reads, that would stop it with a traceback or start something else."""
    p: list[Problem] = []

    def bad(key, msg, fix):
        p.append(Problem(c.where(key), msg, fix))

    env = c.get("compute_environment")
    if env is not None and str(env) != "LOCAL_MACHINE":
        bad("compute_environment", f"{shown(env)}: accel-fsdp launches on this machine (or machines you start "
            "it on), not through another service", "set compute_environment: LOCAL_MACHINE")
    rdzv = c.get("rdzv_backend")
    if rdzv is not None and str(rdzv) not in RENDEZVOUS_BACKENDS:
        bad("rdzv_backend", f"{shown(rdzv)} is not a torchrun rendezvous backend",
            f"set rdzv_backend to one of {', '.join(RENDEZVOUS_BACKENDS)} (static is the default)")
    port = c.get("main_process_port")
    if port is not None and (as_int(port) is None or not (1 if machines > 1 else 0) <= as_int(port) <= 65535):
        bad("main_process_port", f"{shown(port)} is not a TCP port" + (" machines can meet on" if machines > 1 else ""),
            "set main_process_port to a whole number from 1 to 65535, e.g. 29500" + ("" if machines > 1 else
            " (or leave it out: one machine picks a free port)"))
    gpu_ids = c.get("gpu_ids")
    if gpu_ids is not None and not _gpu_ids_valid(gpu_ids):
        bad("gpu_ids", f"{shown(gpu_ids)} is neither `all` nor a list of GPU numbers",
            "set gpu_ids to all, or to GPU numbers separated by commas, e.g. 0,1")
    for key in ("downcast_bf16", "enable_cpu_affinity", "same_network", "debug"):
        if c.get(key) is not None and as_bool(c.get(key)) is None:
            bad(key, f"{shown(c.get(key))} is not true or false", f"set {key} to true or false")
    # accelerate launch refuses this pair before any rank starts (accelerate/utils/launch.py, prepare_multi_gpu_env;
    # 1.15.0); its fsdp_sync_module_states is true unless the file says false.
    if as_bool(c.get("fsdp_cpu_ram_efficient_loading", False)) and as_bool(c.get("fsdp_sync_module_states")) is False:
        bad("fsdp_config.fsdp_sync_module_states", "is false, and fsdp_cpu_ram_efficient_loading is true: accelerate "
            "launch refuses ram-efficient loading without it", "remove fsdp_sync_module_states (its default is true), "
            "or set fsdp_cpu_ram_efficient_loading: false")
    return p


def _gpu_ids_valid(value) -> bool:
    """`all`, one GPU number, or numbers separated by commas (what accelerate launch puts in CUDA_VISIBLE_DEVICES)."""
    if isinstance(value, bool):
        return False
    text = str(value).strip()
    return text.lower() == "all" or all(part.strip().isdigit() for part in text.split(","))


def fsdp1_strategy(v) -> str:
    """FSDP1's strategy by name, or by Accelerate's 1-based number (1 = FULL_SHARD); anything else is kept as given
    and reported by check_accelerate_config."""
    s = str(v).upper()
    if s.isdigit() and 1 <= int(s) <= len(FSDP1_STRATEGIES):
        return FSDP1_STRATEGIES[int(s) - 1]
    return s


def as_bool(v) -> bool | None:
    """A config value as true or false (YAML booleans, or the strings `accelerate launch` exports); None if neither."""
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("true", "1", "yes"):
        return True
    if s in ("false", "0", "no"):
        return False
    return None


def as_int(v) -> int | None:
    """A config value as a whole number (2, 2.0, "2"); None if it is not one."""
    if isinstance(v, bool):
        return None
    try:
        f = float(v)
        return int(f) if f == int(f) else None
    except (TypeError, ValueError, OverflowError):  # not a number, NaN, infinity
        return None
