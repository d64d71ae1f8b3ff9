"""Per-rank memory of FSDP training: the arithmetic behind `accel-fsdp estimate` and `recipe run --dry-run`.

Model state (ZeRO paper, Rajbhandari et al. 2020): AdamW keeps per trainable parameter an fp32 master weight
(4 bytes), an fp32 gradient (4) and two fp32 moments (8): 16 bytes. FSDP shards it over the S ranks of a shard
group:
    NO_SHARD (DDP-like)       params 4P      grads 4T     optimizer 8T      (nothing sharded)
    SHARD_GRAD_OP (ZeRO-2)    params 4P/S    grads 4T/S   optimizer 8T/S   + the whole model gathered in the
                                                                              compute dtype from forward to backward
    FULL_SHARD (ZeRO-3)       params 4P/S    grads 4T/S   optimizer 8T/S   + gathered units, freed after use
    HYBRID_SHARD              like FULL_SHARD with S = ranks per shard group (one machine); replicas across
P = all parameters, T = trainable ones (T = P for a full fine-tune, the adapters for LoRA: frozen weights
need no gradient and no optimizer state, and are kept in the compute dtype: c bytes instead of 4).

Peak (FSDP paper, Zhao et al. 2023): sharded state + the largest unit gathered. We count two units in flight
(the current one and the prefetched next one) in the compute dtype c, plus the unit's unsharded gradient
(c bytes) and its fp32 copy for the reduce-scatter (4 bytes): (3c + 4) x largest unit.

CPU offload moves parameters, gradients and optimizer state to host memory: the GPU keeps only gathered units
and activations.

Gradient accumulation with the reduction deferred to the last micro-step (`fsdp.reduce_every_micro_step: false`):
between micro-steps every rank holds each unit's unsharded gradient in the fp32 reduce dtype, 4T bytes, on the
GPU even with offload. The default reduce-scatters after every micro-step and holds only the 4T/S shard.

Activations (Korthikanti et al. 2022, without sequence parallelism, with a fused attention kernel so no
s x s score matrix is stored): per layer about s b c (8h + q + 2kv + m I) bytes, where q + 2kv is the QKV
projection width, I the MLP width and m = 2 (GELU MLP) or 3 (SwiGLU). For GPT-2 this is 38 s b h bytes at
16-bit, close to their 34 s b h. With activation checkpointing only each block's input (s b h c) is kept, plus
one block recomputed at a time.

The logits (`logits_bytes`, measured: tests/test_loss_memory.py holds the measurement within 15% of these): the plain
path (training.chunked_loss: false) holds b s V elements at PLAIN_LOGIT_BYTES each, the logits, their fp32 copies
for the loss and the gradients of both; the chunked path holds one chunk's (train/methods/chunked.py, at most
training.loss_chunk_tokens loss-carrying positions x V) at CHUNK_LOGIT_BYTES each, plus, with 16-bit compute, the
hidden states' gradient summed in fp32 (4 b s h). The head's weight gradient (V h c) is the largest unit's gradient
that `gathered` counts, for either path.

Knobs (planning/knob_advice.py asks each its term from here): the chunked loss (training.chunked_loss) is the logits
term above. Activation offload (training.activation_offload) moves the layers' saved activations to host memory, the
GPU keeping one block's (the one computing) and the prefetched ones (train/activation_offload.py PREFETCH) of the same
size: with activation checkpointing the block inputs move, one block recomputed stays. FP8 (training.mixed_precision:
fp8) all-gathers the blocks' weights in float8: the two units in flight at 1 byte a parameter instead of c (the unit's
gradient and its fp32 copy unchanged); the activations are counted as bf16 (torchao keeps the inputs of its float8
products in the compute dtype for the backward). Compile (training.compile) is counted as eager: inductor's fusion
only ever saves fewer intermediates.

The simple mode is the classic calculator: 16 bytes per parameter, divided by the number of GPUs with
FSDP, in GiB.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from accel_fsdp.config.accelerate import FULL_SHARD, NO_SHARD, SHARD_GRAD_OP
from accel_fsdp.config.precision import MEMORY, is_half
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.model.facts import Shape, loss_chunk_tokens
from accel_fsdp.model.quantize import QuantizedTerms

GiB = 1024**3
PLAIN_LOGIT_BYTES = {("sft", 4): 12.0, ("sft", 2): 12.0, ("pairs", 4): 10.0, ("pairs", 2): 7.0}
"""Bytes per logit element of the plain path's loss step at its peak (the backward of the loss), by (method kind, c),
measured on CPU as the tensor bytes alive (tests/test_loss_memory.py): sft is transformers' loss (the fp32 copy, its
log-softmax, their gradients, the logits' gradient in c), the pair methods' per-row fp32 log-softmax
(train/methods/logps.py `answer_logps`). Before the rows were unbound the pairs measured 16 (fp32) and 8 (bf16)."""
CHUNK_LOGIT_BYTES = {4: 4.0, 2: 6.0}
"""Bytes per element of one chunk of the chunked path by c: its fp32 logits, turned in place into their gradient, and
that gradient in the compute dtype (16-bit only); measured as PLAIN_LOGIT_BYTES."""


@dataclass(frozen=True)
class MemoryInputs:
    params: int
    trainable: int
    largest_unit: int
    """Parameters of the largest FSDP unit (one transformer block under per-block wrapping)."""
    world: int
    shard_group: int
    """Ranks each tensor is sharded over: world for FULL_SHARD / SHARD_GRAD_OP, the machine for HYBRID_SHARD."""
    strategy: str = FULL_SHARD
    precision: str = MEMORY["bf16"]
    """fp32 or bf16-mixed (bf16 compute, fp32 master weights): config/precision.py MEMORY."""
    offload: bool = False
    activation_checkpointing: bool = False
    micro_batch: int = 0
    seq_len: int = 0
    shape: Shape | None = None
    frozen_bytes: int = 4
    """Bytes per frozen parameter: 4 (fp32) for full fine-tunes, the compute dtype's 2 for LoRA bases."""
    deferred_reduce: bool = False
    """Gradient accumulation that keeps unsharded fp32 gradients until the last micro-step (no_sync)."""
    chunked_loss: bool = True
    """training.chunked_loss: the loss from the hidden states a chunk at a time (else the full logits)."""
    loss_chunk_tokens: int | None = None
    """training.loss_chunk_tokens; None: the planner's pick for the vocabulary (model/facts.py)."""
    pairs: bool = False
    """A preference method (the sequences' log-probabilities), not sft (transformers' loss): the plain paths differ."""
    quantized: QuantizedTerms | None = None
    """model.quantize: the 4-bit weights (NF4 bytes instead of `frozen_bytes` each, the block gathered in 4 bits, one
    weight dequantized in flight)."""
    activation_offload: bool = False
    """training.activation_offload: the layers' saved activations in host memory."""
    fp8: bool = False
    """training.mixed_precision: fp8: the blocks' weights gathered in float8."""


