"""The knobs' memory terms (planning/memory.py) and the advice of `estimate` and the dry run (planning/knob_advice.py):
activation offload moves the layers' activations to host memory, fp8 gathers the blocks' weights in float8 (the
chunked loss's logits term: tests/test_loss_memory.py), and a recipe that does not fit is told which knobs would make
it fit."""

from __future__ import annotations

from dataclasses import replace

from click.testing import CliRunner

from accel_fsdp.cli import main
from accel_fsdp.model.architectures import lookup
from accel_fsdp.model.facts import facts_of
from accel_fsdp.planning.knob_advice import fitting_knobs
from accel_fsdp.planning.memory import OFFLOAD_PREFETCH, MemoryInputs, estimate, layer_activation_bytes


def inputs(name: str, **changes) -> MemoryInputs:
    facts = facts_of(lookup(name))
    base = MemoryInputs(params=facts.params(), trainable=facts.params(), largest_unit=facts.block_params(), world=1,
                        shard_group=1, precision="bf16-mixed", micro_batch=4, seq_len=2048, shape=facts.shape())
    return replace(base, **changes)


def test_offloaded_activations_leave_the_device_but_one_block_and_the_prefetched():
    plain, offloaded = estimate(inputs("llama-3.2-1b")), estimate(inputs("llama-3.2-1b", activation_offload=True))
    layers, _ = layer_activation_bytes(inputs("llama-3.2-1b"))
    kept, moved = layer_activation_bytes(inputs("llama-3.2-1b", activation_offload=True))
    assert kept == layers / 16 * (1 + OFFLOAD_PREFETCH) and moved == layers - kept  # 16 blocks
    assert plain.activations - offloaded.activations == moved and offloaded.host == moved
    checkpointed = layer_activation_bytes(inputs("llama-3.2-1b", activation_checkpointing=True,
                                                 activation_offload=True))
    assert checkpointed[1] == (16 - 1 - OFFLOAD_PREFETCH) * 4 * 2048 * 2048 * 2  # the block inputs, in bf16


def test_the_prefetch_the_planner_counts_is_the_offloads():
    from accel_fsdp.train.activation_offload import PREFETCH

    assert OFFLOAD_PREFETCH == PREFETCH


def test_fp8_gathers_the_units_in_flight_at_one_byte_a_parameter():
    plain, fp8 = estimate(inputs("llama-3.2-1b")), estimate(inputs("llama-3.2-1b", fp8=True))
    assert plain.gathered - fp8.gathered == 2 * (2 - 1) * facts_of(lookup("llama-3.2-1b")).block_params()


def test_the_knobs_that_alone_make_it_fit_are_named_and_fp8_only_for_llama():
    gpt2 = inputs("gpt2-xl", micro_batch=8, seq_len=1024, world=2, shard_group=2)
    fitting, together = fitting_knobs(gpt2, 0.9 * 24 * 2**30)
    assert [s for s, _ in fitting] == ["model.activation_checkpointing: true", "training.activation_offload: true"]
    assert together is None
    _, together = fitting_knobs(inputs("llama-3.2-1b", seq_len=8192, micro_batch=8), 0.9 * 12 * 2**30)
    assert together[0][-1].startswith("training.mixed_precision: fp8")


def test_the_chunked_loss_is_offered_to_a_recipe_that_turned_it_off():
    """Llama 3.2 1B at 8,192 tokens on 8 GPUs of 8 GiB: the full logits alone take 11.7 GiB, one chunk 0.4 GiB."""
    plain = inputs("llama-3.2-1b", micro_batch=1, seq_len=8192, world=8, shard_group=8, activation_checkpointing=True,
                   chunked_loss=False)
    fitting, together = fitting_knobs(plain, 8 * 2**30)
    assert [s for s, _ in fitting] == ["training.chunked_loss: true"] and together is None
    assert fitting[0][1] == estimate(replace(plain, chunked_loss=True)).total
    assert "training.chunked_loss" not in str(fitting_knobs(replace(plain, chunked_loss=True), 1 * 2**30))  # it is on


def test_the_recipes_knobs_reach_the_memory_formulas_from_one_place():
    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.planning.knob_advice import recipe_settings

    recipe = recipe_from_text("model: {architecture: llama-3.2-1b}\ndata: {path: builtin:quickstart}\n"
                              "training: {chunked_loss: false, loss_chunk_tokens: 256, activation_offload: true}\n",
                              source="r.yaml")
    assert recipe_settings(recipe, "fp8") == dict(chunked_loss=False, loss_chunk_tokens=256, pairs=False,
                                                  activation_offload=True, fp8=True)
    assert recipe_settings(recipe, "bf16")["fp8"] is False


def test_estimate_says_which_knobs_would_make_a_recipe_fit():
    result = CliRunner().invoke(main, ["estimate", "gpt2-xl", "--gpus", "2", "--gpu-memory", "24GB", "--micro-batch",
                                       "8", "--seq-len", "1024", "--strategy", "FULL_SHARD", "--no-offload"])
    assert result.exit_code == 0, result.output
    assert "nothing fits" in result.output
    assert "  fits with model.activation_checkpointing: true (" in result.output
    assert "  fits with training.activation_offload: true (" in result.output


def test_the_dry_run_says_which_knobs_would_make_a_recipe_fit(cpu_with_native_bf16):  # the bf16 plan
    result = CliRunner().invoke(main, ["recipe", "run", "quickstart-llama", "--dry-run", "--gpu-memory", "1GB",
                                       "--set", "training.micro_batch_size=1024", "--set",
                                       "training.global_batch_size=2048"])
    assert result.exit_code == 0, result.output
    assert "does NOT fit in 1.00 GiB per GPU" in result.output
    assert "  fits with model.activation_checkpointing: true (" in result.output
    assert "training.activation_offload" not in result.output  # 2 blocks: one computing, the prefetch: none moves


def test_a_lora_recipe_that_does_not_fit_is_offered_a_4bit_base():
    """llama-3.1-8b with LoRA (about 0.5% of it trainable) on one 16 GiB GPU: its bf16 base alone is 15 GiB; in NF4
    it fits. A full fine-tune is never offered it (model.quantize needs LoRA)."""
    lora = inputs("llama-3.1-8b", trainable=40_000_000, frozen_bytes=2, micro_batch=1, seq_len=1024,
                  activation_checkpointing=True)
    fitting, _ = fitting_knobs(lora, 16 * 2**30)
    assert [s for s, _ in fitting] == ["model.quantize: nf4"]
    assert fitting[0][1] < 0.5 * estimate(lora).total
    assert "model.quantize" not in str(fitting_knobs(inputs("llama-3.1-8b", micro_batch=1, seq_len=1024), 16 * 2**30))
