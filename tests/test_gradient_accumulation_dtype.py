"""The dtype gradients add up in over the micro-steps of a deferred reduction (fsdp.reduce_every_micro_step false),
as the libraries do it: FSDP1 under no_sync leaves each micro-step's gradient in the unsharded flat parameter's
compute-dtype .grad (its post-backward hook returns before the cast to reduce_dtype), so under bf16 the sum is bf16;
config/settings.py `check_settings` refuses that combination for this reason (docs/ARCHITECTURE.md, reliances)."""

from __future__ import annotations

import os

import pytest
from conftest import free_port


def _fsdp1_rank(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = FullyShardedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=None),
            sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"), use_orig_params=True)
        x = torch.randn(4, 8)
        with model.no_sync():
            model(x).sum().backward()
            between = model._handle.flat_param.grad.dtype
        model(x).sum().backward()
        queue.put((rank, str(between), str(model._handle.flat_param.grad.dtype)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp1_adds_the_micro_steps_gradients_up_in_bf16_under_no_sync():
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(_fsdp1_rank, args=(free_port(), queue), nprocs=2, start_method="spawn")
    results = sorted(queue.get() for _ in range(2))
    # between micro-steps the unsharded bf16 gradient; the reduced shard the optimizer sees is fp32
    assert results == [(0, "torch.bfloat16", "torch.float32"), (1, "torch.bfloat16", "torch.float32")]
