"""Real FSDP sharding on CPU ranks (gloo), through Accelerate's own FSDP path.

Why this exists: Accelerate 1.x only turns on FSDP for accelerator devices. Under `accelerate launch` with an
FSDP config and no GPU, its `AcceleratorState` comes up as MULTI_CPU (or as a single process) and `prepare`
returns an unsharded replica on every rank: the run "works" and shards nothing. PyTorch's FSDP2 (and FSDP1
with a CPU `device_id`) works fine on CPU over gloo, so we create the state on CPU ourselves and mark it FSDP
before the `Accelerator` reads it. From then on Accelerate's regular FSDP code runs unchanged: `prepare`
applies `fully_shard`, `accumulate`, `clip_grad_norm_`, `save_state`/`load_state` and `get_state_dict` work.

What it touches (Accelerate internals, checked with accelerate 1.15.0 and torch 2.13.0):
  * `PartialState(cpu=True)` creates the gloo process group;
  * `AcceleratorState` is created first with our plugin, then its (shared) `distributed_type` is set to FSDP
    and `fsdp_plugin` to the plugin: the `Accelerator` built afterwards finds the state initialized and keeps
    it (a parallelism config for hybrid sharding is validated against it, so this must come first);
  * the device is set to `cpu` without an index, because FSDP1 compares it with the module's device.

It must never be used when a GPU is in use, and `check_sharded` guards the result: if a future Accelerate
stops honouring the state, training stops with a message instead of silently running unsharded replicas.
tests/test_training.py::test_tiny_gpt2_trains_and_each_rank_holds_only_its_shard fails the day this stops
sharding.
"""

from __future__ import annotations

import torch

from accel_fsdp.config.precision import ACCELERATE

CHECKED_WITH = "accelerate 1.15.0, torch 2.13.0"


def init_cpu_fsdp_state(plugin, *, mixed_precision: str, parallelism_config=None,
                        process_group: dict | None = None) -> None:
    """Create Accelerate's shared state for FSDP on CPU ranks. Call before constructing the `Accelerator`.
    `process_group`: keyword arguments of init_process_group (the gloo backend and the collective timeout)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, TorchDynamoPlugin

    PartialState(cpu=True, **(process_group or {}))
    state = AcceleratorState(cpu=True, mixed_precision=mixed_precision, fsdp_plugin=plugin,
                             parallelism_config=parallelism_config, dynamo_plugin=TorchDynamoPlugin(),
                             _from_accelerator=True)
    partial = PartialState()
    for s in (partial, state):
        s.distributed_type = DistributedType.FSDP
        s.device = torch.device("cpu")
    state.fsdp_plugin = plugin
    # What AcceleratorState does for FSDP on accelerators: fill in the plugin's mixed precision policy
    # (kept as is when we passed one).
    if mixed_precision != ACCELERATE["fp32"]:  # Accelerate's name for full precision
        plugin.set_mixed_precision(mixed_precision)


def check_sharded(accelerator, model: torch.nn.Module, total: int, expected_shards: int) -> None:
    """Fail loudly if the parameters this rank holds are not about 1/expected_shards of the `total`."""
    if expected_shards <= 1:
        return
    local = local_numel(model)
    if local > total / expected_shards * 1.25 + 4096:
        on_cpu = accelerator.device.type == "cpu"
        why = (f"The installed Accelerate may have changed the internals accel_fsdp/train/cpu_fsdp.py relies on "
               f"(checked with {CHECKED_WITH})." if on_cpu else "Check the FSDP plugin Accelerate received.")
        raise RuntimeError(f"FSDP did not shard: rank {accelerator.process_index} holds {local:,} of {total:,} "
                           f"parameters (expected about {total // expected_shards:,}). {why}")


def local_numel(model: torch.nn.Module) -> int:
    """Parameter elements stored on this rank (FSDP2 DTensor shards, FSDP1 flat-parameter shards)."""
    from torch.distributed.tensor import DTensor

    n = 0
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if isinstance(p, DTensor):
            n += p.to_local().numel()
        else:
            n += p.numel()
    return n
