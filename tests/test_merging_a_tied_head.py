"""`checkpoint consolidate --merge` of LoRA adapters on an output projection tied to the input embeddings (GPT-2's
lm_head; Llama 3.2 1B's): the trained model adapted the head alone, the embeddings stayed as they were. PEFT's merge
added (alpha / r) B A to the one tensor both share, so the merged model's embeddings moved with the head (its logits
were 3.7 off the adapters' on this tiny GPT-2); the streamed merge (QLoRA, --base-model) found no lm_head.weight in the
files and refused. Both now write the head its own weight and tie_word_embeddings false.

Noise: the merged model and the adapted one compute the same logits in fp32, the adapters' product added to W before
the matmul or after: each logit within reordered(LOGIT_PATH) of the logits' scale, twice (both sides)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import LOGIT_PATH, load_weights

from accel_fsdp.errors import UserError
from accel_fsdp.tools.noise import reordered


@pytest.fixture
def adapted(tmp_path, tiny_gpt2):
    """A GPT-2 with adapters on c_attn and its tied lm_head, B drawn away from 0, saved as an adapter folder; its logits
    on a few tokens."""
    from transformers import AutoModelForCausalLM

    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.data.synthetic import build_tokenizer
    from accel_fsdp.model.build import apply_lora

    recipe = recipe_from_text(f"model: {{name_or_path: '{tiny_gpt2}', lora: {{enabled: true, target_modules: "
                              "[c_attn, lm_head]}}\ndata: {path: x.jsonl}\n", source="r.yaml")
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_gpt2), recipe).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter, save_embedding_layers=True)  # what PEFT chooses for an adapted head, said so
    build_tokenizer().save_pretrained(adapter)
    tokens = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return adapter, tokens, logits


@pytest.mark.parametrize("streamed", [False, True])
def test_a_merge_writes_an_adapted_tied_head_apart_from_the_embeddings(tmp_path, tiny_gpt2, adapted, streamed):
    from transformers import AutoModelForCausalLM

    from accel_fsdp.checkpoint.consolidate import _merge_lora
    from accel_fsdp.checkpoint.merge import merge_streaming
    from accel_fsdp.quiet import quiet_warnings

    adapter, tokens, logits = adapted
    out = tmp_path / "merged"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_warnings()  # as every command sets them (accel_fsdp/quiet.py)
        if streamed:  # the QLoRA path, here onto the unquantized base (--base-model)
            merge_streaming(adapter, out, base=str(tiny_gpt2), dtype="fp32", quantized_base=None,
                            max_shard_size=2**30, where="--base-model")
        else:
            _merge_lora(adapter, out, "fp32", None)
    # PEFT's warnings of what the merge handles (fan_in_fan_out per layer, the tied head) do not reach the user
    assert not [str(w.message) for w in caught if "fan_in_fan_out" in str(w.message)
                or "tie_word_embeddings" in str(w.message)], [str(w.message) for w in caught]
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    weights = load_weights(out)
    assert torch.equal(weights["transformer.wte.weight"], load_weights(tiny_gpt2)["transformer.wte.weight"])
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert merged.lm_head.weight.data_ptr() != merged.transformer.wte.weight.data_ptr()
    with torch.no_grad():
        again = merged(input_ids=tokens).logits
    bound = 2 * reordered(LOGIT_PATH) * max(1.0, float(logits.abs().max()))
    assert float((again - logits).abs().max()) <= bound


def test_a_streamed_merge_of_a_tied_head_onto_a_base_of_another_vocabulary_is_refused(tmp_path, adapted):
    """The head's adapters against the base's embeddings they are added to: a base of another vocabulary (another
    model given as --base-model) is the one message naming lm_head and both shapes, as for any adapted weight, where
    adding B A to the embeddings raised torch's size mismatch as a traceback."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from accel_fsdp.checkpoint.merge import merge_streaming
    from accel_fsdp.data.synthetic import build_tokenizer

    adapter, _, _ = adapted
    vocabulary = len(build_tokenizer()) + 8
    base = tmp_path / "wider-vocabulary"
    AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, n_positions=128,
                                                          vocab_size=vocabulary)).save_pretrained(base)
    with pytest.raises(UserError, match=rf"--base-model: the adapter of lm_head is for a \d+ x 64 weight, and .* has "
                                        rf"lm_head.weight of {vocabulary} x 64"):
        merge_streaming(adapter, tmp_path / "merged", base=str(base), dtype="fp32", quantized_base=None,
                        max_shard_size=2**30, where="runs/x/checkpoints/step-000002", base_where="--base-model")


@pytest.mark.parametrize("targets", [["q_proj", "lm_head"], ["all-linear", "lm_head"]])
def test_saving_an_adapted_untied_head_says_nothing(tiny_llama, targets):
    """Every checkpoint of a run with its head adapted (Accelerate's adapter-only save: PEFT's adapter state dict)
    made PEFT say on every rank that it saves the head's weight too ("Setting `save_embedding_layers` to `True`"):
    what the checkpoints are made to hold, nothing for the user to do. `all-linear` leaves the head out unless it is
    named too."""
    from peft import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.model.build import apply_lora
    from accel_fsdp.quiet import quiet_warnings

    recipe = recipe_from_text(f"model: {{name_or_path: '{tiny_llama}', lora: {{enabled: true, target_modules: "
                              f"{json.dumps(targets)}}}}}\ndata: {{path: x.jsonl}}\n", source="r.yaml")
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_llama), recipe)
    adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == ({"q_proj", "lm_head"} if targets[0] == "q_proj" else
                       {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_warnings()  # as every rank sets them
        saved = get_peft_model_state_dict(model)
    assert "base_model.model.lm_head.base_layer.weight" in saved  # what PEFT said it would do
    assert not [str(w.message) for w in caught], [str(w.message) for w in caught]
