"""The Accelerator of a run: Accelerate's FSDP plugin built from the resolved `FsdpSettings`.

Every value comes from `launch_config.resolve_settings` (and is printed with its source); nothing here reads the
environment or the config file again. On CPU ranks `cpu_fsdp.init_cpu_fsdp_state` makes Accelerate's own FSDP
path shard for real.
"""

from __future__ import annotations

from pathlib import Path

import torch

from accel_fsdp.launch_config import MODEL_DEFAULT, FsdpSettings

_ACCELERATE_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def build_fsdp_plugin(settings: FsdpSettings, *, for_planning: bool = False):
    """Accelerate's FSDP plugin. `for_planning`: only to ask it for the wrap policy (the dry run), so leave out
    the options that look for a device."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    s = settings
    version = s.fsdp_version.value
    classes = s.wrap_classes.value
    named = [c for c in classes if c != MODEL_DEFAULT] or None
    policy = s.wrap_policy.value.lower()
    kwargs = dict(
        fsdp_version=version,
        auto_wrap_policy=policy,
        transformer_cls_names_to_wrap=named if policy == "transformer_based_wrap" else None,
        cpu_offload=_cpu_offload(s),
        state_dict_type=s.state_dict_type.value,
        activation_checkpointing=bool(s.activation_checkpointing.value),
        cpu_ram_efficient_loading=bool(s.cpu_ram_efficient_loading.value),
        mixed_precision_policy=_mixed_precision_policy(version, s.mixed_precision.value),
    )
    if policy == "size_based_wrap":
        kwargs["min_num_params"] = s.min_num_params.value
    if version == 2:
        kwargs["reshard_after_forward"] = s.sharding_strategy.value in ("FULL_SHARD", "HYBRID_SHARD")
    else:
        o = s.fsdp1_options.value
        # Named explicitly: left unset, Accelerate would take FSDP_SHARDING_STRATEGY from the launch environment.
        kwargs.update(sharding_strategy=s.sharding_strategy.value, backward_prefetch=o["backward_prefetch"],
                      forward_prefetch=o["forward_prefetch"], limit_all_gathers=o["limit_all_gathers"],
                      use_orig_params=o["use_orig_params"], sync_module_states=o["sync_module_states"])
        if kwargs["cpu_ram_efficient_loading"]:
            kwargs["sync_module_states"] = True
    if for_planning:
        kwargs.update(cpu_ram_efficient_loading=False, cpu_offload=False)
        if version == 1:
            kwargs["sync_module_states"] = False
    return FullyShardedDataParallelPlugin(**kwargs)


def _cpu_offload(settings: FsdpSettings):
    if not settings.cpu_offload.value:
        return False
    if settings.device.value == "cpu" and settings.fsdp_version.value == 2:
        # Without an accelerator there is no pinned memory; the offload path still runs (CPU to CPU copies).
        from torch.distributed.fsdp import CPUOffloadPolicy

        return CPUOffloadPolicy(pin_memory=False)
    return True


def _mixed_precision_policy(version: int, precision: str):
    """bf16/fp16 compute with fp32 master weights and fp32 gradient reduction (the torchtitan default)."""
    if precision == "fp32":
        return None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    if version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype)


def build_parallelism_config(settings: FsdpSettings):
    """Hybrid sharding under FSDP2: shard inside a group of dp_shard_size ranks, replicate across groups."""
    if settings.fsdp_version.value != 2 or settings.sharding_strategy.value != "HYBRID_SHARD":
        return None
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig(dp_replicate_size=settings.dp_replicate_size.value,
                             dp_shard_size=settings.dp_shard_size.value)


def build_accelerator(settings: FsdpSettings, *, gradient_accumulation_steps: int, run_dir: Path | None,
                      trackers: list[str] = ()):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    plugin = build_fsdp_plugin(settings)
    parallelism = build_parallelism_config(settings)
    precision = _ACCELERATE_PRECISION[settings.mixed_precision.value]
    cpu = settings.device.value == "cpu"
    if cpu:
        from accel_fsdp.cpu_fsdp import init_cpu_fsdp_state

        init_cpu_fsdp_state(plugin, mixed_precision=precision, parallelism_config=parallelism)
    project = ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "logs")) if run_dir else None
    return Accelerator(
        cpu=cpu,
        mixed_precision=precision,
        fsdp_plugin=plugin,
        parallelism_config=parallelism,
        gradient_accumulation_steps=gradient_accumulation_steps,
        log_with=list(trackers) or None,
        project_config=project,
        # The LR scheduler is stepped by the loop once per optimizer step; it is not prepared.
        step_scheduler_with_optimizer=False,
    )


def expected_shards(settings: FsdpSettings) -> int:
    """Into how many pieces each rank's parameters are cut."""
    strategy = settings.sharding_strategy.value
    if strategy == "NO_SHARD":
        return 1
    if strategy == "HYBRID_SHARD":
        return settings.dp_shard_size.value
    return settings.num_processes.value