@dataclass(frozen=True)
class MemoryBreakdown:
    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float
    """Of the layers and the logits (`logits` is part of it)."""
    host: float
    """Bytes per rank in CPU memory (offloaded state)."""
    logits: float = 0.0
    """The loss's share of `activations` (`logits_bytes`)."""
    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """Peak bytes on the device (GPU) per rank."""
        return self.params + self.grads + self.optimizer + self.gathered + self.activations


def compute_bytes(precision: str) -> int:
    """Bytes per element of the compute copies: 2 under bf16-mixed (or a 16-bit recipe precision), else 4."""
    return 2 if precision == MEMORY["bf16"] or is_half(precision) else 4


def estimate(m: MemoryInputs) -> MemoryBreakdown:
    c = compute_bytes(m.precision)
    s = 1 if m.strategy == NO_SHARD else max(1, m.shard_group)
    q = m.quantized
    plain = m.params - m.trainable - (q.params if q else 0)
    weights = 4.0 * m.trainable + m.frozen_bytes * plain + (q.bytes if q else 0)
    params, grads, optimizer = weights / s, 4.0 * m.trainable / s, 8.0 * m.trainable / s
    if q is not None:
        gathered = quantized_gathered(m, q, c)
    elif m.strategy == SHARD_GRAD_OP:
        gathered = c * m.params + (c + 4) * m.largest_unit  # the whole model stays gathered until backward
    elif m.strategy == NO_SHARD:
        gathered = float(c * m.largest_unit) if c < 4 else 0.0  # a low-precision copy of the unit in use
    else:
        gathered = (2 * (1 if m.fp8 else c) + c + 4) * m.largest_unit
    host = offloaded_activation_bytes(m)
    if m.offload:
        host, params, grads, optimizer = host + params + grads + optimizer, 0.0, 0.0, 0.0
    if m.deferred_reduce:
        grads = 4.0 * m.trainable  # every unit's unsharded fp32 gradient, on the device (offload or not; 1 GPU too)
    return MemoryBreakdown(params, grads, optimizer, gathered, activation_bytes(m), host, logits_bytes(m))


