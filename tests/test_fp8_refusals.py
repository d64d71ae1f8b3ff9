"""training.mixed_precision: fp8 is refused before launch, with exit 2 and one message naming why, wherever torchao's
float8 training cannot run: GPT-2 (its Conv1D layers are not converted), CPU ranks, GPUs below compute capability 8.9
(simulated here: the decision reads the capability, tested without a GPU), FSDP1, LoRA. Where it can (Llama on an
8.9+ GPU), nothing is said."""

from __future__ import annotations

import types

import pytest
from click.testing import CliRunner

from accel_fsdp import hardware
from accel_fsdp.cli import main
from accel_fsdp.config.accelerate import load_accelerate_config
from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.config.settings import Setting, Source, resolve_settings
from accel_fsdp.model.fp8 import fp8_layer_names, fp8_problems

LLAMA = """
model: {architecture: llama, tokenizer: "builtin:quickstart",
        config_overrides: {num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, num_attention_heads: 4}}
data: {path: "builtin:quickstart", seq_len: 64}
training: {micro_batch_size: 1, global_batch_size: 8, max_steps: 4, mixed_precision: fp8}
"""


def judged(config: str, *, blocks=("LlamaDecoderLayer",), capability=(9, 0), overrides=()):
    """fp8_problems of the LLAMA recipe under `config` run on GPUs of `capability` (the device as a launch here sees
    it, not a config judged for other hardware)."""
    recipe = recipe_from_text(LLAMA, source="r.yaml", overrides=list(overrides))
    settings = resolve_settings(recipe, load_accelerate_config(config), cuda_available=config != "fsdp_cpu")
    view = types.SimpleNamespace(class_name="SomeForCausalLM", no_split_modules=list(blocks))
    return fp8_problems(recipe, settings, view, capability if config != "fsdp_cpu" else None)


def test_fp8_is_offered_for_llama_on_a_gpu_of_compute_capability_8_9_and_newer():
    assert judged("fsdp_2gpu", capability=(8, 9)) == []
    assert judged("fsdp_2gpu", capability=(9, 0)) == []


@pytest.mark.parametrize("capability,shown", [((8, 0), "8.0"), ((8, 6), "8.6"), ((7, 5), "7.5")])
def test_fp8_is_refused_on_gpus_older_than_ada(capability, shown):
    (problem,) = judged("fsdp_2gpu", capability=capability)
    assert str(problem).startswith("r.yaml:5: training.mixed_precision: fp8 cannot train here: ")
    assert f"the GPU's compute capability is {shown}, and float8 matrix products need 8.9 or newer" in str(problem)
    assert "use training.mixed_precision: bf16" in str(problem)


def test_every_reason_is_named_in_one_message():
    (problem,) = judged("fsdp1_2gpu", blocks=("GPT2Block",), capability=(8, 0),
                        overrides=["model.lora.enabled=true"])
    text = str(problem)
    for reason in ("GPT-2's projections are transformers' Conv1D layers", "compute capability is 8.0",
                   "this config uses FSDP1", "LoRA's frozen base would stay bf16"):
        assert reason in text


def test_a_gpu_config_judged_for_other_hardware_is_not_refused_for_this_machine():
    recipe = recipe_from_text(LLAMA, source="r.yaml")
    settings = resolve_settings(recipe, load_accelerate_config("fsdp_2gpu"), cuda_available=True)
    settings.device = Setting("cuda", Source.TARGET_HARDWARE, "this machine has no GPU")
    view = types.SimpleNamespace(class_name="LlamaForCausalLM", no_split_modules=["LlamaDecoderLayer"])
    assert fp8_problems(recipe, settings, view, None) == []


def test_fp8_on_gpt2_is_refused_before_launch_with_exit_2():
    result = CliRunner().invoke(main, ["recipe", "run", "quickstart", "--set", "training.mixed_precision=fp8"])
    assert result.exit_code == 2, result.output
    assert "training.mixed_precision: fp8 cannot train here: GPT-2's projections are transformers' Conv1D" in (
        result.output)
    assert "Traceback" not in result.output


def test_fp8_on_cpu_ranks_is_refused_before_launch_with_exit_2():
    result = CliRunner().invoke(main, ["recipe", "run", "quickstart-llama", "--set", "training.mixed_precision=fp8"])
    assert result.exit_code == 2, result.output
    assert "this run is on CPU, and float8 matrix products need a GPU of compute capability 8.9" in result.output
    assert "Traceback" not in result.output


def test_a_launch_on_simulated_gpus_below_8_9_is_refused_before_anything_starts(monkeypatch, tmp_path):
    """The capability the launch reads (hardware.cuda_capability) decides: two simulated A100s (8.0)."""
    monkeypatch.setattr(hardware, "visible_cuda_devices", lambda: 2)
    monkeypatch.setattr(hardware, "cuda_capability", lambda: (8, 0))
    result = CliRunner().invoke(main, ["recipe", "validate", "quickstart-llama", "--accelerate-config", "fsdp_2gpu",
                                       "--set", "training.mixed_precision=fp8"])
    assert result.exit_code == 2, result.output
    assert "the GPU's compute capability is 8.0" in result.output
    assert "Traceback" not in result.output


def test_the_converted_layers_are_the_blocks_linear_layers_not_the_head():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, vocab_size=1000, tie_word_embeddings=False))
    names = fp8_layer_names(model)
    assert len(names) == 2 * 7 and "lm_head" not in names
    assert all(n.startswith("model.layers.") for n in names)
