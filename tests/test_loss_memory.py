"""The logits term of the memory planner (planning/memory.py `logits_bytes`) against the loss step's measured peak:
the plain path (the full logits) at its measured bytes per element, the chunked path at one chunk; and what the dry
run and `estimate` say about it.

Measured: the tensor bytes alive at the peak of a forward and backward (train/probes.py `PeakTensorBytes`), of a model
whose logits dwarf the rest (1 layer of width 32, a 32,768-token vocabulary, 2,048 tokens), minus the same step with a
64-token vocabulary: what the vocabulary adds. The planner's counterpart adds the head's weight gradient (V h c), which
it counts under the gathered unit's gradient for either path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import collated

from accel_fsdp.cli import main
from accel_fsdp.config.precision import MEMORY
from accel_fsdp.data.store import IGNORE_INDEX, Sequence
from accel_fsdp.model.facts import Shape, loss_chunk_tokens
from accel_fsdp.planning.memory import MemoryInputs, logits_bytes
from accel_fsdp.train.methods.chunked import find_head
from accel_fsdp.train.methods.logps import ChunkedPath, PlainPath
from accel_fsdp.train.probes import PeakTensorBytes

WIDTH, ROWS, LENGTH, VOCAB, SMALL, CHUNK = 32, 4, 512, 32768, 64, 256


def tiny_llama(vocab: int, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", num_hidden_layers=1, hidden_size=WIDTH, intermediate_size=64,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab,
                                  max_position_embeddings=LENGTH, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype)


def loss_step_peak(vocab: int, *, chunked: bool, pairs: bool, dtype: torch.dtype) -> int:
    model = tiny_llama(vocab, dtype)
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(ROWS):
        ids = rng.integers(0, vocab, LENGTH)
        labels = ids.copy()
        labels[0] = IGNORE_INDEX
        rows.append(Sequence(ids, labels, np.arange(LENGTH)))
    batch = collated(rows, 0)
    path = ChunkedPath(find_head(model)[0], CHUNK, vocab=vocab) if chunked else PlainPath("measured")
    with PeakTensorBytes() as memory:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = path.sequence_logps(model, batch)[0].sum() if pairs else path.next_token_loss(model, batch, 100.0)
        loss.backward()
    return memory.peak


def planned(vocab: int, *, chunked: bool, pairs: bool, dtype: torch.dtype) -> float:
    precision = MEMORY["bf16"] if dtype == torch.bfloat16 else MEMORY["fp32"]
    shape = Shape(layers=1, hidden=WIDTH, heads=2, kv_heads=1, intermediate=64, vocab=vocab, gated_mlp=True)
    m = MemoryInputs(params=0, trainable=0, largest_unit=0, world=1, shard_group=1, precision=precision,
                     micro_batch=ROWS, seq_len=LENGTH, shape=shape, chunked_loss=chunked, loss_chunk_tokens=CHUNK,
                     pairs=pairs)
    head_gradient = vocab * WIDTH * (2 if dtype == torch.bfloat16 else 4)
    return logits_bytes(m) + head_gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_the_planned_logits_are_the_measured_peak_within_15_percent(chunked, pairs, dtype):
    measured = (loss_step_peak(VOCAB, chunked=chunked, pairs=pairs, dtype=dtype)
                - loss_step_peak(SMALL, chunked=chunked, pairs=pairs, dtype=dtype))
    predicted = (planned(VOCAB, chunked=chunked, pairs=pairs, dtype=dtype)
                 - planned(SMALL, chunked=chunked, pairs=pairs, dtype=dtype))
    assert measured == pytest.approx(predicted, rel=0.15), (measured / 2**20, predicted / 2**20)


def test_the_chunk_the_planner_picks_keeps_one_chunks_fp32_logits_within_256_mib():
    assert loss_chunk_tokens(128_256) == 512 and loss_chunk_tokens(50_257) == 1280
    assert loss_chunk_tokens(4_000_000) == 64  # never below a tile
    for vocab in (32_000, 50_257, 128_256, 152_064, 256_000):
        assert 4 * vocab * loss_chunk_tokens(vocab) <= 256 * 2**20 or loss_chunk_tokens(vocab) == 64


def test_the_dry_run_and_estimate_say_how_the_logits_are_counted(cpu_with_native_bf16):  # the bf16 plan
    runner = CliRunner()
    out = runner.invoke(main, ["estimate", "llama-3.2-1b", "--micro-batch", "1", "--seq-len", "4096"]).output
    assert ("(activations include the logits 0.40 GiB: chunked, one chunk of 512 tokens x 128,256 (the full logits "
            "would take 5.87 GiB))") in out
    plan = runner.invoke(main, ["recipe", "run", "quickstart-dpo", "--dry-run", "--set",
                                "training.chunked_loss=false"]).output
    assert "activations include the logits 0.00 GiB: the full logits, 768 tokens x 131 at 7 bytes each" in plan
