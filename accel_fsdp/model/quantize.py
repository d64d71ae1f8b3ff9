"""model.quantize: the frozen linear weights of every decoder block stored in 4 bits, for QLoRA. What a quantized base
is, from the model's facts alone (no torch): which layers, how their blocks and scales are laid out, how many bytes,
whether they split over the ranks, and the record a checkpoint keeps of it. model/nf4.py builds it with torchao.

`nf4` is QLoRA's NormalFloat (Dettmers et al. 2023) as torchao implements it (pinned: torchao==0.18.0, checked with
torch 2.13.0): every block of 64 weights keeps a 4-bit code per weight and one absmax scale, and the scales are
themselves quantized to 8 bits in groups of 256 around their mean ("double quantization"). 0.5 byte a weight plus
about 1/64 of a byte of scales.

What is quantized: the Linear (GPT-2: Conv1D) layers of the decoder blocks that model/facts.py knows (attention and
MLP projections), never embeddings, norms or the head, and never a weight that trains.

This module must never import torch: `recipe validate`, `estimate` and the dry run answer from it at once.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

from accel_fsdp.errors import Problem
from accel_fsdp.model.facts import ModelFacts, facts_from_values
BLOCK_SIZE = 64
"""Weights per NF4 block, each block with its own absmax scale (QLoRA)."""
SCALE_GROUP = 256
"""Scales per group of the double quantization (QLoRA), where a tensor is large enough: see `scale_group`."""
ALIGNED_SHARDS = 8
"""A tensor's groups of scales line up with the shard boundaries of 1, 2, 4 and 8 ranks (and of many more where the
tensor is large: every real model's), so the quantized base is the same whatever the number of ranks."""


def scale_group(numel: int) -> int:
    """Scales per double-quantization group of a tensor of `numel` weights: 256 (QLoRA) where its blocks split into
    ALIGNED_SHARDS parts of whole groups of 256, else the largest power of two that does (the tests' tiny models: a
    64 x 64 projection has 64 blocks, 8 a part, so groups of 8). From the tensor's size alone: how a weight is
    quantized never depends on the number of ranks."""
    blocks = numel // BLOCK_SIZE
    part = blocks // ALIGNED_SHARDS if blocks % ALIGNED_SHARDS == 0 else blocks
    group = 1
    while group < SCALE_GROUP and part % (2 * group) == 0:
        group *= 2
    return group


def nf4_bytes(numel: int, compute_bytes: int = 2) -> int:
    """Bytes of one NF4 tensor of `numel` weights: the 4-bit codes, an 8-bit scale per block, a factor per group of
    scales and the scales' mean (both in the compute dtype)."""
    blocks = numel // BLOCK_SIZE
    return numel // 2 + blocks + (blocks // scale_group(numel)) * compute_bytes + compute_bytes


@dataclass(frozen=True)
class QuantizedLayer:
    """One layer to quantize: its name, its shape out x in, and whether its weight is stored transposed (GPT-2's
    Conv1D holds in x out)."""
    name: str
    out_features: int
    in_features: int
    from_conv1d: bool

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features


def block_layers(facts: ModelFacts) -> list[QuantizedLayer]:
    """The layers quantized in one decoder block of a GPT-2 or Llama (every block has the same)."""
    return [QuantizedLayer(name, n_out, n_in, facts.model_type == "gpt2")
            for name, shapes in facts.block_linears().items() for n_in, n_out, _ in shapes]


def quantized_parameters(facts: ModelFacts) -> int:
    """Weights the base holds in 4 bits (every block's projections)."""
    return facts.layers * sum(layer.numel for layer in block_layers(facts))


def quantized_bytes(facts: ModelFacts, compute_bytes: int = 2) -> int:
    """Bytes of the 4-bit weights of the whole model, scales included."""
    return facts.layers * sum(nf4_bytes(layer.numel, compute_bytes) for layer in block_layers(facts))


