"""model.quantize: nf4 without ranks: which layers become 4-bit and that they compute what their dequantized weights
compute (GPT-2's transposed Conv1D included), how the scales group, what is refused and why, the streaming reader's
files and checks, and the fingerprint a resume checks."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import LOGIT_PATH, save_tiny_model, tiny_recipe

from accel_fsdp.config.recipe import load_recipe
from accel_fsdp.errors import UserError
from accel_fsdp.model.quantize import (
    ALIGNED_SHARDS,
    BLOCK_SIZE,
    QuantizedLayer,
    layer_problems,
    nf4_bytes,
    scale_group,
)
from accel_fsdp.tools.noise import reordered

PROJECTIONS = {"gpt2": {"c_attn", "c_proj", "c_fc"},
               "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}}


@pytest.mark.parametrize("shape", [(64, 64), (32, 64), (176, 64), (64, 176), (4096, 4096), (1024, 8192),
                                   (14336, 4096), (3072, 1024)])
def test_scale_groups_depend_on_the_shape_alone_and_split_over_up_to_8_ranks(shape):
    numel = shape[0] * shape[1]
    group = scale_group(numel)
    blocks = numel // BLOCK_SIZE
    assert blocks % group == 0 and group <= 256
    if numel >= 8 * 256 * BLOCK_SIZE and shape[0] % 8 == 0:
        assert group == 256  # QLoRA's groups wherever a tensor is large enough: every real model's
    for ranks in (1, 2, 4, ALIGNED_SHARDS):
        if shape[0] % ranks == 0:
            assert (blocks // group) % ranks == 0, (shape, ranks)


def test_nf4_bytes_are_half_a_byte_a_weight_plus_the_scales():
    numel = 4096 * 4096
    assert nf4_bytes(numel) == numel // 2 + numel // 64 + 2 * numel // (64 * 256) + 2
    assert 0.51 < nf4_bytes(numel) / numel < 0.52


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {kind: save_tiny_model(tmp_path_factory.mktemp(kind), kind) for kind in ("gpt2", "llama")}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_4bit_model_computes_what_its_dequantized_weights_compute(tiny, kind):
    """Every attention and MLP projection of every block, and nothing else, holds an NF4Tensor; the model's logits
    are those of the original model with each such weight replaced by its dequantization (GPT-2's Conv1D transposed
    back), within the rounding of two orders of the same products."""
    from transformers import AutoModelForCausalLM

    from accel_fsdp.model.nf4 import NF4Linear, is_nf4, quantize_model

    model = AutoModelForCausalLM.from_pretrained(tiny[kind]).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny[kind]).eval()
    layers = quantize_model(model, torch.float32)
    assert {layer.name.rsplit(".", 1)[-1] for layer in layers} == PROJECTIONS[kind]
    assert len(layers) == 2 * (4 if kind == "gpt2" else 7)
    quantized = {n for n, p in model.named_parameters() if is_nf4(p)}
    assert quantized == {f"{layer.name}.weight" for layer in layers}
    assert not any(k in n for n in quantized for k in ("wte", "wpe", "embed", "norm", "ln_", "lm_head"))
    for layer in layers:
        module = model.get_submodule(layer.name)
        assert isinstance(module, NF4Linear) and module.from_conv1d == (kind == "gpt2")
        dequantized = module.weight.get_original_weight()
        target = reference.get_submodule(layer.name)
        with torch.no_grad():
            target.weight.copy_(dequantized.t() if layer.from_conv1d else dequantized)
    ids = torch.tensor([[5, 9, 14, 20, 31, 7, 3]])
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=reordered(LOGIT_PATH) * float(theirs.abs().max()))


def test_quantizing_twice_gives_the_same_codes_and_fingerprint(tiny):
    from transformers import AutoModelForCausalLM

    from accel_fsdp.model.nf4 import digests_of, quantize_model

    runs = []
    for _ in range(2):
        model = AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.bfloat16)
        quantize_model(model, torch.bfloat16)
        runs.append(digests_of(model))
    assert runs[0] == runs[1] and len(runs[0]) == 14
    assert all(name.startswith("model.layers.") for name in runs[0])


def test_a_quantized_base_without_lora_is_refused(tmp_path, tiny):
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny["llama"], "builtin:quickstart", model={"quantize": "nf4"})
    with pytest.raises(UserError, match=r"(?s)model.quantize: nf4 holds the frozen base in 4 bits, and without LoRA every "
                                        r"weight trains .*set model.lora.enabled: true"):
        load_recipe(recipe)


def test_an_unknown_quantization_is_refused_with_the_choices(tmp_path, tiny):
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny["llama"], "builtin:quickstart", model={"quantize": "int4"})
    with pytest.raises(UserError, match=r"model.quantize: expected one of nf4 or null, found 'int4'"):
        load_recipe(recipe)


QLORA = {"quantize": "nf4", "lora": {"enabled": True, "target_modules": ["q_proj", "v_proj"]}}


def test_fsdp1_and_models_whose_layers_we_do_not_know_are_refused(tmp_path, tiny):
    from accel_fsdp.config.accelerate import load_accelerate_config
    from accel_fsdp.config.settings import check_settings, resolve_settings
    from accel_fsdp.config.shipped import shipped_accelerate_configs

    recipe = load_recipe(tiny_recipe(tmp_path / "r.yaml", tiny["llama"], "builtin:quickstart", model=QLORA))
    config = load_accelerate_config(shipped_accelerate_configs()["fsdp1_2gpu"])
    problems = check_settings(resolve_settings(recipe, config, cuda_available=True), recipe)
    assert [p for p in problems if "model.quantize: nf4 shards the 4-bit weights with FSDP2 only" in str(p)]
    assert not [p for p in problems if "LoRA with FSDP1" in str(p)]  # one message, the quantization's
    mistral = tiny_recipe(tmp_path / "m.yaml", tiny["llama"], "builtin:quickstart", model=QLORA)
    text = mistral.read_text().replace(f"name_or_path: {tiny['llama']}", "architecture: mistral\n  tokenizer: "
                                       "builtin:quickstart\n  config_overrides: {num_hidden_layers: 2, hidden_size: "
                                       "64, intermediate_size: 128, num_attention_heads: 4}")
    mistral.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "accel_fsdp", "recipe", "validate", str(mistral)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert ("model.quantize: nf4 quantizes the decoder layers of GPT-2 and Llama models (GPT2Block, "
            "LlamaDecoderLayer), and this model's are MistralDecoderLayer") in proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr


def test_4bit_weights_that_do_not_split_over_the_ranks_are_named_with_the_counts_that_do():
    layers = [QuantizedLayer("model.layers.0.self_attn.k_proj", 32, 64, False)]
    assert layer_problems(layers, 8, "here") == []
    (problem,) = layer_problems(layers, 16, "here")
    assert "cannot split model.layers.0.self_attn.k_proj (32 x 64, 8 groups of 4-bit scales) evenly over 16" in str(
        problem)
    assert "shard over 1, 2, 4, 8 ranks" in str(problem)
    # a key that exists: the accelerate config's (fsdp.dp_shard_size, named before, is no recipe key)
    assert "parallelism_config_dp_shard_size under hybrid sharding" in str(problem)
    (odd,) = layer_problems([QuantizedLayer("h.0.attn.c_attn", 3, 40, True)], 1, "here")
    assert "blocks of 64" in str(odd) and "3 x 40 = 120 weights" in str(odd)


def test_importing_torchao_says_nothing_once_the_libraries_are_quiet():
    """torchao logs a line for each C extension a CPU-only torch cannot load: silenced by accel_fsdp/quiet.py."""
    code = ("from accel_fsdp.quiet import quiet_libraries; quiet_libraries(); "
            "from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stderr and "register_constant" not in proc.stderr


# ------------------------------------------------------------------------- the streaming reader, without ranks


def test_the_reader_reads_each_tensor_as_safetensors_does(tmp_path):
    from safetensors.torch import save_file

    from accel_fsdp.model.streaming_load import SafetensorsFiles

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7, dtype=torch.float64).to(torch.bfloat16),
               "c": torch.arange(6, dtype=torch.int64).view(2, 3), "d": torch.randn(0, 4)}
    save_file({k: tensors[k] for k in "ab"}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in "cd"}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors", '
        '"c": "model-00002-of-00002.safetensors", "d": "model-00002-of-00002.safetensors"}}')
    files = SafetensorsFiles(tmp_path)
    assert files.names() == set(tensors)
    for name, tensor in tensors.items():
        read = files.read(name)
        assert read.dtype == tensor.dtype and torch.equal(read, tensor), name
        assert files.shape(name) == list(tensor.shape)


def test_the_reader_names_what_the_files_lack_or_store_otherwise_before_sending_anything(tmp_path, tiny):
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from accel_fsdp.model.build import build_model
    from accel_fsdp.model.streaming_load import SafetensorsFiles, plan_problems

    folder = save_tiny_model(tmp_path / "model", "gpt2")
    weights = load_file(folder / "model.safetensors")
    del weights["transformer.h.0.mlp.c_fc.weight"]
    weights["transformer.h.1.attn.c_attn.bias"] = torch.zeros(5)
    weights["lm_head.weight"] = torch.randn_like(weights["transformer.wte.weight"])  # the config ties it to wte
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    recipe = load_recipe(tiny_recipe(tmp_path / "r.yaml", folder, "builtin:quickstart",
                                     model={"quantize": "nf4", "lora": {"enabled": True, "target_modules": ["c_attn"]}}))
    model = build_model(recipe, AutoConfig.from_pretrained(folder), dtype=torch.float32, empty=True)
    plan, problems = plan_problems(model, SafetensorsFiles(folder), "r.yaml: model.name_or_path")
    (problem,) = problems
    text = str(problem)
    assert "transformer.h.0.mlp.c_fc.weight: not in the model files" in text
    assert "transformer.h.1.attn.c_attn.bias: [5] in the files, [192] in the model its config builds" in text
    assert "tied parameters transformer.wte.weight, lm_head.weight are stored apart with different values" in text
    assert "fsdp_cpu_ram_efficient_loading: false" in text
    # the 4-bit weights are planned from the files' transposed Conv1D layout
    assert plan["base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"] == "transformer.h.0.attn.c_attn.weight"


def test_a_resume_onto_another_4bit_base_is_refused(tmp_path):
    from accel_fsdp.checkpoint.index import CheckpointInfo, check_quantized_base
    from accel_fsdp.checkpoint.records import Manifest

    saved = {"method": "nf4", "layers": 14, "block_size": 64, "fingerprint": "aaaa", "torchao": "0.18.0"}
    info = CheckpointInfo(path=tmp_path / "step-000002", step=2, complete=True,
                          manifest=Manifest(step=2, quantized_base=saved))
    check_quantized_base(info, dict(saved))
    with pytest.raises(UserError, match=r"(?s)step-000002: its adapters were trained on a 4-bit base \(nf4\) with "
                                        r"fingerprint aaaa, and the base rebuilt from the model files now has "
                                        r"fingerprint bbbb \(torchao 0.18.0 then, 0.19.0 now\).*fix: resume with the "
                                        r"model files \(and torchao\) the run started with"):
        check_quantized_base(info, {**saved, "fingerprint": "bbbb", "torchao": "0.19.0"})
