"""The CPU-offloaded optimizer step: AdamW on FSDP2 shards held in host memory, as a GPU rank under CPU offload runs
it (and every CPU rank), timed for the default foreach kernel and the fused one, with one thread (what torchrun
gives each rank: OMP_NUM_THREADS=1) and with the rank's share of the cores (what accel-fsdp now sets).

    torchrun --nproc_per_node 2 benchmarks/offload_optimizer_step.py [--params 50e6] [--steps 20]

Prints the median milliseconds per optimizer step for each variant, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=50e6, help="model parameters (split into 1024-wide layers)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    layers = max(1, int(args.params // (1024 * 1024)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    model(torch.randn(4, 1024)).sum().backward()
    share = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    results = []
    for threads in sorted({1, share}):
        torch.set_num_threads(threads)
        for fused in (False, True):
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
            optimizer.step()  # allocate the state
            times = []
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                optimizer.step()
                times.append(time.perf_counter() - start)
            results.append((threads, "fused" if fused else "foreach", 1000 * statistics.median(times)))
    if rank == 0:
        print(f"AdamW step on {layers * 1024 * 1024 / 1e6:.0f}M parameters sharded over {world} CPU-offloaded ranks "
              f"({torch.__version__}), median of {args.steps} steps:")
        baseline = results[0][2]
        for threads, kind, ms in results:
            print(f"  {threads} thread(s) per rank, {kind:<7} {ms:8.1f} ms   "
                  f"({baseline / ms:.1f}x the 1-thread foreach)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
