"""The 4-bit base in torch: torchao's NF4Tensor (torchao==0.18.0, checked with torch 2.13.0) in the layers
model/quantize.py names. A weight becomes an `NF4Linear` whose weight is an NF4Tensor; its forward is torch's Linear,
and torchao's F.linear dequantizes the weight to the compute dtype (the dtype it was quantized from: bf16, or fp32 on
CPUs without bf16) for the product and frees it again (linear_nf4), in the backward too. LoRA adapters on top train
in fp32 as with a bf16 base.

FSDP2 shards an NF4Tensor as it is: torchao's fsdp_pre_all_gather / fsdp_post_all_gather gather the codes and the
scales, never a dequantized copy, so each rank holds 1/W of the 4-bit bytes. On a one-rank mesh torch 2.13.0's FSDP2
copies only the first of a subclass's all-gather inputs (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py,
wait_for_unshard), so a one-rank run leaves the 4-bit weights out of FSDP (`unsharded_nf4`): nothing to shard there.

This module must never read weights from disk (model/build.py and model/streaming_load.py do) or talk to other ranks.
"""

from __future__ import annotations

import hashlib

import torch

from accel_fsdp.model.quantize import BLOCK_SIZE, QuantizedLayer, file_name, known_layers, nf4_bytes, scale_group

NF4_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor")
"""The inner tensors of an NF4Tensor that FSDP2 shards with its rows (torchao's _INNER_TENSOR_NAMES_FOR_SHARDING);
`scaler_mean` (one number) and `nf4` (the 16 levels) are whole on every rank."""


QUANTIZE_CHUNK = 2**16
"""Elements matched against the 16 levels at once (torchao's CHUNK_SIZE, 1M in 0.18.0, and `StreamedNF4`'s): each
chunk makes a chunk x 16 difference and its absolute value, 64 MiB in bf16 at 1M, the largest part of the reading
rank's peak while it quantizes (model/streaming_load.py); 4 MiB at this size (8 in fp32). The codes are the same:
each element's nearest level."""


def to_nf4(weight: torch.Tensor):
    """`weight` (out x in, in the compute dtype) as an NF4Tensor of the same dtype."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4 as torchao_to_nf4

    # read at each call by torchao 0.18.0's NF4Tensor.convert_to_norm_float_weight
    nf4_tensor.CHUNK_SIZE = min(nf4_tensor.CHUNK_SIZE, QUANTIZE_CHUNK)
    weight = weight.detach().contiguous()
    return torchao_to_nf4(weight, BLOCK_SIZE, scale_group(weight.numel()))


def nf4_levels(dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """torchao's 16 NormalFloat levels in `dtype`, as its to_nf4 makes them (from a one-block quantization: the
    levels are a literal inside torchao's NF4Tensor.from_tensor)."""
    return to_nf4(torch.zeros(BLOCK_SIZE, dtype=dtype)).nf4.to(device)


def streams_in_blocks(shape: tuple[int, int]) -> bool:
    """A weight of this shape (out x in) can be quantized a block of rows or of columns at a time
    (`StreamedNF4`): its rows hold whole blocks of 64. Every model we know; else it is read whole."""
    return shape[1] % BLOCK_SIZE == 0


