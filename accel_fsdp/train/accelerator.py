"""The Accelerator of a run: Accelerate's FSDP plugin built from the resolved `FsdpSettings`.

Every value comes from `config/settings.py` `resolve_settings` (and is printed with its source); nothing here reads
the environment or the config file again. On CPU ranks `cpu_fsdp.init_cpu_fsdp_state` makes Accelerate's own FSDP
path shard for real.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch

from accel_fsdp.config.accelerate import CONFIG_PATH_ENV, FULL_SHARD, HYBRID_SHARD
from accel_fsdp.config.precision import ACCELERATE, compute_dtype
from accel_fsdp.config.settings import MODEL_DEFAULT, FsdpSettings, shard_group_size
from accel_fsdp.hardware import gloo_interface
from accel_fsdp.layout import LOGS_DIR
from accel_fsdp.train.cpu_fsdp import init_cpu_fsdp_state


def build_fsdp_plugin(settings: FsdpSettings, *, for_planning: bool = False, reduce_dtype=torch.float32):
    """Accelerate's FSDP plugin. `for_planning`: only to ask it for the wrap policy (the dry run), so leave out
    the options that look for a device. `reduce_dtype`: fp32 always, but for `verify`'s proof that its precision
    check can fail."""
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
        # FSDP2: Accelerate would wrap blocks with checkpoint_wrapper(preserve_rng_state=False)
        # (accelerate/utils/fsdp_utils.py, fsdp2_apply_ac, checked with 1.15.0), so the recompute would draw new
        # dropout masks and the gradient would not be the gradient of the loss. `apply_activation_checkpointing`
        # below wraps them itself, keeping the RNG. FSDP1's path (apply_activation_checkpointing) keeps it.
        activation_checkpointing=bool(s.activation_checkpointing.value) and version == 1,
        # FSDP2: rank 0 streams the weights itself once `prepare` has sharded the model (train/loading.py), so
        # Accelerate's own rank-0 loading (the whole state dict held by rank 0, every full tensor broadcast) is off.
        cpu_ram_efficient_loading=bool(s.cpu_ram_efficient_loading.value) and version == 1,
        mixed_precision_policy=_mixed_precision_policy(version, s.mixed_precision.value, reduce_dtype),
    )
    if policy == "size_based_wrap":
        kwargs["min_num_params"] = s.min_num_params.value
    if version == 2:
        kwargs["reshard_after_forward"] = s.sharding_strategy.value in (FULL_SHARD, HYBRID_SHARD)
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


def _mixed_precision_policy(version: int, precision: str, reduce_dtype):
    """bf16/fp16 compute with fp32 master weights and fp32 gradient reduction (the torchtitan default)."""
    if precision == "fp32":
        return None
    dtype = compute_dtype(precision)
    if version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    from torch.distributed.fsdp import MixedPrecision

    # buffer_dtype None: every buffer keeps its own dtype. FSDP1 casts all buffers (non-persistent ones included) to
    # buffer_dtype at the first forward (torch/distributed/fsdp/_runtime_utils.py, _cast_buffers_to_dtype_and_device;
    # torch 2.13.0): Llama's rotary inv_freq rounded to bf16 would shift every position's phase by up to 0.4%.
    return MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=None)


def process_group_kwargs(settings: FsdpSettings) -> dict:
    """init_process_group's keyword arguments: its backend(s) and the timeout of every collective.

    On CUDA the group always gets both backends, `cuda:nccl,cpu:gloo`. Accelerate adds the CPU one only when the
    *launcher* exported FSDP_OFFLOAD_PARAMS=true or FSDP_STATE_DICT_TYPE=FULL_STATE_DICT (accelerate/state.py,
    PartialState.__init__, checked with 1.15.0); CPU offload or a full state dict asked for by the recipe would
    then reduce CPU tensors over NCCL ("No backend type associated with device type cpu", pytorch#148532). The
    CPU backend also carries our small control messages (preemption flags) without a GPU sync.

    Given to `PartialState` as they are, not through `InitProcessGroupKwargs`: its `to_kwargs()` drops a value equal
    to the dataclass default (accelerate/utils/dataclasses.py, KwargsHandler.to_kwargs; its default timeout is 10
    minutes), so a configured 10 minutes reached torch as torch's 30-minute default."""
    backend = "cuda:nccl,cpu:gloo" if settings.device.value == "cuda" else "gloo"
    return {"backend": backend, "timeout": timedelta(minutes=settings.collective_timeout_minutes.value)}


def stock_launch_gloo_interface(env, machines: int, interfaces) -> tuple[str | None, str | None]:
    """The GLOO_SOCKET_IFNAME this rank sets before its process group is created, and the note its machine says, when
    a stock `accelerate launch` started several machines: nobody derived it there (our launcher does, and says so,
    launch/launcher.py), and gloo reads the variable when it creates its device, i.e. with the group (the test
    `test_gloo_takes_exact_interface_names` creates one). (None, None): nothing to do here: one machine, the variable
    set, or our launcher. `interfaces`: called only when needed (hardware.network_interfaces)."""
    if machines <= 1 or env.get("GLOO_SOCKET_IFNAME", "").strip() or env.get(CONFIG_PATH_ENV):
        return None, None
    return gloo_interface(env, interfaces())


def apply_collective_timeout(timeout: timedelta) -> None:
    """Every process group of this rank gets the configured timeout. The device mesh of hybrid sharding creates its
    dimension and flattened groups without one, i.e. with torch's default of 30 minutes (torch/distributed/
    device_mesh.py, _init_one_process_group -> new_group / split_group with timeout None; torch 2.13.0), as would any
    group a library makes later. `_set_pg_timeout` sets it on each group's gloo and NCCL backends."""
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timeout, group)