def layer_activation_bytes(m: MemoryInputs) -> tuple[float, float]:
    """(on the device, in host memory) of the layers' saved activations: all on the device, or with activation
    offload, one block's (and PREFETCH more of its size) on it and the rest in host memory."""
    if not m.micro_batch or not m.seq_len or m.shape is None:
        return 0.0, 0.0
    sh, c = m.shape, compute_bytes(m.precision)
    tokens = m.micro_batch * m.seq_len
    head_dim = sh.hidden // sh.heads
    qkv = sh.heads * head_dim + 2 * sh.kv_heads * head_dim
    per_layer = tokens * c * (8 * sh.hidden + qkv + (3 if sh.gated_mlp else 2) * sh.intermediate)
    saved = tokens * sh.hidden * c if m.activation_checkpointing else per_layer  # what one block leaves saved
    recomputed = per_layer if m.activation_checkpointing else 0
    if not m.activation_offload:
        return float(sh.layers * saved + recomputed), 0.0
    kept = min(sh.layers, 1 + OFFLOAD_PREFETCH)
    return float(kept * saved + recomputed), float((sh.layers - kept) * saved)


OFFLOAD_PREFETCH = 2
"""train/activation_offload.py PREFETCH (that module imports torch; this one must not)."""


def offloaded_activation_bytes(m: MemoryInputs) -> float:
    return layer_activation_bytes(m)[1]


def quantized_gathered(m: MemoryInputs, q: QuantizedTerms, c: int) -> float:
    """A 4-bit base's transient bytes: two units in flight, a block gathered with its projections in 4 bits (or the
    largest other unit, the embeddings, in the compute dtype), the largest 4-bit weight dequantized for its product
    (torchao's linear_nf4 frees it after), and the adapters' unsharded gradients with their fp32 copy (the frozen
    base has none). SHARD_GRAD_OP keeps every gathered block until the backward."""
    block = c * (q.block_params - q.block_quantized) + q.block_bytes
    unit = max(block, c * m.largest_unit if m.largest_unit > q.block_params else 0)
    if m.strategy == SHARD_GRAD_OP:
        whole = c * (m.params - q.params) + q.bytes
        return whole + c * q.largest_weight + (c + 4) * m.trainable
    if m.strategy == NO_SHARD:
        return float(c * q.largest_weight)
    return 2 * unit + c * q.largest_weight + (c + 4) * m.trainable


def activation_bytes(m: MemoryInputs) -> float:
    """On the device: the layers' saved activations (`layer_activation_bytes`) and the loss's logits."""
    return layer_activation_bytes(m)[0] + logits_bytes(m)


def logits_bytes(m: MemoryInputs) -> float:
    """The loss step's logits at its peak: the plain path's b s V elements, or the chunked path's one chunk (and the
    head's fp32 weight-gradient sum under 16-bit compute). The one place this term is computed."""
    if not m.micro_batch or not m.seq_len or m.shape is None:
        return 0.0
    c, vocab = compute_bytes(m.precision), m.shape.vocab
    tokens = m.micro_batch * m.seq_len
    if not m.chunked_loss:
        return float(tokens * vocab * PLAIN_LOGIT_BYTES[("pairs" if m.pairs else "sft", c)])
    hidden_sum = 4 * tokens * m.shape.hidden if c < 4 else 0
    return float(planned_chunk(m) * vocab * CHUNK_LOGIT_BYTES[c] + hidden_sum)