@dataclass(frozen=True)
class QuantizedTerms:
    """What a 4-bit base adds to the memory plan (planning/memory.py), from the model's facts."""
    params: int
    """Weights held in 4 bits, the whole model."""
    bytes: int
    """Their codes and scales."""
    largest_weight: int
    """Elements of the largest 4-bit weight: dequantized in the compute dtype while its product runs."""
    block_params: int
    """All parameters of one decoder block (the FSDP unit)."""
    block_quantized: int
    """Of them, held in 4 bits."""
    block_bytes: int
    """Bytes of one block's 4-bit weights."""


def quantized_terms(facts: ModelFacts, compute_bytes: int = 2) -> QuantizedTerms:
    layers = block_layers(facts)
    return QuantizedTerms(quantized_parameters(facts), quantized_bytes(facts, compute_bytes),
                          max(layer.numel for layer in layers), facts.block_params(),
                          sum(layer.numel for layer in layers),
                          sum(nf4_bytes(layer.numel, compute_bytes) for layer in layers))


def known_layers(model_type: str | None) -> tuple[str, frozenset[str]] | None:
    """(decoder block class, leaf names of its quantized layers) of a model type model/facts.py knows; else None."""
    facts = facts_from_values(model_type or "", {})
    if facts is None:
        return None
    return facts.no_split_modules[0], frozenset(facts.block_linears())


def layer_problems(layers: list[QuantizedLayer], shards: int, where: str) -> list[Problem]:
    """Every weight must cut into whole blocks of 64, and each rank of a shard group must hold whole rows and whole
    groups of scales of it (torchao splits the codes and scales of an NF4Tensor with its rows, evenly: nf4_split).
    Names the first layer that does not fit, and the rank counts that would."""
    for layer in layers:
        if layer.numel % BLOCK_SIZE:
            return [Problem(where, f"model.quantize: nf4 cuts weights into blocks of {BLOCK_SIZE}, and {layer.name} "
                            f"has {layer.out_features} x {layer.in_features} = {layer.numel} weights",
                            f"give the model sizes whose products are multiples of {BLOCK_SIZE}, or leave "
                            f"model.quantize out")]
        groups = layer.numel // BLOCK_SIZE // scale_group(layer.numel)
        if shards > 1 and (layer.out_features % shards or groups % shards):
            fits = [n for n in (1, 2, 4, 8, 16, 32, 64) if layer.out_features % n == 0 and groups % n == 0]
            return [Problem(where, f"model.quantize: nf4 cannot split {layer.name} ({layer.out_features} x "
                            f"{layer.in_features}, {groups} groups of 4-bit scales) evenly over {shards} ranks",
                            f"shard over {', '.join(map(str, fits))} ranks (processes, or the accelerate config's "
                            "parallelism_config_dp_shard_size under hybrid sharding)")]
    return []


@dataclass(frozen=True)
class QuantizedBase:
    """What a run's 4-bit base is, saved in every checkpoint's manifest and checked on resume: the base is rebuilt
    from the model files, never saved, so a changed model folder or torchao would otherwise go unseen."""
    method: str
    layers: int
    block_size: int
    fingerprint: str
    """SHA-256 over every quantized weight's digest in name order (the same whatever the number of ranks)."""
    torchao: str
    compute_dtype: str = "bfloat16"
    """The dtype the weights were quantized from and dequantize to (torch's name): what a merge quantizes in."""

    @classmethod
    def of(cls, method: str, digests: dict[str, bytes], torchao: str, compute_dtype: str) -> QuantizedBase:
        total = hashlib.sha256()
        for name in sorted(digests):
            total.update(digests[name])
        return cls(method=method, layers=len(digests), block_size=BLOCK_SIZE, fingerprint=total.hexdigest()[:32],
                   torchao=torchao, compute_dtype=compute_dtype)

    @classmethod
    def from_dict(cls, data: dict) -> QuantizedBase:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def to_dict(self) -> dict:
        return asdict(self)


def file_name(parameter_name: str) -> str:
    """The name a parameter of the built model has in the model files: without PEFT's `base_model.model.` and
    `.base_layer`, and activation checkpointing's `._checkpoint_wrapped_module`."""
    name = parameter_name.removeprefix("base_model.model.")
    return name.replace("._checkpoint_wrapped_module", "").replace(".base_layer.", ".")
