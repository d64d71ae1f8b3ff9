"""What each rank holds: the record written to `<run>/sharding.json`, read by `bench`, `verify` and the tests.

One typed record, measured in three moments (after `prepare`, at the first optimizer step when gradients and
optimizer state both exist, after training) and written whole by the main process each time it grows.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from accel_fsdp.errors import Problem, UserError
from accel_fsdp.files import write_atomic
from accel_fsdp.layout import CACHE_ENV
from accel_fsdp.model.build import layout_differences, layout_of
from accel_fsdp.model.nf4 import NF4_PARTS, held_bytes, is_nf4, nf4_local_bytes, nf4_whole_bytes
from accel_fsdp.train.accelerator import expected_shards
from accel_fsdp.train.cpu_fsdp import local_numel


@dataclass
class ShardingRecord:
    parameters: int
    """Parameters of the whole model."""
    local_parameters: list[int]
    """Parameters each rank holds after `prepare` (its shards), in rank order."""
    expected_shards: int
    strategy: str
    ranks: list[dict]
    """Per rank: its (replica, shard) coordinates and a checksum of what it holds."""
    rank0_only_loading: bool
    loading_peak_rss_growth_bytes: list[int]
    """Per rank: peak resident-memory growth while the weights were loaded and sharded."""
    process_group: dict
    """The backends and collective timeout the default process group really has."""
    state_bytes: list[dict] | None = None
    """Per rank, at the first optimizer step: bytes of parameters, gradients, optimizer state, frozen parameters."""
    ranks_after_training: list[dict] | None = field(default=None)
    """`ranks` again after training: replicas must still agree."""
    weight_bytes: list[int] | None = None
    """Per rank, after `prepare`: bytes of the parameters it holds (its shards; 4-bit weights at their real size)."""
    quantized_bytes: list[int] | None = None
    """Per rank: bytes of the 4-bit weights it holds, codes and scales (model.quantize; 1/W of them each)."""
    quantized_whole_bytes: int | None = None
    """Bytes of one copy of the 4-bit weights' codes and scales: each rank of a shard group holds 1/expected_shards
    of them (`verify` checks it)."""
    quantized_base: dict | None = None
    """What the 4-bit base is (model/quantize.py QuantizedBase: method, layers, fingerprint)."""
    loading_rss_baseline_bytes: list[int] | None = None
    """Per rank: resident memory when the loading began (a machine's growth while loading is its ranks' sampled
    sum less these: benchmarks/loading_memory.py)."""

    @classmethod
    def measure(cls, acc, built, settings) -> ShardingRecord:
        """After `prepare` (collective: every rank calls it)."""
        shards = shard_layout(acc, built.model)
        quantized, other = nf4_local_bytes(built.model)
        held = gather_ints(acc, [quantized, other])
        return cls(parameters=built.parameters, local_parameters=[int(row[0]) for row in shards],
                   expected_shards=expected_shards(settings), strategy=settings.sharding_strategy.value,
                   ranks=layout_rows(shards), rank0_only_loading=built.rank0_only_loading,
                   loading_peak_rss_growth_bytes=gather_ints(acc, [built.loading_growth]),
                   process_group=process_group_record(),
                   loading_rss_baseline_bytes=gather_ints(acc, [built.loading_baseline]),
                   weight_bytes=[q + o for q, o in zip(held[::2], held[1::2])],
                   quantized_bytes=held[::2] if built.quantized_base is not None else None,
                   quantized_whole_bytes=nf4_whole_bytes(built.model) if built.quantized_base is not None else None,
                   quantized_base=built.quantized_base.to_dict() if built.quantized_base is not None else None)

    def record_state_bytes(self, per_rank: list[dict]) -> None:
        """What each rank stores at the first optimizer step (train/hooks.py measures it inside that step)."""
        self.state_bytes = per_rank

    def measure_after_training(self, acc, model) -> None:
        """Where every rank stands after training (collective)."""
        self.ranks_after_training = layout_rows(shard_layout(acc, model))

    @classmethod
    def read(cls, path: Path) -> ShardingRecord | None:
        """The record a run wrote (None when it wrote none yet)."""
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def model_state_bytes(self) -> list[int]:
        """Per rank, at the first optimizer step: parameters, gradients and optimizer state it stores, frozen
        parameters included (what the memory estimate predicts)."""
        kinds = ("params", "grads", "optimizer", "frozen_params")
        return [sum(r.get(k, 0) for k in kinds) for r in self.state_bytes or []]

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def write(self, path: Path) -> None:
        write_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")


def layout_rows(layout: list[list[float]]) -> list[dict]:
    return [{"rank": r, "replica": int(row[2]), "shard": int(row[3]), "checksum": row[1]}
            for r, row in enumerate(layout)]


SUM_BLOCK = 2**18
"""Elements summed at once in float64 by `local_sum`: 2 MiB (every rank sums at once, right after loading: at 8 MiB
a block the 355M GPT-2 with a 4-bit base on 4 ranks peaked at 1.24 x one copy, against 1.21 x at this size;
benchmarks/loading_memory.py samples until sharding.json is written)."""


def local_sum(tensor: torch.Tensor) -> float:
    """The sum of a tensor in float64, a block of SUM_BLOCK elements at a time: torch's CPU sum with a wider dtype
    first casts the whole input to it (aten/src/ATen/native/ReduceOps.cpp, make_reduction_from_out_ty), and a whole
    float64 copy of the embeddings' shard (196 MiB on each of 2 ranks of the 355M GPT-2) was the machine's peak just
    after streaming loading. A 4-bit weight's shard is summed by what it stores, its codes and scales (those of its
    rows: the mean, on every rank, is left out), never dequantized: that made a float64 copy of a projection's shard
    and torchao's int64 codes on every rank at once, the machine's peak after 4-bit loading."""
    tensor = tensor.detach()
    if is_nf4(tensor):
        return sum(local_sum(getattr(tensor, part)) for part in NF4_PARTS)
    if not tensor.is_contiguous():
        return float(tensor.double().sum())
    return sum(float(block.double().sum()) for block in tensor.reshape(-1).split(SUM_BLOCK))


def shard_layout(acc, model) -> list[list[float]]:
    """Per rank: parameters held, a checksum of them, and its (replica, shard) coordinates in the device mesh.
    Replicas of one shard hold identical values; the ranks of a shard group hold different pieces."""
    checksum = sum(local_sum(p.to_local() if isinstance(p, DTensor) else p) for p in model.parameters())
    mesh = getattr(acc, "torch_device_mesh", None)
    if mesh is not None and "dp_replicate" in (mesh.mesh_dim_names or ()):
        coordinate = mesh.get_coordinate()
        names = list(mesh.mesh_dim_names)
        replica, shard = coordinate[names.index("dp_replicate")], coordinate[names.index("dp_shard")]
    else:
        replica, shard = 0, acc.process_index
    mine = torch.tensor([local_numel(model), checksum, replica, shard], device=acc.device, dtype=torch.float64)
    return acc.gather(mine).view(acc.num_processes, 4).tolist()


def state_bytes(optimizer) -> dict[str, int]:
    """Bytes this rank stores for the parameters the optimizer updates, their gradients and the optimizer state
    (local shards only), plus frozen parameters: what the memory estimate predicts per rank."""
    def local(t) -> int:
        if t is None or not isinstance(t, torch.Tensor):
            return 0
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    out = {"params": 0, "grads": 0, "optimizer": 0}
    for group in optimizer.param_groups:
        for p in group["params"]:
            out["params"] += local(p)
            out["grads"] += local(p.grad)
            out["optimizer"] += sum(local(v) for v in optimizer.state.get(p, {}).values() if getattr(v, "ndim", 0))
    return out


def gathered_state_bytes(acc, model, optimizer) -> list[dict]:
    """`state_bytes` of every rank plus its frozen parameters (collective)."""
    mine = state_bytes(optimizer)
    trainable = {id(p) for g in optimizer.param_groups for p in g["params"]}
    mine["frozen_params"] = sum(held_bytes(p) for p in model.parameters() if id(p) not in trainable)
    keys = sorted(mine)
    gathered = acc.gather(torch.tensor([mine[k] for k in keys], device=acc.device, dtype=torch.int64))
    return [dict(zip(keys, row)) for row in gathered.view(acc.num_processes, len(keys)).tolist()]


def check_same_data(acc, data) -> None:
    """Collective: every rank trains on the same data. Each machine prepares its own, by its first rank from its own
    cache: a data file on each machine's own disk whose copies differ, or caches per machine built from different
    files, gave the ranks different sequences silently, and different numbers of them: different step counts, a
    rank waiting at the end for ranks that had stopped."""
    if acc.num_processes == 1:
        return
    every = gather_ints(acc, [data.content_digest(), len(data)])
    digests, units = every[0::2], every[1::2]
    if len(set(digests)) == 1:
        return
    groups: dict[int, list[int]] = {}
    for rank, digest in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
    read = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {units[ranks[0]]:,} training "
                     "units" for ranks in groups.values())
    raise UserError(Problem("data", f"the machines prepared different data ({read}, differing in count or content)",
                            "give every machine the same data: data.path on a filesystem every machine sees (or "
                            f"identical copies), and a cache ({CACHE_ENV}) built from them (a tokenizer made on each "
                            "machine, bpe:N, is made from the data and kept there too)"))


def gather_ints(acc, values: list[int]) -> list[int]:
    """`values` of every rank, concatenated in rank order (collective: every rank calls it)."""
    mine = torch.tensor(values, device=acc.device, dtype=torch.int64)
    return [int(x) for x in acc.gather(mine).tolist()]


def process_group_record() -> dict:
    """The backends and collective timeout the default process group really has (private c10d fields, read for
    the record only: torch 2.13.0 keeps them in _world.pg_backend_config and each backend's options)."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    group = c10d._get_default_group()
    record: dict = {"world_size": dist.get_world_size()}
    try:
        record["backends"] = c10d._world.pg_backend_config[group]
        record["timeout_s"] = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        # every group of this rank (hybrid sharding's mesh groups, the preemption flag's): each one's gloo timeout
        record["group_timeouts_s"] = {getattr(g, "group_desc", "") or c10d._world.pg_names.get(g, "?"):
                                      g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                                      for g in c10d._world.pg_map}
    except (AttributeError, KeyError, RuntimeError):
        record["backends"] = str(dist.get_backend())
    return record


def check_same_layout(accelerator, model, recipe) -> None:
    """Collective (every rank), before any weight is sent: with rank-0-only loading, rank 0 reads the weights
    (from_pretrained) and the others build the model from its config, and Accelerate's broadcast pairs rank 0's
    tensors with each rank's own in state-dict order, trusting shapes and dtypes to agree (accelerate/utils/
    fsdp_utils.py, fsdp2_load_full_state_dict; FSDP1's sync_module_states likewise; 1.15.0). They may not: modules
    from_pretrained keeps in fp32 (_keep_in_fp32_modules_strict) under a bf16 LoRA base, embeddings a checkpoint
    stores untied. A mismatched broadcast aborts a rank inside gloo or hangs NCCL; here every rank raises the same
    message instead."""
    from accelerate.utils import broadcast_object_list, gather_object

    box = [layout_of(model) if accelerator.is_main_process else None]
    broadcast_object_list(box, from_process=0)
    every = gather_object([layout_differences(box[0], layout_of(model))])
    bad = [(rank, d) for rank, d in enumerate(every) if d]
    if bad:
        rank, differences = bad[0]
        raise UserError(Problem(recipe.where("model.name_or_path"),
                                f"with fsdp_cpu_ram_efficient_loading rank 0 reads the weights and the other ranks "
                                f"build the model from its config, and they differ (rank {rank}, {len(bad)} rank(s) in "
                                f"all): " + "; ".join(differences),
                                "set fsdp_cpu_ram_efficient_loading: false in the accelerate config (every rank reads "
                                "the weights)"))
