"""Loading that streams: global rank 0 reads the model files a tensor, or a block of rows of a large one, at a time
and sends every rank only the shard it holds, so no rank ever holds the whole model (FSDP2 with
fsdp_cpu_ram_efficient_loading).

Every rank first builds the model without weights (allocated, never written: build.py `_unwritten_parameters`) and
lets FSDP2 shard it (`accelerator.prepare`), so each holds its shards and nothing else. Then, collectively, for each
parameter of the base in the model's order: rank 0 reads the tensor from the safetensors files with plain reads (no
memory map, whose pages would stay resident) a block of rows at a time (BLOCK_ELEMENTS), converts the block to the
parameter's dtype and sends it: each rank receives the block's rows its shard holds (replicas of a shard under
hybrid sharding the same rows) straight into the shard FSDP2 holds. A 4-bit weight is read and quantized a block
at a time too (`quantize_streamed`: the codes of a block need only its elements; the scales' double quantization
waits for all the block scales, 1/64 of the weight), then its codes and scales are sent the same way. A rank grows by
its shards; rank 0 by its shards and one block, plus one projection's codes (half a byte a weight) where the base is
4-bit. LoRA adapters are not read: the reading rank draws them (model/build.py `apply_lora`) and sends them the
same way (`stream_adapters`); the other ranks build them unwritten.

Across machines the reader is still global rank 0 alone: the ranks of the other machines receive their rows over
the network. Every rank receives its shards once whatever reads them, so the network carries (machines - 1) /
machines of one copy (35 GB of a 70B NF4 base at most: seconds on a cluster's network), and only machine 0 needs
the model files and holds a block besides its shards; a reader per machine would need the files on every machine and
a block in each, for a saving of loading time alone (tests/test_multinode.py streams a 4-bit base to a second
"machine" on loopback).

Accelerate's own rank-0 loading (accelerate/utils/fsdp_utils.py, fsdp2_prepare_model with cpu_ram_efficient_loading,
checked with 1.15.0) keeps rank 0's whole state dict while it broadcasts every full tensor to every rank, and cannot
send torchao's NF4Tensor; this replaces it for FSDP2 (train/accelerator.py leaves it off).

This module must never be called by one rank alone: every call is a collective over the default process group.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from accel_fsdp.errors import Problem, UserError
from accel_fsdp.model.nf4 import NF4_PARTS, NF4Linear, StreamedNF4, is_nf4, streams_in_blocks, tensor_digest, to_nf4
from accel_fsdp.model.quantize import BLOCK_SIZE, file_name

BLOCK_ELEMENTS = 2**19
"""The most elements of a plain tensor rank 0 reads, converts and sends at once (2 MiB in fp32, and its copy in the
compute dtype): a large tensor streams in blocks of rows, so rank 0 holds its shards and one block, not a whole
tensor (GPT-2 355M's embeddings are 51M elements, 196 MiB in fp32). 4M elements made rank 0 the machine's largest
term after the shards under a 4-bit base (16 + 8 MiB against a 255 MiB copy); the sends stay few enough (98 blocks
for those embeddings, each a few milliseconds of sending)."""

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
"""The safetensors format's dtype names (huggingface/safetensors, the format's README)."""


class SafetensorsFiles:
    """The tensors of a model folder's safetensors files (model.safetensors, or the shards named by
    model.safetensors.index.json), read one at a time: the header says where each lies, a plain read fetches it."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
                 else [f.name for f in sorted(folder.glob("*.safetensors"))])
        self.entries: dict[str, tuple[Path, str, list[int], int, int]] = {}
        for name in files:
            path = folder / name
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            for key, entry in header.items():
                if key != "__metadata__":
                    begin, end = entry["data_offsets"]
                    self.entries[key] = (path, entry["dtype"], entry["shape"], 8 + size + begin, end - begin)

    def names(self) -> set[str]:
        return set(self.entries)

    def shape(self, name: str) -> list[int]:
        return self.entries[name][2]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or with `rows` = (begin, end) those rows of it only: a plain read of their bytes (rows lie
        one after the other in the file), never the whole tensor."""
        path, dtype, shape, offset, length = self.entries[name]
        if rows is not None and shape:
            row_bytes = length // shape[0] if shape[0] else 0
            offset, length = offset + rows[0] * row_bytes, (rows[1] - rows[0]) * row_bytes
            shape = [rows[1] - rows[0], *shape[1:]]
        tensor = torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype])
        if length:
            with open(path, "rb", buffering=0) as f:
                f.seek(offset)
                f.readinto(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        return tensor


class ModuleTensors:
    """Tensors in rank 0's memory by name: a model built from scratch (there are no files to read: its state dict),
    or the LoRA adapters rank 0 drew (`adapters_to_send`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        tensor = self.tensors[name].detach()
        return tensor[rows[0]:rows[1]] if rows is not None and tensor.dim() else tensor


def model_folder(name_or_path: str) -> Path:
    """The local folder of a model: the folder itself, or the hub snapshot of its weights and config (downloaded
    once into the hub cache; offline, what the cache holds)."""
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json"]))


def base_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the model files hold, in the model's order (the same on every rank): not LoRA's, each shared
    one once."""
    return [(n, p) for n, p in model.named_parameters() if ".lora_" not in n]


def conv1d_weights(model: torch.nn.Module) -> set[str]:
    """File names of the NF4 weights the files hold transposed (GPT-2's Conv1D)."""
    return {file_name(f"{n}.weight") for n, m in model.named_modules() if isinstance(m, NF4Linear) and m.from_conv1d}


def plan_problems(model: torch.nn.Module, source, where: str,
                  block_elements: int | None = None) -> tuple[dict[str, str], list[Problem]]:
    """On the reading rank: the source name of every base parameter, and what would make the stream fail (a tensor
    the files lack or store in another shape, a tie the files break), all found before a single tensor is sent."""
    names, shapes, problems = source.names(), {}, []
    if not names and isinstance(source, SafetensorsFiles):  # e.g. a folder of pytorch_model.bin alone
        held = ", ".join(sorted(p.name for p in source.folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")))
        return {}, [Problem(where, f"rank 0 streams the weights from safetensors files, and {source.folder} has none"
                            + (f" (it holds {held})" if held else ""),
                            "set fsdp_cpu_ram_efficient_loading: false in the accelerate config (every rank reads the "
                            "weights with transformers), or save the model again as safetensors "
                            "(save_pretrained writes them)")]
    transposed = conv1d_weights(model)
    prefix = getattr(getattr(model, "get_base_model", lambda: model)(), "base_model_prefix", "") or ""
    plan: dict[str, str] = {}
    for parameter_name, parameter in base_parameters(model):
        name = file_name(parameter_name)
        found = name if name in names else name.removeprefix(prefix + ".") if prefix else name
        if found not in names:
            problems.append(f"{name}: not in the model files")
            continue
        expected = list(parameter.shape)
        if name in transposed:
            expected = expected[::-1]
        if source.shape(found) != expected:
            problems.append(f"{name}: {source.shape(found)} in the files, {expected} in the model its config builds")
        plan[parameter_name] = found
        shapes[found] = expected
    problems += tie_problems(model, source, names, block_elements or BLOCK_ELEMENTS)
    if not problems:
        return plan, []
    return plan, [Problem(where, "rank 0 streams the weights to the ranks that hold their shards, and the model files "
                          "differ from the model the config builds: " + "; ".join(problems[:5])
                          + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""),
                          "set fsdp_cpu_ram_efficient_loading: false in the accelerate config (every rank reads the "
                          "weights with transformers), or repair the model folder")]


def tie_problems(model: torch.nn.Module, source, names: set[str], block_elements: int) -> list[str]:
    """A parameter the config ties under several names (GPT-2's lm_head and wte) that the files store apart with
    other values: transformers would untie it, the stream would keep one."""
    by_object: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(parameter), []).append(file_name(name))
    out = []
    for tied in by_object.values():
        stored = [n for n in tied if n in names]
        if len(stored) > 1 and not same_values(source, stored, block_elements):
            out.append(f"tied parameters {', '.join(stored)} are stored apart with different values")
    return out


def same_values(source, names: list[str], block_elements: int) -> bool:
    """The stored tensors `names` are equal, compared a block of rows at a time (`row_blocks`)."""
    shape = source.shape(names[0])
    if any(source.shape(n) != shape for n in names[1:]):
        return False
    if not shape:
        return all(torch.equal(source.read(names[0]), source.read(n)) for n in names[1:])
    for block in row_blocks(shape[0], math.prod(shape[1:]), block_elements):
        first = source.read(names[0], block)
        if any(not torch.equal(first, source.read(n, block)) for n in names[1:]):
            return False
    return True


def shard_rows(parameter) -> tuple[int, list[int]]:
    """(shards, the shard of every global rank) of a parameter: FSDP2 cuts dim 0 into `shards` chunks of
    ceil(rows / shards) rows (torch.chunk) along the last dimension of its mesh (the shard dimension; replicas along
    the first under hybrid sharding); a parameter FSDP left whole is one shard that every rank holds."""
    from torch.distributed.tensor import DTensor, Shard

    world = dist.get_world_size() if dist.is_initialized() else 1
    if not isinstance(parameter, DTensor) or not any(isinstance(pl, Shard) for pl in parameter.placements):
        return 1, [0] * world
    mesh = parameter.device_mesh.mesh
    dim = max(i for i, pl in enumerate(parameter.placements) if isinstance(pl, Shard))
    index = [0] * world
    for coordinate in torch.nonzero(mesh >= 0).tolist():
        index[int(mesh[tuple(coordinate)])] = coordinate[dim]
    return mesh.shape[dim], index


def send_rows(local: torch.Tensor, pieces: list[torch.Tensor] | None, index: list[int], rows: int) -> None:
    """Rank 0 sends every rank the rows of its shard: chunk `index[rank]` of `pieces` (equal chunks of a tensor of
    `rows` rows, padded), less the padding (FSDP2's last shards may be shorter, or empty). Each rank receives them
    straight into `local`, the shard it holds (through a buffer only where `local` is not contiguous). Point to point
    rather than one scatter: a scatter needs equal buffers, and a chunk-sized one on the rank of a shorter shard is
    memory its shard does not account for."""
    if dist.is_initialized() and dist.get_rank() != 0:
        if local.numel():
            buffer = local if local.is_contiguous() else torch.empty_like(local)
            dist.recv(buffer, src=0)
            if buffer is not local:
                local.copy_(buffer)
        return
    chunk = pieces[0].shape[0]
    for rank in range(dist.get_world_size() if dist.is_initialized() else 1):
        piece = pieces[index[rank]][:max(0, min(chunk, rows - index[rank] * chunk))]
        if rank == 0:
            local.copy_(piece.reshape(local.shape))
        elif piece.numel():
            dist.send(piece.contiguous(), dst=rank)


def row_blocks(rows: int, row_elements: int, block_elements: int, multiple: int = 1) -> list[tuple[int, int]]:
    """(begin, end) of the blocks of rows read, converted and sent at once: as many whole rows as `block_elements`
    holds, in a multiple of `multiple` rows, `multiple` at least."""
    step = max(multiple, block_elements // max(1, row_elements) // multiple * multiple)
    return [(begin, min(rows, begin + step)) for begin in range(0, rows, step)]


def block_targets(block: tuple[int, int], chunk: int, index: list[int], rows: int) -> list[tuple[int, int, int]]:
    """Where a block of rows goes: (rank, begin, end) for the rows of the block that each rank's shard holds (shard
    `index[rank]`: rows index * chunk up to (index + 1) * chunk, fewer or none in FSDP2's last shards); a rank whose
    shard holds none of them is left out."""
    out = []
    for rank, shard in enumerate(index):
        begin, end = max(block[0], shard * chunk), min(block[1], (shard + 1) * chunk, rows)
        if begin < end:
            out.append((rank, begin, end))
    return out


def send_plain(parameter, source, name: str | None, block_elements: int) -> None:
    """One parameter in its dtype, a block of rows at a time (`row_blocks`): rank 0 reads the block from `source`
    (None elsewhere), converts it and sends each rank the rows of it that its shard holds; each rank receives them
    straight into its shard (through a buffer only where that is not contiguous). Rank 0 so holds one block besides
    its shards, whatever the tensor's size (the embeddings are the largest). Point to point rather than a scatter: a
    scatter needs equal buffers, and FSDP2's last shards may be shorter or empty."""
    from torch.distributed.tensor import DTensor

    local = parameter._local_tensor if isinstance(parameter, DTensor) else parameter
    local = local if local.dim() else local.view(1)  # a scalar: one row, whole on every rank
    shards, index = shard_rows(parameter)
    rows = parameter.shape[0] if parameter.dim() else 1
    chunk = math.ceil(rows / shards)
    me = dist.get_rank() if dist.is_initialized() else 0
    for block in row_blocks(rows, parameter.numel() // max(1, rows), block_elements):
        read = None
        if source is not None:
            read = source.read(name, block if parameter.dim() else None)
            read = read.to(device=local.device, dtype=local.dtype).reshape(-1, *local.shape[1:])
        for rank, begin, end in block_targets(block, chunk, index, rows):
            with torch.no_grad():
                if me == 0 and rank != 0:
                    dist.send(read[begin - block[0]:end - block[0]].contiguous(), dst=rank)
                elif rank == me:
                    mine = local[begin - index[rank] * chunk:end - index[rank] * chunk]
                    if me == 0:
                        mine.copy_(read[begin - block[0]:end - block[0]])
                        continue
                    buffer = mine if mine.is_contiguous() else torch.empty_like(mine)
                    dist.recv(buffer, src=0)
                    if buffer is not mine:
                        mine.copy_(buffer)
        del read


QUANTIZE_BLOCK_ELEMENTS = 2**17
"""The most elements of a 4-bit weight the reading rank reads and quantizes at once (512 KiB in fp32): quantizing
makes several copies of a block (its compute-dtype copy, the scaled copy, the codes, the level matching), so its
block is a quarter of a plain tensor's."""


def quantize_streamed(source, name: str, shape: tuple[int, int], dtype: torch.dtype, transposed: bool,
                      block_elements: int):
    """On the reading rank: the NF4Tensor of one weight (out x in) read a block at a time, torchao's `to_nf4` of the
    whole weight bit for bit (model/nf4.py `StreamedNF4`): blocks of rows, or where the files hold the weight
    transposed (GPT-2's Conv1D, in x out) blocks of the file's rows, which are the weight's columns, 64 at least. A
    weight whose rows do not hold whole blocks of 64 is read whole."""
    if not streams_in_blocks(shape):
        full = source.read(name).to(dtype)
        return to_nf4(full.t() if transposed else full)
    builder = StreamedNF4(shape, dtype)
    if not transposed:
        for rows in row_blocks(shape[0], shape[1], block_elements):
            builder.add(rows, (0, shape[1]), source.read(name, rows))
        return builder.finish()
    for columns in row_blocks(shape[1], shape[0], block_elements, multiple=BLOCK_SIZE):
        builder.add((0, shape[0]), columns, source.read(name, columns).to(dtype).t())
    return builder.finish()


def send_nf4(parameter, quantized, name: str) -> bytes | None:
    """One 4-bit weight: `quantized` (on the reading rank; None elsewhere) cut into the rows of every rank's shard,
    each rank receiving its rows' codes and scales into the NF4 shard it holds. Returns the weight's digest on the
    reading rank."""
    from torch.distributed.tensor import DTensor

    local = parameter._local_tensor if isinstance(parameter, DTensor) else parameter
    shards, index = shard_rows(parameter)
    for part in NF4_PARTS:  # every rank holds an equal part of each (model/quantize.py layer_problems)
        mine = getattr(local, part)
        pieces = list(getattr(quantized, part).reshape(-1).split(mine.numel())) if quantized is not None else None
        with torch.no_grad():
            send_rows(mine.view(-1), pieces, index, shards * mine.numel())
    mean = quantized.scaler_mean.clone() if quantized is not None else torch.empty_like(local.scaler_mean)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(mean, src=0)
    with torch.no_grad():
        local.scaler_mean.copy_(mean)
    return tensor_digest(name, quantized) if quantized is not None else None


def adapters_to_send(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """On the reading rank, before `prepare`: its drawn LoRA adapters, whole, by parameter name (FSDP2 replaces the
    parameters by shards; these references keep the whole tensors until `stream_adapters` has sent them)."""
    return {name: parameter.detach() for name, parameter in model.named_parameters() if ".lora_" in name}


def stream_adapters(model: torch.nn.Module, adapters: dict[str, torch.Tensor] | None, block_elements: int) -> None:
    """Fill every rank's shards of the LoRA adapters from the reading rank's (`adapters`; None elsewhere): the other
    ranks built them unwritten (model/build.py `apply_lora`, draw=False), so a rank never holds every adapter whole,
    and every adapter is the reading rank's draw (from the recipe's seed: what every rank would have drawn).
    Collective."""
    source = ModuleTensors(adapters) if adapters is not None else None
    for name, parameter in model.named_parameters():
        if ".lora_" in name:
            send_plain(parameter, source, name, block_elements)


def stream_weights(model: torch.nn.Module, source, *, where: str,
                   block_elements: int | None = None) -> dict[str, bytes]:
    """Fill every rank's shards of the base from `source` (read on global rank 0 only; None elsewhere), plain
    tensors in blocks of at most `block_elements` (BLOCK_ELEMENTS) elements. Collective. Returns, on rank 0, the
    digest of every 4-bit weight by file name (model/nf4.py `base_of`)."""
    from accelerate.utils import broadcast_object_list

    block_elements = block_elements or BLOCK_ELEMENTS
    reading = source is not None
    plan, problems = plan_problems(model, source, where, block_elements) if reading else ({}, [])
    box = [[str(p) for p in problems]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        broadcast_object_list(box, from_process=0)
    if box[0]:
        raise UserError(problems if reading else box[0][0])
    transposed = conv1d_weights(model)
    digests: dict[str, bytes] = {}
    for parameter_name, parameter in base_parameters(model):
        name = file_name(parameter_name)
        if not is_nf4(parameter):
            send_plain(parameter, source, plan.get(parameter_name), block_elements)
            continue
        quantized = (quantize_streamed(source, plan[parameter_name], tuple(parameter.shape), parameter.dtype,
                                       name in transposed, min(block_elements, QUANTIZE_BLOCK_ELEMENTS))
                     if reading else None)
        digest = send_nf4(parameter, quantized, name)
        if digest is not None:
            digests[name] = digest
        del quantized
    return digests
