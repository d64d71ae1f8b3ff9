"""The model facts `recipe list`, `validate` and `estimate` use instead of building models are transformers' own:
parameter counts (full and LoRA), block class, module classes, linear layers, context, and the config keys."""

from __future__ import annotations

import pytest
import torch

from accel_fsdp.model.facts import CONFIG_KEYS, facts_from_values, lora_targets

CASES = [
    ("gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 150, "n_positions": 128}),
    ("gpt2", {"n_layer": 3, "n_embd": 96, "n_head": 3, "vocab_size": 101, "n_inner": 200,
              "tie_word_embeddings": False}),
    ("llama", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 150, "max_position_embeddings": 128,
               "tie_word_embeddings": False}),
    ("llama", {"num_hidden_layers": 2, "hidden_size": 96, "intermediate_size": 200, "num_attention_heads": 4,
               "head_dim": 32, "vocab_size": 99, "tie_word_embeddings": True, "attention_bias": True,
               "mlp_bias": True}),
]


@pytest.mark.parametrize("model_type,values", CASES)
def test_facts_match_the_model_transformers_builds(model_type, values):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    facts = facts_from_values(model_type, values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **values))
    assert facts.params() == sum(p.numel() for p in model.parameters())
    assert facts.class_name == type(model).__name__
    assert facts.no_split_modules == sorted(model._no_split_modules)
    assert facts.module_classes == {type(m).__name__ for m in model.modules()}
    linears = {n.split(".")[-1] for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}
    assert facts.linear_names == linears
    block = next(m for m in model.modules() if type(m).__name__ == facts.no_split_modules[0])
    assert facts.block_params() == sum(p.numel() for p in block.parameters())
    context = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    assert facts.context == context
    targets = sorted(linears - {"lm_head"})[:2]
    with torch.device("meta"):
        peft = get_peft_model(model, LoraConfig(r=8, target_modules=targets, task_type="CAUSAL_LM"))
    assert facts.lora_params(targets, 8) == sum(p.numel() for p in peft.parameters() if p.requires_grad)
    # all-linear as PEFT expands it itself (every linear layer but the output head)
    with torch.device("meta"):
        peft = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **values)),
                              LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert facts.lora_params(["all-linear"], 8) == sum(p.numel() for p in peft.parameters() if p.requires_grad)
    leaves = {name.rsplit(".", 1)[-1] for name in peft.peft_config["default"].target_modules}
    assert sorted(lora_targets(["all-linear"], facts.linear_names)) == sorted(leaves)


@pytest.mark.parametrize("model_type", sorted(CONFIG_KEYS))
def test_config_keys_are_the_config_class_keys(model_type):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    assert CONFIG_KEYS[model_type] == set(cls().to_dict()) | set(cls.attribute_map)
    assert AutoConfig.for_model(model_type).model_type == model_type


def test_activation_names_are_transformers_own():
    from transformers.activations import ACT2FN

    from accel_fsdp.model.checks import ACTIVATIONS

    assert set(ACTIVATIONS) == set(ACT2FN)


def test_a_model_view_built_first_leaves_the_weights_drawn_later_as_they_were():
    """A rank builds the model on the meta device for its checks (train/setup.py) before it draws a from-scratch model.
    Skipping torch.nn.init's initializers while building it (a speed-up tried once) was captured for good by
    transformers' table of them (transformers/initialization.py, filled when first imported): every later model kept
    uninitialized memory, and quickstart's first loss was 88 where ln(vocabulary) is 5. In a fresh process, as a
    rank is: the weights drawn after a view are those drawn without one."""
    import contextlib
    import io
    import subprocess
    import sys

    draw = ("import torch; from transformers import AutoConfig, AutoModelForCausalLM\n"
            "config = AutoConfig.for_model('gpt2', n_layer=1, n_embd=32, n_head=2, vocab_size=64)\n"
            "{first}torch.manual_seed(0); w = AutoModelForCausalLM.from_config(config).transformer.h[0].attn.c_attn.weight\n"
            "print(float(w.detach().double().std()), float(w.detach().double().sum()))\n")
    view = "from accel_fsdp.model.build import meta_model, view_of; view_of(meta_model(config))\n"
    after_a_view = subprocess.run([sys.executable, "-c", draw.format(first=view)], capture_output=True, text=True,
                                  check=True).stdout.split()
    # Without one: here, where transformers was imported as any program imports it (same seed, same draws).
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(draw.format(first=""), {})
    assert printed.getvalue().split() == after_a_view, (printed.getvalue(), after_a_view)
    assert 0.015 < float(after_a_view[0]) < 0.025, after_a_view  # GPT-2's initializer_range, 0.02, over 3,072 values
