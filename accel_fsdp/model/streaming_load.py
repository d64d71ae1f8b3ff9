"""Loading that streams: global rank 0 reads the model files one tensor at a time and sends every rank only the shard
it holds, so no rank ever holds the whole model (FSDP2 with fsdp_cpu_ram_efficient_loading).

Every rank first builds the model without weights (allocated, never written: build.py `_unwritten_parameters`) and
lets FSDP2 shard it (`accelerator.prepare`), so each holds its shards and nothing else. Then, collectively, for each
parameter of the base in the model's order: rank 0 reads the tensor from the safetensors files with plain reads (no
memory map, whose pages would stay resident), converts it to the parameter's dtype (GPT-2's Conv1D weights transposed
and quantized to NF4 first where model.quantize says so: model/nf4.py), and sends it: each rank receives its rows
(its shard; replicas of a shard under hybrid sharding the same rows) straight into the shard FSDP2 holds. A rank
grows by its shards; rank 0 by its shards and one whole tensor at a time (the largest: the embeddings). LoRA adapters are not read: every rank initialized them alike (build.py `apply_lora`).

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
from accel_fsdp.model.nf4 import NF4_PARTS, NF4Linear, is_nf4, tensor_digest, to_nf4
from accel_fsdp.model.quantize import file_name

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

    def read(self, name: str, rows: int | None = None) -> torch.Tensor:
        """The tensor; with `rows`, read into a buffer of that many rows (zeros after its own): the padding FSDP2's
        last shards get, without a second copy of the tensor."""
        path, dtype, shape, offset, length = self.entries[name]
        buffer = torch.empty([rows or shape[0], *shape[1:]] if shape else shape, dtype=SAFETENSORS_DTYPES[dtype])
        tensor = buffer[:shape[0]] if rows else buffer
        if rows and rows > shape[0]:
            buffer[shape[0]:].zero_()
        if length:
            with open(path, "rb", buffering=0) as f:
                f.seek(offset)
                f.readinto(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        return buffer


class ModuleTensors:
    """The tensors of a model built in rank 0's memory (from scratch: there are no files to read)."""

    def __init__(self, model: torch.nn.Module):
        self.tensors = model.state_dict()

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def read(self, name: str, rows: int | None = None) -> torch.Tensor:
        tensor = self.tensors[name].detach()
        if rows and rows > tensor.shape[0]:
            tensor = torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])
        return tensor


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


def plan_problems(model: torch.nn.Module, source, where: str) -> tuple[dict[str, str], list[Problem]]:
    """On the reading rank: the source name of every base parameter, and what would make the stream fail (a tensor
    the files lack or store in another shape, a tie the files break), all found before a single tensor is sent."""
    names, shapes, problems = source.names(), {}, []
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
    problems += tie_problems(model, source, names)
    if not problems:
        return plan, []
    return plan, [Problem(where, "rank 0 streams the weights to the ranks that hold their shards, and the model files "
                          "differ from the model the config builds: " + "; ".join(problems[:5])
                          + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""),
                          "set fsdp_cpu_ram_efficient_loading: false in the accelerate config (every rank reads the "
                          "weights with transformers), or repair the model folder")]


def tie_problems(model: torch.nn.Module, source, names: set[str]) -> list[str]:
    """A parameter the config ties under several names (GPT-2's lm_head and wte) that the files store apart with
    other values: transformers would untie it, the stream would keep one."""
    by_object: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(parameter), []).append(file_name(name))
    out = []
    for tied in by_object.values():
        stored = [n for n in tied if n in names]
        if len(stored) > 1 and any(not torch.equal(source.read(stored[0]), source.read(n)) for n in stored[1:]):
            out.append(f"tied parameters {', '.join(stored)} are stored apart with different values")
    return out


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


def padded_rows(parameter) -> int:
    """Rows of a parameter with FSDP2's padding: whole chunks for every shard."""
    shards, _ = shard_rows(parameter)
    return math.ceil(parameter.shape[0] / shards) * shards if parameter.dim() else 0


def send_plain(parameter, full: torch.Tensor | None) -> None:
    """One parameter in its dtype: each rank's rows into the shard it holds. `full` (rank 0) holds whole chunks
    (`padded_rows`: FSDP2 pads the last shards)."""
    from torch.distributed.tensor import DTensor

    local = parameter._local_tensor if isinstance(parameter, DTensor) else parameter
    shards, index = shard_rows(parameter)
    rows = parameter.shape[0] if parameter.dim() else 1  # a scalar: one row, whole on every rank
    chunk = math.ceil(rows / shards)
    pieces = None
    if full is not None:
        full = full.to(device=local.device, dtype=local.dtype)
        pieces = list((full if parameter.dim() else full.view(1)).split(chunk))
    with torch.no_grad():
        send_rows(local if local.dim() else local.view(1), pieces, index, rows)


def send_nf4(parameter, full: torch.Tensor | None, name: str) -> bytes | None:
    """One 4-bit weight: rank 0 quantizes the whole weight (the scales' mean is the whole weight's), each rank
    receives its rows' codes and scales into the NF4 shard it holds. Returns the weight's digest on rank 0."""
    from torch.distributed.tensor import DTensor

    local = parameter._local_tensor if isinstance(parameter, DTensor) else parameter
    shards, index = shard_rows(parameter)
    quantized = to_nf4(full.to(local.dtype)) if full is not None else None
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


def stream_weights(model: torch.nn.Module, source, *, where: str) -> dict[str, bytes]:
    """Fill every rank's shards of the base from `source` (read on global rank 0 only; None elsewhere). Collective.
    Returns, on rank 0, the digest of every 4-bit weight by file name (model/nf4.py `base_of`)."""
    from accelerate.utils import broadcast_object_list

    reading = source is not None
    plan, problems = plan_problems(model, source, where) if reading else ({}, [])
    box = [[str(p) for p in problems]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        broadcast_object_list(box, from_process=0)
    if box[0]:
        raise UserError(problems if reading else box[0][0])
    transposed = conv1d_weights(model)
    digests: dict[str, bytes] = {}
    for parameter_name, parameter in base_parameters(model):
        name = file_name(parameter_name)
        plain = not is_nf4(parameter)
        full = (source.read(plan[parameter_name], padded_rows(parameter) if plain else None) if reading
                else None)
        if not plain:
            if full is not None and name in transposed:
                full = full.t()
            digest = send_nf4(parameter, full, name)
            if digest is not None:
                digests[name] = digest
        else:
            send_plain(parameter, full)
        del full
    return digests
