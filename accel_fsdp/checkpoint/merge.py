"""`checkpoint consolidate --merge` of a QLoRA checkpoint (model.quantize): the adapters merged into a base, streamed
tensor by tensor into a folder `transformers` loads, with memory bounded by one output shard plus one tensor.

Two bases, and the difference matters (README.md, QLoRA, says it to users):
- `--merge` alone: the base the adapters were trained on. Each quantized weight is read from the model files,
  quantized to NF4 exactly as training did (model/nf4.py, in the compute dtype of the run) and dequantized; the
  adapters' product is added. The merged model computes what the trained model computed. The quantized weights are
  checked against the checkpoint's fingerprint (model/quantize.py QuantizedBase) before anything is written.
- `--base-model PATH`: the original weights of PATH (typically the bf16 release), unquantized, plus the adapters.
  Sharper weights, but not the ones the adapters were trained against: its outputs differ from the trained model's by
  the quantization error the adapters never saw (small, usually what users want to ship).

The LoRA update is PEFT's merge (peft 0.21.2, tuners/lora/layer.py Linear.get_delta_weight): B @ A times
lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), transposed for a fan_in_fan_out layer (GPT-2's Conv1D). An
adapted output projection tied to the input embeddings is written as a weight of its own (`tied_head_of`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import torch

from accel_fsdp.config.precision import TRANSFORMERS, compute_dtype
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.model.build import meta_model
from accel_fsdp.model.nf4 import layers_to_quantize, tensor_digest, to_nf4
from accel_fsdp.model.streaming_load import SafetensorsFiles, model_folder

ADAPTER_PREFIX = "base_model.model."
BASE_FIX = "merge into the base model the adapters were trained on (--base-model PATH)"


def adapter_misfit(module: str, a: torch.Tensor, b: torch.Tensor, weight_shape, where: str,
                   base) -> UserError | None:
    """The adapter of `module` against the base's weight of it: the refusal when the base has no such weight or one
    of another shape (another model given as --base-model; PEFT's own answers are a NoMatchingPeftModuleError or a
    state-dict size mismatch that would blame the checkpoint). The adapters' product is out x in; a Conv1D (GPT-2)
    stores its weight in x out."""
    adapted = (b.shape[0], a.shape[1])
    if weight_shape is None:
        return UserError(Problem(where, f"the adapter of {module} has no weight {module}.weight in {base}", BASE_FIX))
    if tuple(weight_shape) not in (adapted, adapted[::-1]):
        shape = " x ".join(map(str, weight_shape))
        return UserError(Problem(where, f"the adapter of {module} is for a {adapted[0]} x {adapted[1]} weight, and "
                                 f"{base} has {module}.weight of {shape}", BASE_FIX))
    return None


def adapter_deltas(adapter_dir: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """(module name -> (lora_A, lora_B), scaling) of a PEFT adapter folder: small, read whole."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(adapter_dir.glob("adapter_model*.safetensors")):
        tensors.update(load_file(file))
    pairs = {}
    for key, a in tensors.items():
        if ".lora_A." in key:
            module = key.removeprefix(ADAPTER_PREFIX).split(".lora_A.")[0]
            pairs[module] = (a.float(), tensors[key.replace(".lora_A.", ".lora_B.")].float())
    r, alpha = config["r"], config["lora_alpha"]
    return pairs, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def natural_key(name: str):
    """Sorts tensor names as their layers come (h.2 before h.10), not as strings do."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def merge_streaming(adapter_dir: Path, out: Path, *, base: str, dtype: str, quantized_base: dict | None,
                    max_shard_size: int, where: str, base_where: str | None = None) -> None:
    """Write `out`: the base's tensors, one at a time, with every adapted weight merged (and with `quantized_base`,
    each 4-bit weight quantized and dequantized as training saw it, checked against its fingerprint), into safetensors
    shards of at most `max_shard_size` bytes; the base's config and the adapter folder's tokenizer. `where` names the
    checkpoint; `base_where` the base where the user chose it (--base-model), for a base the adapters do not fit."""
    from transformers import AutoConfig, AutoTokenizer

    folder = model_folder(base)
    out_dtype = compute_dtype(dtype)
    files = SafetensorsFiles(folder)
    config = AutoConfig.from_pretrained(folder)
    skeleton = meta_model(config)
    layers = {f"{layer.name}.weight": layer for layer in layers_to_quantize(skeleton)}
    deltas, scaling = adapter_deltas(adapter_dir)
    untied = tied_head_of(skeleton, deltas)
    compute = getattr(torch, quantized_base.get("compute_dtype") or "bfloat16") if quantized_base else None
    digests: dict[str, bytes] = {}
    out.mkdir(parents=True, exist_ok=True)
    shards = _Shards(out, out_dtype, max_shard_size)
    for name in sorted(files.names(), key=natural_key):
        if untied and name == f"{untied[0]}.weight":
            continue  # a tied head's copy in the files: the head is written from the embeddings below
        tensor = files.read(name)
        if untied and name == f"{untied[1]}.weight":  # the adapted head's own copy of the embeddings it was tied to
            a, b = deltas.pop(untied[0])
            if (misfit := adapter_misfit(untied[0], a, b, tensor.shape, base_where or where, folder)) is not None:
                raise misfit
            shards.add(f"{untied[0]}.weight", tensor.float() + (b @ a) * scaling)
        layer = layers.get(name)
        if layer is not None and compute is not None:
            weight = tensor.to(compute)
            quantized = to_nf4(weight.t() if layer.from_conv1d else weight)
            digests[name] = tensor_digest(name, quantized)
            restored = quantized.get_original_weight()
            tensor = restored.t() if layer.from_conv1d else restored
        module = name.removesuffix(".weight")
        if module in deltas:
            a, b = deltas.pop(module)
            if (misfit := adapter_misfit(module, a, b, tensor.shape, base_where or where, folder)) is not None:
                raise misfit
            delta = (b @ a) * scaling  # out x in
            tensor = tensor.float() + (delta.t() if layer is not None and layer.from_conv1d else delta)
        shards.add(name, tensor)
    shards.flush()
    if deltas:
        raise UserError(Problem(base_where or where, f"the adapters of {', '.join(sorted(deltas)[:3])} have no weight "
                                f"in {folder}", BASE_FIX))
    if quantized_base:
        check_fingerprint(digests, quantized_base, folder, where)
    _name_shards(out, shards.names, shards.weight_map)
    _copy_config(folder, out, dtype, untied=bool(untied))
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out)


class _Shards:
    """Tensors written as they come into safetensors files of at most `max_shard_size` bytes (one shard in memory)."""

    def __init__(self, out: Path, dtype: torch.dtype, max_shard_size: int):
        self.out, self.dtype, self.max_shard_size = out, dtype, max_shard_size
        self.shard: dict[str, torch.Tensor] = {}
        self.used = 0
        self.names: list[str] = []
        self.weight_map: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.to(self.dtype).contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.shard and self.used + size > self.max_shard_size:
            self.flush()
        self.shard[name] = tensor
        self.used += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if self.shard:
            name = f"model-{len(self.names) + 1:05d}.safetensors"
            save_file(self.shard, str(self.out / name), metadata={"format": "pt"})
            self.names.append(name)
            self.weight_map.update({k: name for k in self.shard})
        self.shard, self.used = {}, 0


def check_fingerprint(digests: dict[str, bytes], quantized_base: dict, folder: Path, where: str) -> None:
    """The base quantized here is the one the adapters were trained on (model/quantize.py QuantizedBase.of)."""
    total = hashlib.sha256()
    for name in sorted(digests):
        total.update(digests[name])
    found = total.hexdigest()[:32]
    if found != quantized_base.get("fingerprint"):
        raise UserError(Problem(where, f"its adapters were trained on a 4-bit base with fingerprint "
                                f"{quantized_base.get('fingerprint')}, and {folder} quantizes to {found}: another "
                                "model (or torchao) than the run's",
                                "merge with the model files the run trained on, or pass --base-model PATH to merge "
                                "into original (unquantized) weights"))


def _name_shards(out: Path, names: list[str], weight_map: dict[str, str]) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors with an index, as transformers names them."""
    if len(names) == 1:
        (out / names[0]).rename(out / "model.safetensors")
        return
    final = {n: f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i, n in enumerate(names)}
    for old, new in final.items():
        (out / old).rename(out / new)
    total = sum((out / f).stat().st_size for f in final.values())
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def tied_head_of(model, deltas: dict) -> tuple[str, str] | None:
    """(the output projection's name, the input embeddings' name) where the adapters adapt an output projection tied
    to the input embeddings (GPT-2's lm_head): the model files hold only the embeddings, and the merge writes the head
    its own weight, the embeddings plus (alpha / r) B A, leaving the embeddings as they were (as they were trained)."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embeddings is None or head.weight is not embeddings.weight:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    return (names[id(head)], names[id(embeddings)]) if names[id(head)] in deltas else None


def _copy_config(folder: Path, out: Path, dtype: str, *, untied: bool = False) -> None:
    for name in ("config.json", "generation_config.json"):
        if (folder / name).exists():
            shutil.copy2(folder / name, out / name)
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = TRANSFORMERS[dtype]
    if untied:
        config["tie_word_embeddings"] = False
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