def planned_chunk(m: MemoryInputs) -> int:
    """Loss positions one chunk projects: the recipe's, else the planner's pick; never more than a micro-step has."""
    return min(m.micro_batch * m.seq_len, m.loss_chunk_tokens or loss_chunk_tokens(m.shape.vocab))


def describe_logits(m: MemoryInputs) -> str:
    """How the logits term was counted, for the dry run and `estimate`."""
    if m.shape is None or not m.micro_batch or not m.seq_len:
        return ""
    if not m.chunked_loss:
        per = PLAIN_LOGIT_BYTES[("pairs" if m.pairs else "sft", compute_bytes(m.precision))]
        return (f"logits {gib(logits_bytes(m))} GiB: the full logits, {m.micro_batch * m.seq_len:,} tokens x "
                f"{m.shape.vocab:,} at {per:g} bytes each (training.chunked_loss: false)")
    return (f"logits {gib(logits_bytes(m))} GiB: chunked, one chunk of {planned_chunk(m):,} tokens x "
            f"{m.shape.vocab:,} (the full logits would take {gib(logits_bytes(replace(m, chunked_loss=False)))} GiB)")


def simple_bytes(params: int, gpus: int, fsdp: bool) -> float:
    """The classic calculator, exactly: 16 bytes per parameter (fp32 weights, gradients, Adam), divided by the
    number of GPUs with FSDP, in GiB."""
    total = params * 4 + params * 4 + params * 8
    if fsdp:
        total /= gpus
    return total / GiB


def parse_bytes(text: str) -> int:
    """'80GB' -> bytes. GB and GiB are both read as 2**30 (GPU marketing sizes are GiB-ish in practice). The unit is
    required (a bare 24 would be 24 bytes): ValueError for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(T|G|M|K)I?B?\s*", str(text).upper())
    size = int(float(m.group(1)) * {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]) if m else 0
    if size < 1:  # garbage, zero, or a fraction of a byte (0.0001KB)
        raise ValueError(text)
    return size


def size_problem(option: str, text: str, example: str = "80GB"):
    """The one message for a size that is not one (no unit, zero, garbage)."""
    bare = str(text).strip().replace(".", "", 1).isdigit()
    why = "has no unit" if bare else "is not a size"
    hint = f" (did you mean {str(text).strip()}GB?)" if bare else ""
    return Problem(option, f"{text!r} {why}{hint}", f"give a positive size with a unit, e.g. {example}")


# The sizes a GPU's memory can have: below 1 GiB no GPU trains a model (a size like "80MB" is a slip for "80GB"),
# and the largest accelerators of 2026 have under 0.5 TiB; 4 TiB leaves room for the next ones.
GPU_MEMORY_RANGE = (2**30, 4 * 2**40)


def gpu_memory_bytes(text: str) -> int:
    """A GPU's memory as given on the command line ('80GB'), refused as a UserError when it is not a size or is
    outside GPU_MEMORY_RANGE: a plan checked against 1KB or 10^20 TB would print a verdict that means nothing."""
    try:
        size = parse_bytes(text)
    except ValueError:
        raise UserError(size_problem("--gpu-memory", text)) from None
    low, high = GPU_MEMORY_RANGE
    if not low <= size <= high:
        number = float(re.match(r"\s*([\d.]+)", str(text)).group(1))  # parse_bytes read it
        meant = f"{number:g}GB" if size < low and 1 <= number <= 4096 else "80GB"  # 80MB: a slip for 80GB
        side = "less than 1 GiB" if size < low else "more than 4 TiB"
        raise UserError(Problem("--gpu-memory", f"{text!r} is {side}, which no GPU has",
                                f"give one GPU's memory, between 1GB and 4TB, e.g. {meant}"))
    return size


def gib(x: float) -> str:
    return f"{x / GiB:,.2f}"
