"""A 4-bit weight quantized a block at a time while it streams (model/nf4.py StreamedNF4) is torchao's `to_nf4` of
the whole weight, byte for byte: the same packed codes, block scales, scale factors and mean, whether the pieces are
rows (a Linear) or columns (GPT-2's Conv1D stores the weight transposed), in bf16 and fp32; and the reading rank never
reads a projection whole (the loading benchmark's bound: one copy of the quantized weights per machine)."""

from __future__ import annotations

import pytest
import torch

from accel_fsdp.model import streaming_load
from accel_fsdp.model.nf4 import NF4_PARTS, StreamedNF4, digests_of, is_nf4, quantize_model
from accel_fsdp.model.quantize import BLOCK_SIZE, scale_group
from accel_fsdp.model.streaming_load import SafetensorsFiles, stream_weights

PARTS = (*NF4_PARTS, "scaler_mean", "nf4")


def torchao_whole(weight: torch.Tensor):
    """torchao's own quantization of the whole weight, with our block and group sizes."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    return to_nf4(weight.contiguous(), BLOCK_SIZE, scale_group(weight.numel()))


def assert_same_bytes(ours, theirs) -> None:
    assert (ours.shape, ours.stride(), ours.dtype) == (theirs.shape, theirs.stride(), theirs.dtype)
    assert (ours.block_size, ours.n_blocks, ours.scaler_block_size) == (
        theirs.block_size, theirs.n_blocks, theirs.scaler_block_size)
    for part in PARTS:
        mine, reference = getattr(ours, part), getattr(theirs, part)
        assert mine.dtype == reference.dtype and mine.shape == reference.shape, part
        assert torch.equal(mine.reshape(-1).view(torch.uint8), reference.reshape(-1).view(torch.uint8)), part


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape, step", [((64, 64), 1), ((192, 128), 7), ((1024, 512), 100), ((512, 1024), 512)])
def test_rows_streamed_quantize_to_torchaos_bytes(dtype, shape, step):
    """Blocks of `step` rows (the last shorter) give the bytes of torchao's to_nf4 of the whole weight; a block of
    zeros and a block with one large outlier among them (the mean of the scales moves with it)."""
    torch.manual_seed(0)
    weight = (torch.randn(shape) * 0.02).to(dtype)
    weight[0, :BLOCK_SIZE] = 0
    weight[-1, -1] = 3.0
    streamed = StreamedNF4(shape, dtype)
    for begin in range(0, shape[0], step):
        end = min(shape[0], begin + step)
        streamed.add((begin, end), (0, shape[1]), weight[begin:end].float())  # any dtype in: converted as torchao
    assert_same_bytes(streamed.finish(), torchao_whole(weight))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_columns_streamed_quantize_to_torchaos_bytes(dtype):
    """A weight stored transposed (in x out, GPT-2's Conv1D) read a block of its rows at a time: each is a block of
    the weight's columns, and the pieces, given in any order, make torchao's bytes."""
    torch.manual_seed(1)
    stored = (torch.randn(256, 192) * 0.05).to(dtype)  # in x out as the files hold it
    streamed = StreamedNF4((192, 256), dtype)
    for begin in (128, 0, 192, 64):
        streamed.add((0, 192), (begin, begin + 64), stored[begin:begin + 64].t())
    assert_same_bytes(streamed.finish(), torchao_whole(stored.t()))


def test_pieces_that_cut_a_block_of_64_are_refused():
    with pytest.raises(ValueError, match="whole blocks of 64"):
        StreamedNF4((64, 96), torch.float32)
    with pytest.raises(ValueError, match="whole blocks of 64"):
        StreamedNF4((64, 128), torch.float32).add((0, 64), (32, 96), torch.zeros(64, 64))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_reading_rank_quantizes_each_projection_a_block_at_a_time(kind, tiny_gpt2, tiny_llama, monkeypatch):
    """Streaming loading (one process: it holds every shard) reads every 4-bit projection whose rows hold whole
    blocks of 64 in pieces, never whole, and loads the base torchao would make of the whole weights (their digests:
    every byte of codes and scales). GPT-2's Conv1D weights are read by blocks of 64 of their stored rows; the tiny
    Llama's down_proj (176 inputs a row) is read whole."""
    from transformers import AutoModelForCausalLM

    folder = tiny_gpt2 if kind == "gpt2" else tiny_llama
    monkeypatch.setattr(streaming_load, "BLOCK_ELEMENTS", 8 * 64)
    reads: dict[str, list[int]] = {}
    read = SafetensorsFiles.read

    def spy(self, name, *args, **kwargs):
        tensor = read(self, name, *args, **kwargs)
        reads.setdefault(name, []).append(tensor.numel())
        return tensor

    monkeypatch.setattr(SafetensorsFiles, "read", spy)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    quantize_model(model, torch.float32, empty=True)
    digests = stream_weights(model, SafetensorsFiles(folder), where="model.name_or_path")
    quantize_model(reference, torch.float32)
    assert digests == digests_of(reference) and len(digests) == 2 * (4 if kind == "gpt2" else 7)
    files = SafetensorsFiles(folder)
    pieces = {}
    for name, parameter in model.named_parameters():
        if not is_nf4(parameter):
            continue
        stored_rows, row_length = files.shape(name)
        if parameter.shape[1] % BLOCK_SIZE:
            assert reads[name] == [stored_rows * row_length], name
            continue
        # at most a block of elements, or the fewest rows a piece may hold (64 stored rows of a Conv1D weight)
        fewest = BLOCK_SIZE * row_length if kind == "gpt2" else row_length
        assert max(reads[name]) <= max(8 * 64, fewest) and sum(reads[name]) == stored_rows * row_length, name
        pieces[name] = len(reads[name])
    assert max(pieces.values()) >= 4, pieces  # GPT-2's mlp.c_proj (256 stored rows), Llama's up/gate (176 rows)
