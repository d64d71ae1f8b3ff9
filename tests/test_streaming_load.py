"""Loading that streams (FSDP2 with fsdp_cpu_ram_efficient_loading): rank 0 reads the model files tensor by tensor
and sends each rank its shards. A run so loaded trains as one whose every rank read the files: for a full model (GPT-2
with its tied head) and for a 4-bit base, which rank 0 quantizes before it sends (the same fingerprint). The block
of rows rank 0 reads at once is made small (ACCEL_FSDP_LOAD_BLOCK: 5 rows of width 64), so blocks cross the ranks'
shards as a large model's embeddings do."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO, read_metrics, run_cli, tiny_recipe

from accel_fsdp.tools.noise import reordered

pytestmark = pytest.mark.multiprocess
STEPS = 4
SMALL_BLOCKS = {"ACCEL_FSDP_LOAD_BLOCK": str(5 * 64)}


def streaming_config(folder):
    """fsdp_cpu.yaml with rank-0 loading on."""
    config = yaml.safe_load((REPO / "accelerate_configs" / "fsdp_cpu.yaml").read_text())
    config["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] = True
    path = folder / "streaming.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def losses(run):
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


def run_both(tmp_path, model, **model_keys):
    recipe = tiny_recipe(tmp_path / "r.yaml", model, "builtin:quickstart", model=model_keys,
                         data={"max_rows": 200, "eval_fraction": 0},
                         training={"max_steps": STEPS, "lr": 1e-2, "mixed_precision": "fp32"},
                         logging={"every_steps": 1})
    streamed, everywhere = tmp_path / "streamed", tmp_path / "everywhere"
    run_cli("recipe", "run", recipe, "--output-dir", streamed, "--accelerate-config", streaming_config(tmp_path),
            env=SMALL_BLOCKS, check=0)
    run_cli("recipe", "run", recipe, "--output-dir", everywhere, check=0)
    return streamed, everywhere


@pytest.mark.slow
def test_a_streamed_4bit_base_is_the_base_every_rank_would_read(tmp_path, tiny_llama):
    """The 4-bit base rank 0 quantizes and streams has the fingerprint of the one each rank quantizes itself, and
    trains alike (fp32: the same sums, in the same orders, give the same losses up to reordering)."""
    qlora = {"quantize": "nf4", "lora": {"enabled": True, "target_modules": ["q_proj", "v_proj"]}}
    streamed, everywhere = run_both(tmp_path, tiny_llama, **qlora)
    ours, theirs = (json.loads((run / "sharding.json").read_text()) for run in (streamed, everywhere))
    assert ours["quantized_base"] == theirs["quantized_base"]
    assert ours["quantized_bytes"] == theirs["quantized_bytes"]
    assert losses(streamed) == pytest.approx(losses(everywhere), rel=STEPS * reordered(8 * 64))


@pytest.mark.slow
def test_a_streamed_full_model_trains_as_one_every_rank_read(tmp_path, tiny_gpt2):
    """A full fine-tune of GPT-2 (its head tied to the embeddings): every parameter streamed into the shards."""
    streamed, everywhere = run_both(tmp_path, tiny_gpt2)
    assert losses(streamed) == pytest.approx(losses(everywhere), rel=STEPS * reordered(8 * 64))
    record = json.loads((streamed / "sharding.json").read_text())
    assert record["rank0_only_loading"] is True


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_the_adapters_of_an_unwritten_base_are_drawn_as_those_of_a_read_one(tmp_path, tiny_llama, quantize):
    """Under streamed loading every rank builds the base unwritten (on meta, then allocated), and PEFT puts the
    adapters on their base layer's device: they must still get their first values, the same as a read base's (they
    were memory nothing wrote: NaN losses on a plain LoRA base)."""
    import torch
    from transformers import AutoConfig

    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.model.build import build_model

    recipe = load_recipe(tiny_recipe(tmp_path / "r.yaml", tiny_llama, "builtin:quickstart", model={
        "quantize": quantize, "lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}))
    config = AutoConfig.from_pretrained(tiny_llama)
    read = dict(build_model(recipe, config).named_parameters())
    unwritten = dict(build_model(recipe, config, empty=True).named_parameters())
    adapters = [name for name in read if ".lora_" in name]
    assert adapters and all(unwritten[name].device.type == "cpu" for name in adapters)
    for name in adapters:
        assert torch.equal(unwritten[name], read[name]), name
        assert bool((read[name] == 0).all()) is (".lora_B" in name), name
