"""quickstart-qlora end to end and the export of a QLoRA run: the run writes its from-scratch base as a model folder,
`checkpoint consolidate --merge` alone merges the adapters into that base quantized and dequantized as training saw
it (checked by the fingerprint), `--base-model PATH` into the original weights; both load in transformers and equal
PEFT's own merge of the same adapters into the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_weights, run_cli, run_in_process

from accel_fsdp.tools.noise import reordered

pytestmark = pytest.mark.multiprocess
QUICK = ("--set", "training.max_steps=4", "--set", "training.warmup_steps=1", "--set", "checkpoint.every_steps=2", "--set", "data.max_rows=400",
         "--set", "training.eval_every_steps=null", "--set", "logging.sample_prompt=null")


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """quickstart-qlora, shortened, on 2 CPU ranks."""
    run = tmp_path_factory.mktemp("quickstart-qlora") / "run"
    proc = run_cli("recipe", "run", "quickstart-qlora", "--output-dir", run, *QUICK, check=0)
    assert "quantize  nf4: 14 decoder-block linear layers in 4 bits" in proc.stdout
    return run


def peft_merge(base_folder, adapter_folder, *, dequantized: bool) -> dict[str, torch.Tensor]:
    """PEFT's merge (merge_and_unload) of the adapters into the base, in fp32; `dequantized`: each 4-bit layer's weight
    first replaced by its NF4 round trip from the dtype the base is stored in, the one training quantized it from
    (model/build.py write_scratch_base: the compute dtype, bf16 on a CPU with native bf16, else fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from accel_fsdp.model.nf4 import layers_to_quantize, to_nf4

    stored = {name: tensor.dtype for name, tensor in load_weights(base_folder).items()}
    model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    if dequantized:
        for layer in layers_to_quantize(model):
            linear = model.get_submodule(layer.name)
            with torch.no_grad():
                source = linear.weight.to(stored[f"{layer.name}.weight"])
                linear.weight.copy_(to_nf4(source).get_original_weight().float())
    merged = PeftModel.from_pretrained(model, adapter_folder).merge_and_unload()
    return {k: v.detach() for k, v in merged.state_dict().items()}


def assert_weights_close(ours: dict, theirs: dict, terms: int) -> None:
    for name, tensor in ours.items():
        scale = float(theirs[name].abs().max())
        torch.testing.assert_close(tensor.float(), theirs[name], rtol=0, atol=reordered(terms) * scale + 1e-30,
                                   msg=name)


@pytest.mark.slow  # the fast tier trains QLoRA on 2 ranks (tests/test_qlora.py); its merge is the whole suite's
def test_quickstart_qlora_merges_with_merge_alone_into_what_training_saw(tmp_path, quickstart):
    """The guard of the export: --merge needs no base named (the run wrote its own); the merged folder loads in
    transformers and holds PEFT's merge of the adapters into the NF4 round trip of the base."""
    from transformers import AutoModelForCausalLM

    assert (quickstart / "base" / "config.json").exists()
    adapter = json.loads((quickstart / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(quickstart / "base")
    out = tmp_path / "export"
    proc = run_in_process("checkpoint", "consolidate", quickstart, out, "--merge", "--dtype", "fp32", check=0)
    assert "wrote" in proc.stdout and f"; the merged model: {out / 'merged'}" in proc.stdout  # where --merge wrote it
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32)
    ours = {k: v.detach() for k, v in merged.state_dict().items()}
    theirs = peft_merge(quickstart / "base", out, dequantized=True)
    assert ours.keys() == theirs.keys()
    assert_weights_close(ours, theirs, terms=16)  # r = 16 products per element of B @ A
    ids = torch.tensor([[3, 8, 12, 5, 9]])
    with torch.no_grad():
        assert torch.isfinite(merged(ids).logits).all()


@pytest.mark.slow
def test_base_model_merges_into_the_original_weights_and_a_changed_base_is_refused(tmp_path, quickstart, tiny_gpt2):
    """--base-model PATH: the unquantized weights plus the adapters (not the NF4 round trip); and --merge alone onto
    model files that changed since training is refused by the fingerprint, one message, nothing written."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "original"
    run_in_process("checkpoint", "consolidate", quickstart, out, "--merge", "--dtype", "fp32", "--base-model",
            quickstart / "base", check=0)
    ours = load_file(out / "merged" / "model.safetensors")
    theirs = peft_merge(quickstart / "base", out, dequantized=False)
    assert_weights_close(ours, theirs, terms=16)
    dequantized = peft_merge(quickstart / "base", out, dequantized=True)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.allclose(ours[name], dequantized[name])  # the two merges differ by the quantization error

    base = tmp_path / "changed"
    base.mkdir()
    for file in (quickstart / "base").iterdir():
        (base / file.name).write_bytes(file.read_bytes())
    weights = load_file(base / "model.safetensors")
    weights[name][0, 0] += 0.5
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    adapter = quickstart / "final" / "adapter_config.json"
    config = json.loads((quickstart / "checkpoints" / "step-000004" / "hf" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(quickstart / "base") and adapter.exists()
    (quickstart / "base").rename(quickstart / "base.orig")
    base.rename(quickstart / "base")
    try:
        proc = run_in_process("checkpoint", "consolidate", quickstart, tmp_path / "refused", "--merge")
    finally:
        (quickstart / "base").rename(tmp_path / "changed-again")
        (quickstart / "base.orig").rename(quickstart / "base")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "its adapters were trained on a 4-bit base with fingerprint" in proc.stderr
    assert "--base-model PATH" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "refused").exists()
    onto_gpt2 = run_in_process("checkpoint", "consolidate", quickstart, tmp_path / "onto-gpt2", "--merge",
                               "--base-model", tiny_gpt2, check=2).stderr  # another model: named as --base-model
    assert "error: --base-model: the adapters of model.layers.0.mlp.down_proj" in onto_gpt2
    assert not (tmp_path / "onto-gpt2").exists()