class StreamedNF4:
    """torchao's `to_nf4` of an out x in weight, given a piece at a time, bit for bit: the same codes, scales,
    factors and mean (tests/test_streamed_quantization.py compares them). Pieces are whole rows, or whole
    columns in multiples of 64 (GPT-2's Conv1D stores the weight transposed: a block of its rows in the files is
    a block of the weight's columns).

    What makes it exact, in torchao 0.18.0's nf4_tensor.py: a 4-bit code depends on its element and its block's
    absmax alone (convert_to_norm_float_weight scales each block by its absmax, then quantize_tensor_nearest picks
    each element's nearest level: elementwise, whatever the chunks); only the scales' double quantization needs the
    whole weight (double_quantize_scalers subtracts the mean of all block absmaxes), and it needs the absmaxes
    alone, 1/64 of the weight, kept here until `finish` hands them to torchao's own double_quantize_scalers with a
    block size of 1 (each "block" one absmax: its absmax is itself), so the mean is torch's mean of the same
    tensor. Holds the packed codes (half a byte a weight) and the absmaxes, never the weight."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype):
        if not streams_in_blocks(shape):
            raise ValueError(f"a weight of {shape[0]} x {shape[1]} does not hold whole blocks of {BLOCK_SIZE} a row")
        self.shape, self.dtype = (int(shape[0]), int(shape[1])), dtype
        self.codes = torch.empty(self.shape[0], self.shape[1] // 2, dtype=torch.uint8)
        self.absmax = torch.empty(self.shape[0], self.shape[1] // BLOCK_SIZE, dtype=dtype)
        self.levels = nf4_levels(dtype)

    def add(self, rows: tuple[int, int], columns: tuple[int, int], values: torch.Tensor) -> None:
        """The weight's rows x columns (end excluded), `values` of that shape in any float dtype."""
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

        if columns[0] % BLOCK_SIZE or (columns[1] - columns[0]) % BLOCK_SIZE:
            raise ValueError(f"columns {columns} do not hold whole blocks of {BLOCK_SIZE}")
        blocks = values.detach().to(self.dtype).contiguous().view(-1, BLOCK_SIZE)
        absmax = blocks.abs().max(dim=1).values  # torchao's get_block_absmax
        scaled = (blocks / absmax.unsqueeze(-1).expand(blocks.shape)).flatten()
        del blocks
        codes = torch.empty(scaled.numel(), dtype=torch.uint8)
        for start in range(0, scaled.numel(), QUANTIZE_CHUNK):
            end = min(start + QUANTIZE_CHUNK, scaled.numel())
            codes[start:end] = NF4Tensor.quantize_tensor_nearest(scaled[start:end], self.levels).to(torch.uint8)
        del scaled
        height = rows[1] - rows[0]
        self.codes[rows[0]:rows[1], columns[0] // 2:columns[1] // 2] = (codes[::2] << 4 | codes[1::2]).view(height, -1)
        self.absmax[rows[0]:rows[1], columns[0] // BLOCK_SIZE:columns[1] // BLOCK_SIZE] = absmax.view(height, -1)

    def finish(self):
        """The NF4Tensor, once every piece was added."""
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs

        numel = self.shape[0] * self.shape[1]
        group = scale_group(numel)
        scalers, factors, mean = NF4Tensor.double_quantize_scalers(self.absmax.reshape(-1), 1, group)
        meta = SubclassTensorArgs(torch.Size(self.shape), (self.shape[1], 1), 0, self.dtype, torch.device("cpu"),
                                  False)
        return NF4Tensor(meta, BLOCK_SIZE, numel // BLOCK_SIZE, group, scalers, factors, mean,
                         self.codes.reshape(-1), self.levels)


def is_nf4(tensor) -> bool:
    """`tensor` (or a DTensor's local shard) is an NF4Tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    return type(tensor).__name__ == "NF4Tensor"


def empty_nf4(shape: tuple[int, int], dtype: torch.dtype, device="cpu"):
    """An NF4Tensor of this shape whose codes and scales are allocated but not written: a rank that receives its
    shard from the reading rank (model/streaming_load.py) builds its weights so. Untouched allocations are virtual
    (see build.py `_unwritten_parameters`): its resident memory grows only by what it is sent."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs

    numel = shape[0] * shape[1]
    blocks, group = numel // BLOCK_SIZE, scale_group(numel)
    levels = nf4_levels(dtype, device)
    meta = SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, dtype, torch.device(device), False)
    return NF4Tensor(meta, BLOCK_SIZE, blocks, group, torch.empty(blocks, dtype=torch.int8, device=device),
                     torch.empty(blocks // group, dtype=dtype, device=device), torch.zeros((), dtype=dtype,
                                                                                           device=device),
                     torch.empty(numel // 2, dtype=torch.uint8, device=device), levels)


class NF4Linear(torch.nn.Linear):
    """A frozen Linear whose weight is an NF4Tensor. `from_conv1d`: the model files hold this weight transposed
    (GPT-2's Conv1D, in x out). PEFT wraps it as the Linear it is (peft 0.21.2, tuners/lora/model.py dispatch_default:
    isinstance torch.nn.Linear)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, *, from_conv1d: bool = False):
        super().__init__(in_features, out_features, bias=bias, device="meta")
        self.from_conv1d = from_conv1d

    def extra_repr(self) -> str:
        return super().extra_repr() + ", nf4" + (", from Conv1D" if self.from_conv1d else "")


def layers_to_quantize(model: torch.nn.Module) -> list[QuantizedLayer]:
    """The Linear/Conv1D layers of the model's decoder blocks that model/facts.py names (attention and MLP
    projections), in module order, with their names in the model. Empty for a model type facts.py does not know."""
    known = known_layers(getattr(model.config, "model_type", None))
    if known is None:
        return []
    block_class, names = known
    out = []
    for block_name, block in model.named_modules():
        if type(block).__name__ != block_class:
            continue
        for name, module in block.named_modules():
            if name.rsplit(".", 1)[-1] not in names:
                continue
            if type(module).__name__ == "Conv1D":
                n_in, n_out = module.weight.shape
                out.append(QuantizedLayer(f"{block_name}.{name}", n_out, n_in, True))
            elif isinstance(module, torch.nn.Linear):
                out.append(QuantizedLayer(f"{block_name}.{name}", module.out_features, module.in_features, False))
    return out


def quantize_model(model: torch.nn.Module, dtype: torch.dtype, *, empty: bool = False) -> list[QuantizedLayer]:
    """Replace every layer of `layers_to_quantize` by an NF4Linear holding its weight in NF4, quantized from the
    weight in `dtype` (`empty`: codes not written, the weights come later: model/streaming_load.py). Biases stay in
    `dtype`, frozen like the rest of the base. Before LoRA: PEFT wraps the NF4Linear like any Linear."""
    layers = layers_to_quantize(model)
    for layer in layers:
        old = model.get_submodule(layer.name)
        new = NF4Linear(layer.in_features, layer.out_features, old.bias is not None, from_conv1d=layer.from_conv1d)
        if empty:
            weight = empty_nf4((layer.out_features, layer.in_features), dtype)
        else:
            full = old.weight.detach().to(dtype)
            weight = to_nf4(full.t() if layer.from_conv1d else full)
        new.weight = torch.nn.Parameter(weight, requires_grad=False)
        if old.bias is not None:
            new.bias = torch.nn.Parameter(old.bias.detach().to(dtype), requires_grad=False)
        model.set_submodule(layer.name, new)
    return layers


def tensor_digest(name: str, weight) -> bytes:
    """SHA-256 of one whole quantized weight: its name, shape, dtype, block sizes and every byte of its codes and
    scales."""
    digest = hashlib.sha256(f"{name} {list(weight.shape)} {weight.dtype} {weight.block_size} "
                            f"{weight.scaler_block_size}".encode())
    for part in (*NF4_PARTS, "scaler_mean"):
        tensor = getattr(weight, part).detach().cpu().contiguous().reshape(-1)
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.digest()


def digests_of(model: torch.nn.Module) -> dict[str, bytes]:
    """The digest of every whole (unsharded) 4-bit weight of a model, by file name."""
    return {file_name(n): tensor_digest(file_name(n), p) for n, p in model.named_parameters() if is_nf4(p)}


def unsharded_nf4(model: torch.nn.Module) -> set:
    """The NF4 weights a one-rank FSDP2 run leaves out of FSDP (Accelerate's ignored parameters): see the module
    docstring."""
    return {p for p in model.parameters() if is_nf4(p)}


def held_bytes(tensor) -> int:
    """Bytes a tensor (or a DTensor's local shard) really stores: an NF4Tensor's codes and scales, not its nominal
    dtype times its elements."""
    from torch.distributed.tensor import DTensor

    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    if is_nf4(local):
        return sum(getattr(local, part).numel() * getattr(local, part).element_size()
                   for part in (*NF4_PARTS, "scaler_mean"))
    return local.numel() * local.element_size()


def nf4_local_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of 4-bit weights this rank holds, bytes of every other parameter it holds): its shards' codes and
    scales (the W shards of a weight add up to it; each rank also keeps the scales' mean, one number, counted with
    the rest), and the rest of its shards."""
    from torch.distributed.tensor import DTensor

    quantized = other = 0
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = p._local_tensor if isinstance(p, DTensor) else p
        sharded = sum(getattr(local, part).numel() * getattr(local, part).element_size()
                      for part in NF4_PARTS) if is_nf4(local) else 0
        quantized += sharded
        other += held_bytes(p) - sharded
    return quantized, other


def nf4_whole_bytes(model: torch.nn.Module) -> int:
    """Bytes of the codes and scales of every whole 4-bit weight (their shards on all the ranks of a shard group add
    up to it): half a byte a weight, a byte a block, a factor per group of scales (model/quantize.py nf4_bytes, less
    the mean every rank keeps)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen and is_nf4(p):
            seen.add(id(p))
            total += nf4_bytes(p.numel(), p.element_size()) - p.element_size()
    return total
