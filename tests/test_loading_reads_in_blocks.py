"""Loading that streams reads a large tensor a block of rows at a time (model/streaming_load.py BLOCK_ELEMENTS), so
rank 0 holds its shards and one block, never a whole embedding: in one process (no process group: one rank holds
everything), with a spy on every read of the model files; the math of which rows of a block go to which rank; and
the checksum taken right after loading, which widens no shard whole."""

from __future__ import annotations

import pytest
import torch

from accel_fsdp.model import streaming_load
from accel_fsdp.model.nf4 import digests_of, is_nf4, quantize_model
from accel_fsdp.model.streaming_load import SafetensorsFiles, stream_weights

BLOCK = 8 * 64
"""Eight rows of the tiny models' width-64 embeddings."""


@pytest.fixture
def reads(monkeypatch):
    """(name, elements) of every tensor read from the model files, with the block bound made small."""
    monkeypatch.setattr(streaming_load, "BLOCK_ELEMENTS", BLOCK, raising=False)
    seen = []
    read = SafetensorsFiles.read

    def spy(self, name, *args, **kwargs):
        tensor = read(self, name, *args, **kwargs)
        seen.append((name, tensor.numel()))
        return tensor

    monkeypatch.setattr(SafetensorsFiles, "read", spy)
    return seen


def unwritten(folder, quantize=False):
    """The model of `folder`'s config with every weight zero (NF4 weights allocated, unwritten)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    if quantize:
        quantize_model(model, torch.float32, empty=True)
    return model


def test_a_full_model_is_read_in_blocks_and_loaded_exactly(tiny_gpt2, reads):
    """Every tensor of a GPT-2 (its tied embeddings the largest) read in blocks of at most BLOCK elements (or one
    row), and every parameter equal to the file's."""
    from transformers import AutoModelForCausalLM

    model = unwritten(tiny_gpt2)
    stream_weights(model, SafetensorsFiles(tiny_gpt2), where="model.name_or_path")
    largest = max(elements for _, elements in reads)
    embeddings = model.get_input_embeddings().weight.numel()
    assert largest <= BLOCK < embeddings, f"rank 0 read {largest} elements at once: {sorted(reads)[-3:]}"
    expected = AutoModelForCausalLM.from_pretrained(tiny_gpt2).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_a_4bit_base_reads_its_plain_tensors_in_blocks(tiny_llama, reads):
    """With model.quantize the embeddings, norms and head stream in blocks, and the 4-bit projections quantize to
    the bytes of the whole-model path (how they are read: tests/test_streamed_quantization.py)."""
    from transformers import AutoModelForCausalLM

    model = unwritten(tiny_llama, quantize=True)
    digests = stream_weights(model, SafetensorsFiles(tiny_llama), where="model.name_or_path")
    projections = {name.removesuffix(".weight") for name, p in model.named_parameters() if is_nf4(p)}
    plain = [(name, elements) for name, elements in reads if name.removesuffix(".weight") not in projections]
    assert plain and max(elements for _, elements in plain) <= BLOCK
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama)
    quantize_model(reference, torch.float32)
    assert digests == digests_of(reference)
    expected = reference.state_dict()
    for name, parameter in model.named_parameters():
        if not is_nf4(parameter):
            assert torch.equal(parameter, expected[name]), name


@pytest.mark.parametrize("rows, index", [(10, [0, 1, 2, 3]), (9, [0, 1, 2, 3]), (10, [0, 1, 0, 1]), (5, [0, 0])])
def test_each_rank_gets_exactly_its_shard_rows_from_the_blocks(rows, index):
    """Over all blocks, a rank receives each row of its shard (FSDP2's chunks of ceil(rows / shards) rows; the last
    shorter or empty; replicas of a shard the same rows) once, in order, and no other."""
    from math import ceil

    shards = max(index) + 1
    chunk = ceil(rows / shards)
    for block_rows in (1, 2, 4, 100):
        got = {rank: [] for rank in range(len(index))}
        for block in streaming_load.row_blocks(rows, 64, block_rows * 64):
            assert block[1] - block[0] <= block_rows
            for rank, begin, end in streaming_load.block_targets(block, chunk, index, rows):
                assert block[0] <= begin < end <= block[1]
                got[rank] += range(begin, end)
        for rank, shard in enumerate(index):
            assert got[rank] == list(range(shard * chunk, min(rows, (shard + 1) * chunk)))


def test_the_shard_checksum_after_loading_copies_no_shard_whole(monkeypatch):
    """The sharding record's checksum (right after loading) sums in float64 a block at a time: a whole float64 copy
    of the embeddings' shard was the machine's peak after streaming loading."""
    from types import SimpleNamespace

    from accel_fsdp.train.sharding import shard_layout

    widened = []
    double = torch.Tensor.double

    def spy(self, *args, **kwargs):
        widened.append(self.numel())
        return double(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "double", spy)
    model = torch.nn.Embedding(4096, 1024)  # 4M elements
    acc = SimpleNamespace(process_index=0, device=torch.device("cpu"), num_processes=1, gather=lambda t: t)
    (row,) = shard_layout(acc, model)
    assert row[1] == pytest.approx(float(double(model.weight.detach()).sum()), rel=1e-12)
    assert max(widened) <= 2**20, f"a float64 copy of {max(widened):,} elements"


def test_the_adapters_are_sent_from_the_reading_ranks_draw_into_unwritten_ones(tmp_path, tiny_llama):
    """Under streamed loading only the reading rank draws the LoRA adapters (the others build them unwritten, so no
    rank but it ever holds them whole): what `stream_adapters` puts in the unwritten ones is its draw, the adapters
    every rank would have drawn."""
    from conftest import tiny_recipe
    from transformers import AutoConfig

    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.model.build import build_model

    recipe = load_recipe(tiny_recipe(tmp_path / "r.yaml", tiny_llama, "builtin:quickstart", model={
        "quantize": "nf4", "lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}))
    config = AutoConfig.from_pretrained(tiny_llama)
    drawn = build_model(recipe, config, empty=True)
    unwritten = build_model(recipe, config, empty=True, draw=False)
    adapters = streaming_load.adapters_to_send(drawn)
    assert len(adapters) == 2 * 2 * 2 and all(".lora_" in name for name in adapters)
    with torch.no_grad():
        for name, parameter in unwritten.named_parameters():
            if ".lora_" in name:
                parameter.fill_(float("nan"))  # what an unwritten allocation may hold
    streaming_load.stream_adapters(unwritten, adapters, BLOCK)
    for name, parameter in unwritten.named_parameters():
        if ".lora_" in name:
            assert torch.equal(parameter, adapters[name]), name
