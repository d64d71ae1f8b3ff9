"""Activation offloading (`training.activation_offload`): the tensors autograd saves in a forward for its backward go
to host memory as they are saved, and come back when the backward needs them. Exact: a saved tensor is copied, byte
for byte, and the backward reads the copy.

The design is torchtune's `OffloadActivations` (torchtune/training/_activation_offloading.py), simplified:
  * autograd's saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks) around each micro-step's forward: `pack`
    copies a tensor to host memory and returns a handle, `unpack` brings it back;
  * on a GPU the host buffers are pinned and the copies run on a side stream, so they overlap the compute; the device
    memory of a saved tensor is released only once its copy has read it (`record_stream`), and when the backward
    brings a tensor back it starts bringing back the next ones it will need (PREFETCH), whose memory the compute
    stream then owns;
  * with activation checkpointing, a checkpointed block saves nothing through these hooks but its inputs
    (torch.utils.checkpoint's non-reentrant `_NoopSaveInputs` saves them for the recompute; what the block saves
    inside goes to the checkpoint's own hooks): only the blocks' inputs move;
  * some tensors stay where they are (`kept_because`): parameters and their views (FSDP frees and gathers them again
    itself, and they are no activation), tensor subclasses (DTensor, float8, NF4: their data is not one dense
    buffer), tensors not on the device, not dense (expanded views), or too small to be worth a copy.
No saved tensor is written in place after the forward saved it (autograd would refuse the backward otherwise), so a
copy taken on the side stream after the compute stream's work so far reads what autograd saved.

On CPU ranks the activations are in host memory already: the same hooks copy them (to exercise the path; no memory is
saved), with no stream and nothing pinned (`transfer_plan`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

PREFETCH = 2
"""Offloaded tensors brought back ahead of the backward's need, on a GPU."""


@dataclass(frozen=True)
class TransferPlan:
    """How saved tensors move for one device type: the decisions `transfer_plan` makes."""

    side_stream: bool
    """Copies on a stream of their own, overlapping the compute."""
    pinned: bool
    """Host buffers in page-locked memory (a copy from pageable memory makes the host wait)."""
    min_bytes: int
    """Smaller tensors stay: a copy costs a launch and a transfer's latency (about 10 us for 256 KiB over PCIe 4)."""
    prefetch: int
    """Tensors brought back ahead of the backward's need."""


def transfer_plan(device_type: str) -> TransferPlan:
    """On a GPU: pinned buffers, a side stream, tensors of 256 KiB and more, PREFETCH ahead. On CPU ranks: host to
    host copies of every tensor of 1 KiB and more (the path runs; it saves nothing there)."""
    if device_type == "cuda":
        return TransferPlan(side_stream=True, pinned=True, min_bytes=256 << 10, prefetch=PREFETCH)
    return TransferPlan(side_stream=False, pinned=False, min_bytes=1 << 10, prefetch=0)


def kept_because(tensor: torch.Tensor, device_type: str, min_bytes: int) -> str | None:
    """Why a saved tensor stays where it is, or None: it is offloaded."""
    if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
        return "a parameter or a view of one"
    if type(tensor) is not torch.Tensor:
        return "a tensor subclass"
    if tensor.device.type != device_type:
        return "not on the device"
    if tensor.layout != torch.strided or torch.empty_like(tensor, device="meta").stride() != tensor.stride():
        return "not dense"  # empty_like keeps the strides of exactly the dense, non-overlapping tensors
    if tensor.numel() * tensor.element_size() < min_bytes:
        return "small"
    return None


class ActivationOffload:
    """The saved-tensor hooks of one rank (`saving()` around a forward), and what they hold in host memory."""

    def __init__(self, device: torch.device, plan: TransferPlan | None = None, *, host_dtype=None):
        self.device = device
        self.host_dtype = host_dtype
        """None: the saved tensor's own dtype; another only for `verify`'s proof that its check can fail."""
        self.plan = plan or transfer_plan(device.type)
        self.stream = torch.cuda.Stream(device) if self.plan.side_stream else None
        self.on_host = 0
        """Bytes offloaded now: saved, not yet brought back."""
        self.peak_on_host = 0
        """The most bytes offloaded at once."""
        self._order: list[weakref.ref] = []
        self._backward_began = False

    def saving(self):
        """The context of a forward whose saved tensors are offloaded."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        if kept_because(tensor, self.device.type, self.plan.min_bytes):
            return tensor
        if self._backward_began:  # a new forward: the last backward's order is done with
            self._order, self._backward_began = [], False
        saved = _Offloaded(tensor, self, len(self._order))
        self._order.append(weakref.ref(saved))
        self.on_host += saved.nbytes
        self.peak_on_host = max(self.peak_on_host, self.on_host)
        return saved

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        self._backward_began = True
        tensor = saved.bring_back()
        if not saved.returned:  # a backward may read a saved tensor twice (ctx.saved_tensors twice): counted once
            saved.returned = True
            self.on_host -= saved.nbytes
        for index in range(saved.index - 1, max(-1, saved.index - 1 - self.plan.prefetch), -1):
            earlier = self._order[index]() if index < len(self._order) else None
            if earlier is not None:
                earlier.fetch()
        return tensor


class _Offloaded:
    """A saved tensor's copy in host memory (the handle autograd keeps until the backward unpacks it)."""

    __slots__ = ("host", "nbytes", "index", "owner", "fetched", "ready", "returned", "__weakref__")

    def __init__(self, tensor: torch.Tensor, owner: ActivationOffload, index: int):
        self.owner, self.index, self.fetched, self.ready, self.returned = owner, index, None, None, False
        self.nbytes = tensor.numel() * tensor.element_size()
        stream = owner.stream
        if stream is None:
            self.host = torch.empty_like(tensor, device="cpu", dtype=owner.host_dtype or tensor.dtype)
            self.host.copy_(tensor)
            if owner.host_dtype is not None:
                self.host = self.host.to(tensor.dtype)
            return
        stream.wait_stream(torch.cuda.current_stream(owner.device))  # after the compute that wrote the tensor
        with torch.cuda.stream(stream):
            self.host = torch.empty_like(tensor, device="cpu", pin_memory=owner.plan.pinned)
            self.host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its memory is not handed out again before the copy has read it

    def fetch(self) -> None:
        """Start bringing the tensor back (on a GPU; asynchronous on the side stream)."""
        stream = self.owner.stream
        if stream is None or self.fetched is not None:
            return
        with torch.cuda.stream(stream):
            self.fetched = self.host.to(self.owner.device, non_blocking=True)
            self.ready = stream.record_event()

    def bring_back(self) -> torch.Tensor:
        """The tensor on the device, ready for the compute stream. The host copy stays until autograd drops this
        handle (after the node's backward): a second read brings it back again."""
        stream = self.owner.stream
        if stream is None:
            return self.host
        self.fetch()
        compute = torch.cuda.current_stream(self.owner.device)
        compute.wait_event(self.ready)
        tensor, self.fetched = self.fetched, None
        tensor.record_stream(compute)  # made on the side stream, used and freed on the compute stream
        return tensor
