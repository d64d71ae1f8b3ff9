"""`checkpoint consolidate --merge --base-model PATH` with a base the adapters were not trained on (another
architecture, another width): refused naming --base-model, the adapted weight and both shapes, before PEFT, whose own
answers were a traceback (a size mismatch) or a message blaming the checkpoint (no matching module). Both merges, the
plain one and QLoRA's streamed one, check the same way (checkpoint/merge.py adapter_misfit)."""

from __future__ import annotations

import pytest
import torch

from accel_fsdp.errors import UserError


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_llama):
    """A PEFT adapter folder over the tiny Llama (q_proj and v_proj, r 4), as an export writes one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("adapter")
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def narrow_llama(tmp_path_factory):
    """A Llama with the tiny one's module names and a width of 32 instead of 64."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from accel_fsdp.data.synthetic import build_tokenizer

    folder = tmp_path_factory.mktemp("narrow-llama")
    tok = build_tokenizer()
    config = AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  vocab_size=len(tok))
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def merges(adapter, out, base):
    """The plain merge and the streamed one (QLoRA's, here without a quantized base), each onto `base`."""
    from accel_fsdp.checkpoint.consolidate import _merge_lora
    from accel_fsdp.checkpoint.merge import merge_streaming

    yield lambda: _merge_lora(adapter, out / "plain", "fp32", str(base))
    yield lambda: merge_streaming(adapter, out / "streamed", base=str(base), dtype="fp32", quantized_base=None,
                                  max_shard_size=1 << 30, where=str(adapter), base_where="--base-model")


def test_a_base_of_another_width_is_refused_with_both_shapes(tmp_path, adapter, narrow_llama):
    for merge in merges(adapter, tmp_path, narrow_llama):
        with pytest.raises(UserError, match=r"(?s)^--base-model: the adapter of model\.layers\.0\.self_attn\.q_proj "
                           r"is for a 64 x 64 weight, and .*narrow-llama.* has model\.layers\.0\.self_attn\.q_proj\."
                           r"weight of 32 x 32.*the base model the adapters were trained on \(--base-model PATH\)"):
            merge()


def test_a_base_of_another_architecture_is_refused_naming_the_missing_weight(tmp_path, adapter, tiny_gpt2):
    from accel_fsdp.checkpoint.consolidate import _merge_lora

    with pytest.raises(UserError, match=r"(?s)--base-model.*the adapter of model\.layers\.0\.self_attn\.q_proj has no "
                       r"weight model\.layers\.0\.self_attn\.q_proj\.weight in .*tiny-gpt2"):
        _merge_lora(adapter, tmp_path / "plain", "fp32", str(tiny_gpt2))


def test_the_base_the_adapters_were_trained_on_still_merges(tmp_path, adapter, tiny_llama):
    for merge in merges(adapter, tmp_path, tiny_llama):
        merge()
    assert (tmp_path / "plain" / "config.json").exists() and (tmp_path / "streamed" / "config.json").exists()
