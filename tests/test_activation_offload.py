"""training.activation_offload: the tensors a forward saves for its backward go to host memory and come back, byte for
byte: the same loss and gradients exactly; with activation checkpointing only the blocks' inputs move (what the block
saves inside goes to the checkpoint); on 2 CPU ranks a run with it trains as one without."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import read_metrics, run_cli, tiny_recipe

from accel_fsdp.train.activation_offload import ActivationOffload, kept_because

TOKENS, HIDDEN, MLP, VOCAB = (2, 24), 64, 160, 300


def tiny_llama(checkpointed: bool):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=MLP,
                                         num_attention_heads=4, vocab_size=VOCAB))
    if checkpointed:  # as train/accelerator.py apply_activation_checkpointing wraps each block
        for i, block in enumerate(model.model.layers):
            model.model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model


def step(model, offload: ActivationOffload | None):
    """One forward and backward; the loss, the gradients, and the shapes of the tensors that were offloaded."""
    ids = torch.randint(0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(1))
    moved = []
    if offload is not None:
        pack = offload._pack

        def spy(tensor):
            saved = pack(tensor)
            if saved is not tensor:
                moved.append(tuple(tensor.shape))
            return saved

        offload._pack = spy
    with offload.saving() if offload is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                                                lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], moved


@pytest.mark.parametrize("checkpointed", [False, True])
def test_offloaded_activations_give_the_same_loss_and_gradients_bit_for_bit(checkpointed):
    loss, grads, _ = step(tiny_llama(checkpointed), None)
    offload = ActivationOffload(torch.device("cpu"))
    offloaded_loss, offloaded_grads, moved = step(tiny_llama(checkpointed), offload)
    assert moved and offload.peak_on_host > 0
    assert offload.on_host == 0  # every copy was brought back
    assert torch.equal(loss, offloaded_loss)
    for plain, offloaded in zip(grads, offloaded_grads, strict=True):
        assert torch.equal(plain, offloaded)


def test_with_activation_checkpointing_only_the_blocks_inputs_move_from_the_blocks():
    """Without checkpointing the blocks' insides move (the MLP's width, attention's heads); with it none of them do,
    and each block's input (tokens x hidden) does."""
    _, _, everything = step(tiny_llama(False), ActivationOffload(torch.device("cpu")))
    _, _, inputs = step(tiny_llama(True), ActivationOffload(torch.device("cpu")))
    inside = [s for s in everything if MLP in s or len(s) == 4]
    assert inside
    assert not [s for s in inputs if MLP in s or len(s) == 4], inputs
    assert inputs.count((*TOKENS, HIDDEN)) >= 2  # the two blocks' inputs (and the final norm's)
    assert len(inputs) < len(everything) / 4


def test_parameters_subclasses_and_small_tensors_stay():
    weight = torch.nn.Parameter(torch.randn(64, 64))
    assert kept_because(weight, "cpu", 0) == "a parameter or a view of one"
    assert kept_because(weight.t(), "cpu", 0) == "a parameter or a view of one"
    assert kept_because(torch.randn(4), "cpu", 1024) == "small"
    assert kept_because(torch.randn(64, 1).expand(64, 64), "cpu", 0) == "not dense"
    assert kept_because(torch.randn(64, 64), "cuda", 0) == "not on the device"
    assert kept_because(torch.randn(64, 64), "cpu", 1024) is None


@pytest.mark.slow  # a knob's own promise: the whole suite's (docs/ARCHITECTURE.md, Tests)
@pytest.mark.multiprocess
def test_a_run_with_activation_offload_trains_exactly_as_one_without(tmp_path, tiny_gpt2, stories):
    """The core promise on 2 CPU ranks, with activation checkpointing: the same losses and gradient norms, exactly,
    and the knobs probe saw bytes held on the host."""
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, stories, training={"max_steps": 2},
                         model={"activation_checkpointing": True}, checkpoint={"export_final": False})
    rows = {}
    for offload in (False, True):
        folder = tmp_path / f"offload-{offload}"
        proc = run_cli("recipe", "run", recipe, "--output-dir", folder, "--set",
                       f"training.activation_offload={offload}", env={"ACCEL_FSDP_PROBE": "knobs"}, check=0)
        rows[offload] = [(r["loss"], r["grad_norm"]) for r in read_metrics(folder) if r["kind"] == "train"]
    assert "  offload   activations saved for the backward go to host memory" in proc.stdout
    assert rows[True] == rows[False] and len(rows[True]) == 2
    trace = (tmp_path / "offload-True" / "trace" / "knobs-rank0.jsonl").read_text().splitlines()
    assert json.loads(trace[-1])["offload_peak_bytes"] > 0
