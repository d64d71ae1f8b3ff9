"""Measurements of a run's internals, for tests and `accel-fsdp verify` (asked for through train/hooks.py).

  grad-bytes  before every forward of the training loop, the bytes of gradients this rank holds (its gradient
              shards, plus any unsharded gradient FSDP keeps between micro-steps when the reduction is deferred;
              "unsharded": those alone), one JSON line per forward in <run>/trace/grad-bytes-rank<R>.jsonl.
  dtypes      what this rank holds and computes in: dtypes of its trainable and frozen parameter shards, of the
              weight a linear layer really multiplies with in the first forward, and the dtype FSDP reduces
              gradients in; <run>/trace/dtypes-rank<R>.json.
  data        before the first step, the run's own sampler drawn for many steps (at least 100, and two epochs
              of the largest source, up to 200,000 units): each unit read once per epoch of its source, and the
              largest difference between a source's share over any 100 consecutive steps and its weight;
              <run>/trace/data-rank<R>.json.
  packing     before the first step, a micro-batch of packed training sequences laid out by the run's own collate
              (its attention kernel's layout) against each of their documents run alone: the largest logit
              difference, relative to the logit scale; <run>/trace/packing-rank<R>.json.
  knobs       after every optimizer step, what the knobs did so far (train/knobs.py): the compiler's graphs, graph
              breaks and cache hits of this process, the most bytes activation offloading held in host memory at
              once; one JSON line per step in <run>/trace/knobs-rank<R>.jsonl.

Probes hook into the model (forward pre-hooks); the training loop does not know about them. Not asked for, this
module does nothing and never changes results. It reads FSDP2 internals (FSDPParam.unsharded_accumulated_grad,
checked with torch 2.13.0) and only measures.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from accel_fsdp.data.store import Sequence
from accel_fsdp.files import write_atomic
from accel_fsdp.model.compile import compile_statistics

PROBES = ("grad-bytes", "dtypes", "packing", "data", "knobs")
SHARE_WINDOW = 100
"""Optimizer steps over which the data probe measures each source's share."""


def install(model: torch.nn.Module, folder: Path, rank: int, names: frozenset[str]) -> None:
    """Attach the probes `names` to the sharded model."""
    if "grad-bytes" in names:
        folder.mkdir(parents=True, exist_ok=True)
        out = (folder / f"grad-bytes-rank{rank}.jsonl").open("a")

        def record(module, args):
            if module.training and torch.is_grad_enabled():
                out.write(json.dumps({"bytes": held_gradient_bytes(model),
                                      "unsharded": held_gradient_bytes(model, unsharded_only=True)}) + "\n")
                out.flush()

        model.register_forward_pre_hook(record)
    if "dtypes" in names:
        folder.mkdir(parents=True, exist_ok=True)
        _record_dtypes(model, folder / f"dtypes-rank{rank}.json")


def packing(model, accelerator, data, collate, batch_layout: str, path: Path, *, documents: int = 8) -> None:
    """Collective: every rank runs the same forwards (FSDP gathers each unit for every one). The documents are cut
    where the data says they start (the table's positions), never where the batch's positions say: a batch that
    does not keep them apart must fail this."""
    sequences, found = [], 0
    for sequence in (s for unit in range(min(len(data), 256)) for s in data.sequences(unit)):
        count = int((sequence.positions == 0).sum())
        if count > 1 or len(sequences) < 2:
            sequences.append(sequence)
            found += count
        if found >= documents and len(sequences) >= 2:
            break
    model.eval()
    worst, checked = 0.0, 0
    with torch.no_grad(), accelerator.autocast():
        batch = collate(sequences)
        batch.pop("labels")
        logits = model(**batch, use_cache=False).logits.float()
        flat = "cu_seq_lens_q" in batch
        offset = 0
        for r, sequence in enumerate(sequences):
            starts = [int(i) for i in (sequence.positions == 0).nonzero()[0]] + [len(sequence)]
            for a, b in zip(starts, starts[1:]):
                ids = sequence.ids[a:b]
                alone = collate([Sequence(ids, ids, np.arange(b - a, dtype=np.int64))])
                alone.pop("labels")
                reference = model(**alone, use_cache=False).logits.float()[0, :b - a]
                packed = logits[0, offset + a:offset + b] if flat else logits[r, a:b]
                worst = max(worst, float((packed - reference).abs().max() / reference.abs().max().clamp(min=1e-6)))
                checked += 1
            offset += len(sequence)
    model.train()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"documents": checked, "sequences": len(sequences), "relative_difference": worst,
                                   "layout": batch_layout,
                                   "attention": getattr(accelerator.unwrap_model(model).config,
                                                     "_attn_implementation", None)}))


def data_order(sampler, path: Path, *, max_units: int = 200_000) -> None:
    """Draw the sampler's global batches from step 0 (it replays from there when training asks for its first
    step) and record what a mixture promises: no unit twice in an epoch of its source, every unit of a finished epoch
    read, and the lowest and highest share of the cost (loss-carrying tokens, or units) each source has over any
    window of steps (the caller compares them with the recipe's weights)."""
    global_batch, sizes = len(sampler.global_sequences(0)), sampler.sizes
    steps = max(SHARE_WINDOW, math.ceil(2 * max(sizes) / global_batch))
    steps = min(steps, max(SHARE_WINDOW, max_units // global_batch))
    k = len(sizes)
    cost = np.zeros((steps, k), dtype=np.float64)
    seen = [np.zeros(n, bool) for n in sizes]
    drawn = [0] * k
    repeats = missing = epochs = 0
    for step in range(steps):
        for unit in sampler.global_sequences(step):
            i, j = sampler.split(unit)
            if seen[i][j]:
                repeats += 1
            seen[i][j] = True
            drawn[i] += 1
            cost[step, i] += sampler.cost(i, j)
            if drawn[i] % sizes[i] == 0:  # an epoch of source i is complete: every unit read
                missing += int((~seen[i]).sum())
                seen[i][:] = False
                epochs += 1
    window = min(SHARE_WINDOW, steps)
    sums = np.cumsum(np.concatenate([np.zeros((1, k)), cost]), axis=0)
    totals = sums[window:] - sums[:-window]
    shares = totals / np.maximum(totals.sum(axis=1, keepdims=True), 1e-12)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"steps": steps, "units": steps * global_batch, "epochs_completed": epochs,
                                   "repeats": repeats, "missing": missing, "window": window,
                                "share_range": [[float(shares[:, i].min()), float(shares[:, i].max())]
                                                for i in range(k)],
                                "by_cost": any(c is not None for c in sampler.costs)}))


def knob_record(knobs, step: int) -> dict:
    """The `knobs` probe's line after optimizer step `step`."""
    record = {"step": step}
    if knobs.compiled is not None:
        record["compile"] = compile_statistics()
    if knobs.offload is not None:
        record["offload_peak_bytes"] = knobs.offload.peak_on_host
        record["offload_held_bytes"] = knobs.offload.on_host
    return record


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
        write_atomic(path, json.dumps(held))
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


def held_gradient_bytes(model: torch.nn.Module, *, unsharded_only: bool = False) -> int:
    """Bytes of gradient storage this rank holds now: `.grad` of every parameter (local shards of DTensors) and
    the unsharded gradients FSDP2 accumulates under no_sync (in the reduce dtype); `unsharded_only`: those alone
    (with one rank a shard is the whole tensor, so only where it is kept tells a deferred reduction apart)."""
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
        if not unsharded_only:
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
