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
  all-gathers the all-gathers this rank runs (their count and elements) from one training forward to the next, i.e.
              per micro-step (its forward and backward, and the optimizer step after the last one), one JSON line
              per training forward in <run>/trace/all-gathers-rank<R>.jsonl; the first line counts everything
              before the first forward.

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
from accel_fsdp.train.methods.logps import model_inputs

PROBES = ("grad-bytes", "dtypes", "packing", "data", "all-gathers")
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
    if "all-gathers" in names:
        folder.mkdir(parents=True, exist_ok=True)
        _count_all_gathers(model, folder / f"all-gathers-rank{rank}.jsonl")


def _count_all_gathers(model: torch.nn.Module, path: Path) -> None:
    """Wraps the collectives FSDP2 (`all_gather_single`, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py
    DefaultAllGather; torch 2.13.0) and FSDP1 (`all_gather_into_tensor`) call through `torch.distributed`'s module
    attributes, so that every all-gather of the rank is counted, whoever asks for it."""
    import torch.distributed as dist

    seen = {"all_gathers": 0, "elements": 0}
    out = path.open("a")

    def counted(collective):
        def wrapper(output_tensor, *args, **kwargs):
            seen["all_gathers"] += 1
            seen["elements"] += output_tensor.numel()
            return collective(output_tensor, *args, **kwargs)
        return wrapper

    for name in ("all_gather_single", "all_gather_into_tensor"):
        setattr(dist, name, counted(getattr(dist, name)))

    def record(module, args):
        if module.training and torch.is_grad_enabled():
            out.write(json.dumps(seen) + "\n")
            out.flush()
            seen.update(all_gathers=0, elements=0)

    model.register_forward_pre_hook(record)


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
        logits = model(**model_inputs(batch), use_cache=False).logits.float()
        flat = "cu_seq_lens_q" in batch
        offset = 0
        for r, sequence in enumerate(sequences):
            starts = [int(i) for i in (sequence.positions == 0).nonzero()[0]] + [len(sequence)]
            for a, b in zip(starts, starts[1:]):
                ids = sequence.ids[a:b]
                alone = collate([Sequence(ids, ids, np.arange(b - a, dtype=np.int64))])
                reference = model(**model_inputs(alone), use_cache=False).logits.float()[0, :b - a]
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


class PeakTensorBytes:
    """A context that measures the bytes of tensor storage created inside it and still alive, and their peak (tests and
    benchmarks/loss_memory.py: what a GPU's allocator would hold, without its caching; on CPU the process's resident
    memory also holds the allocator's free lists and the libraries). Every op's new storages are seen through a
    TorchDispatchMode (outputs that alias an input, views and in-place results, are not new); a storage's Python
    object lives as long as the storage (torch keeps it for resurrection), so a weak reference to it says when it is
    freed. Only storages created inside count: call it around a step whose resting memory is not of interest."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.live = self.peak = 0
        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._seen(args, kwargs, out)
                return out

        self.mode = Mode()
        self._alive: dict[int, object] = {}

    def _seen(self, args, kwargs, out) -> None:
        import weakref

        from torch.utils._pytree import tree_flatten

        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = id(storage), storage.nbytes()
            if key in self._alive or size == 0 or storage.data_ptr() in inputs:
                continue
            self._alive[key] = weakref.finalize(storage, self._freed, key, size)
            self.live += size
            self.peak = max(self.peak, self.live)

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._alive.pop(key, None)

    def __enter__(self) -> PeakTensorBytes:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


SYNCING_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
                         "unique_consecutive", "equal", "is_nonzero", "_assert_async"})
"""aten ops whose result a GPU must hand back to the host before Python goes on: `_local_scalar_dense` is what
`.item()`, `int(t)`, `float(t)`, `bool(t)` (an `if` on a tensor) call; the others produce a size only the device
knows."""


class HostSyncs:
    """A context that records every call inside it that would make the host wait for a GPU: the SYNCING_OPS, a
    `repeat_interleave` without `output_size`, indexing with a boolean mask (a nonzero inside the kernel), and
    `.tolist()`, `.numpy()`, `.cpu()` (not dispatched on CPU tensors, so patched on the class). It works on CPU: the
    calls are recorded whatever the device, with the line that made them. What it cannot see on CPU: a `.to("cpu")`
    or a copy to a CPU tensor (a no-op there, and `.to(device)` of a batch is legitimate)."""

    PATCHED = ("tolist", "numpy", "cpu")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.calls: list[str] = []
        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                kwargs = kwargs or {}
                masked = name in ("index", "index_put", "index_put_") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
                    if i is not None)
                if (name in SYNCING_OPS or masked
                        or (name == "repeat_interleave" and kwargs.get("output_size") is None)):
                    tracker._record(f"aten.{name}")
                return func(*args, **kwargs)

        self.mode = Mode()
        self._saved: dict[str, object] = {}

    def _record(self, what: str) -> None:
        import traceback

        here = next((f for f in reversed(traceback.extract_stack()[:-2]) if "torch/" not in f.filename), None)
        self.calls.append(what + (f" at {Path(here.filename).name}:{here.lineno} ({here.line})" if here else ""))

    def __enter__(self) -> HostSyncs:
        for name in self.PATCHED:
            original = self._saved[name] = getattr(torch.Tensor, name)

            def patched(tensor, *args, _original=original, _name=name, **kwargs):
                self._record(f"Tensor.{_name}()")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, patched)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