def accumulate(accelerator, model, settings: FsdpSettings):
    """`accelerator.accumulate` for one micro-step. Accelerate honours `sync_each_batch` only with several processes
    (accelerate/accelerator.py, accumulate: `self.use_distributed and sync_each_batch`; 1.15.0): with one it runs
    every non-final micro-step under no_sync, which for FSDP2 keeps every unit's unsharded fp32 gradient on the GPU
    until the last micro-step (+32 GB for 8B parameters), where CPU offload was meant to keep the GPU free. Passing
    the model only when the recipe defers the reduction gives one rank what several get."""
    return accelerator.accumulate(*(() if settings.reduce_every_micro_step.value else (model,)))


def gradient_accumulation_plugin(settings: FsdpSettings, steps: int):
    """`sync_each_batch=True`: reduce-scatter after every micro-step. Without it, `accumulate()` runs the
    non-final micro-steps under no_sync, where FSDP2 keeps each unit's unsharded gradient, upcast to the fp32
    reduce dtype, until the last micro-step (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py,
    post_backward, checked with torch 2.13.0): a whole fp32 model of gradients on every rank."""
    from accelerate.utils import GradientAccumulationPlugin

    return GradientAccumulationPlugin(num_steps=steps, sync_each_batch=bool(settings.reduce_every_micro_step.value),
                                      sync_with_dataloader=False)


def apply_activation_checkpointing(model, settings: FsdpSettings, *, preserve_rng_state: bool = True):
    """Wrap every FSDP unit class (the wrap classes) in a non-reentrant checkpoint that restores the RNG state
    for the recompute, so dropout draws the same masks as in the forward. Only for FSDP2 (before `prepare`,
    in the order Accelerate uses: checkpoint first, then `fully_shard` of the wrapped block).
    `preserve_rng_state` False only for `verify`'s proof that its activation-checkpointing check can fail."""
    if not settings.activation_checkpointing.value or settings.fsdp_version.value != 2:
        return model
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from accelerate.utils.other import get_module_children_bottom_up
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    plugin = build_fsdp_plugin(settings, for_planning=True)
    plugin.set_auto_wrap_policy(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is None:
        return model
    for name, module in get_module_children_bottom_up(model, return_fqns=True)[:-1]:
        if policy(module):
            model.set_submodule(name, checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                         preserve_rng_state=preserve_rng_state))
    return model


def build_parallelism_config(settings: FsdpSettings):
    """Hybrid sharding under FSDP2: shard inside a group of dp_shard_size ranks, replicate across groups."""
    if settings.fsdp_version.value != 2 or settings.sharding_strategy.value != HYBRID_SHARD:
        return None
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig(dp_replicate_size=settings.dp_replicate_size.value,
                             dp_shard_size=settings.dp_shard_size.value)


def build_accelerator(settings: FsdpSettings, *, gradient_accumulation_steps: int, run_dir: Path | None,
                      trackers: list[str] = (), reduce_dtype=torch.float32, shard_cpu_ranks: bool = True):
    """The Accelerator of these settings. `reduce_dtype` and `shard_cpu_ranks` (False: what stock Accelerate does on
    CPU ranks, unsharded replicas) differ from their defaults only in `verify`'s proofs that its checks can fail."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import ProjectConfiguration

    plugin = build_fsdp_plugin(settings, reduce_dtype=reduce_dtype)
    parallelism = build_parallelism_config(settings)
    precision = ACCELERATE[settings.mixed_precision.value]
    group = process_group_kwargs(settings)
    cpu = settings.device.value == "cpu"
    if cpu and shard_cpu_ranks:
        init_cpu_fsdp_state(plugin, mixed_precision=precision, parallelism_config=parallelism, process_group=group)
    else:
        # The shared state created first, with our keyword arguments as they are; the Accelerator finds it
        # initialized and keeps it (accelerate/state.py, PartialState.__init__ returns when initialized).
        PartialState(cpu=cpu, **group)
    project = ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / LOGS_DIR)) if run_dir else None
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=precision,
        fsdp_plugin=plugin,
        parallelism_config=parallelism,
        gradient_accumulation_plugin=gradient_accumulation_plugin(settings, gradient_accumulation_steps),
        log_with=list(trackers) or None,
        project_config=project,
        # The LR scheduler is stepped by the loop once per optimizer step; it is not prepared.
        step_scheduler_with_optimizer=False,
    )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        apply_collective_timeout(group["timeout"])  # after __init__, which built the hybrid mesh's groups
    return accelerator


def expected_shards(settings: FsdpSettings) -> int:
    """Into how many pieces each rank's parameters are cut."""
    return shard_group_size(settings)
