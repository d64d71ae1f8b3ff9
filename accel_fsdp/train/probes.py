"""Measurements of a run's internals, for tests and `accel-fsdp verify` (asked for through train/hooks.py).

  grad-bytes  before every forward of the training loop, the bytes of gradients this rank holds (its gradient
              shards, plus any unsharded gradient FSDP keeps between micro-steps when the reduction is deferred),
              one JSON line per forward in <run>/trace/grad-bytes-rank<R>.jsonl.
  dtypes      what this rank holds and computes in: dtypes of its trainable and frozen parameter shards, of the
              weight a linear layer really multiplies with in the first forward, and the dtype FSDP reduces
              gradients in; <run>/trace/dtypes-rank<R>.json.

Probes hook into the model (forward pre-hooks); the training loop does not know about them. Not asked for, this
module does nothing and never changes results. It reads FSDP2 internals (FSDPParam.unsharded_accumulated_grad,
checked with torch 2.13.0) and only measures.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

PROBES = ("grad-bytes", "dtypes")


def install(model: torch.nn.Module, folder: Path, rank: int, names: frozenset[str]) -> None:
    """Attach the probes `names` to the prepared model."""
    if "grad-bytes" in names:
        folder.mkdir(parents=True, exist_ok=True)
        out = (folder / f"grad-bytes-rank{rank}.jsonl").open("a")

        def record(module, args):
            if module.training and torch.is_grad_enabled():
                out.write(json.dumps({"bytes": held_gradient_bytes(model)}) + "\n")
                out.flush()

        model.register_forward_pre_hook(record)
    if "dtypes" in names:
        folder.mkdir(parents=True, exist_ok=True)
        _record_dtypes(model, folder / f"dtypes-rank{rank}.json")


def _record_dtypes(model: torch.nn.Module, path: Path) -> None:
    """At the first forward of the first linear layer (FSDP2 sets its dtypes up lazily, at the first forward)."""
    from torch.distributed.tensor import DTensor

    held = {"trainable": sorted({str(p.dtype) for p in model.parameters() if p.requires_grad}),
            "frozen": sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad})}
    linear = next((m for m in model.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"),
                  None)

    def seen(module, args):  # the weight as the layer multiplies with it: gathered and cast by FSDP
        weight = module.weight
        held["compute"] = str((weight.to_local() if isinstance(weight, DTensor) else weight).dtype)
        held["reduce"] = sorted(_reduce_dtypes(model))
        path.write_text(json.dumps(held))
        handle.remove()

    if linear is not None:
        handle = linear.register_forward_pre_hook(seen)


def _reduce_dtypes(model: torch.nn.Module) -> set[str]:
    """The dtype(s) gradients are reduced in: FSDP2's per-unit mixed precision policy (None: the parameter's own
    dtype), FSDP1's MixedPrecision."""
    out = set()
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None:
                continue
            for fsdp_param in group.fsdp_params:
                if not hasattr(fsdp_param, "orig_dtype"):
                    continue  # not set up yet (FSDP2 does it at the first forward)
                # None means "no cast": gradients are reduced in the dtype they are computed in (param_dtype,
                # else the parameter's own), torch/distributed/fsdp/_fully_shard/_fsdp_param.py init_dtype_attrs.
                reduce = fsdp_param.reduce_dtype or fsdp_param.param_dtype or fsdp_param.orig_dtype
                out.add(str(reduce))
        elif type(module).__name__ == "FullyShardedDataParallel":
            mp = getattr(module, "mixed_precision", None)
            out.add(str(getattr(mp, "reduce_dtype", None) or torch.float32))
    return out


def held_gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of gradient storage this rank holds now: `.grad` of every parameter (local shards of DTensors) and
    the unsharded gradients FSDP2 accumulates under no_sync (in the reduce dtype)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0

    def add(t):
        nonlocal total
        if t is None:
            return
        t = t.to_local() if isinstance(t, DTensor) else t
        if t.numel() == 0 or t.data_ptr() in seen:
            return
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p.grad)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return total
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            add(fsdp_param.unsharded_accumulated_grad)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            add(unsharded.grad if unsharded is not None else None)
    return total
