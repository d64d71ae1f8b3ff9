"""Preference tuning trains without dropout (unless the recipe keeps it): the reference pass runs without it, so a
policy with dropout starts from a margin of dropout noise instead of 0."""

from __future__ import annotations

import json
import math

import pytest
from conftest import LOGIT_PATH, read_metrics, run_cli

from accel_fsdp.tools.noise import ROUNDOFF, SIGMAS

DROPOUT = ["--set", "model.config_overrides.resid_pdrop=0.1", "--set", "model.config_overrides.embd_pdrop=0.1",
           "--set", "model.config_overrides.attn_pdrop=0.1"]
"""Every GPT-2 checkpoint's dropout (quickstart-dpo's tiny GPT-2 sets it to 0)."""


def test_the_dropout_keys_of_each_architecture_are_found_and_lora_dropout_too():
    from transformers import AutoConfig

    from accel_fsdp.model.build import turn_off_dropout

    gpt2 = AutoConfig.for_model("gpt2")
    assert turn_off_dropout(gpt2) == {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
                                      "summary_first_dropout": 0.1}
    assert gpt2.resid_pdrop == gpt2.attn_pdrop == gpt2.embd_pdrop == 0.0
    llama = AutoConfig.for_model("llama", attention_dropout=0.2)
    assert turn_off_dropout(llama) == {"attention_dropout": 0.2} and llama.attention_dropout == 0.0
    assert turn_off_dropout(AutoConfig.for_model("llama")) == {}  # nothing to say when nothing was on


def test_lora_dropout_is_turned_off_in_the_built_model(tmp_path, tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.model.build import apply_lora, turn_off_dropout_layers

    recipe = recipe_from_text(f"model: {{name_or_path: '{tiny_llama}', lora: {{enabled: true, dropout: 0.05}}}}\n"
                              "data: {path: x.jsonl}\n", source="r.yaml")
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_llama), recipe)
    assert turn_off_dropout_layers(model) == {"model.lora.dropout": 0.05}
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


@pytest.mark.multiprocess
def test_dpo_on_a_gpt2_with_dropout_starts_at_ln2(tmp_path):
    """quickstart-dpo with GPT-2's dropout of 0.1, fp32, 2 ranks. The first step's policy is the reference, so every
    pair's margin z = beta ((log pi - log ref)(y_w) - (log pi - log ref)(y_l)) is fp32 noise and the loss is
    ln 2 - mean(z) / 2. The noise: both computations add the same products in other orders (batches of other shapes),
    each logit rounding along a path of under 2 x LOGIT_PATH products (width 128) with errors of the log-probabilities'
    scale; an answer's sum over at most seq_len tokens, the two answers of a pair and both computations, averaged over
    the step's pairs: within SIGMAS x beta x sqrt(seq_len x 2 x LOGIT_PATH / pairs) roundoffs of that scale. With
    dropout on (the fault), the first loss was 0.6878: 100 times that bound away."""
    run = tmp_path / "run"
    proc = run_cli("recipe", "run", "quickstart-dpo", "--output-dir", run, *DROPOUT,
                   "--set", "data.max_rows=400", "--set", "training.max_steps=1", "--set", "training.warmup_steps=0",
                   "--set", "training.eval_every_steps=null", "--set", "checkpoint.export_final=false",
                   "--set", "training.mixed_precision=fp32", check=0)
    [first] = [r for r in read_metrics(run) if r["kind"] == "train"]
    scale = max(abs(first["logps_chosen"]), abs(first["logps_rejected"]))
    bound = SIGMAS * 0.1 * math.sqrt(96 * 2 * LOGIT_PATH / 32) * ROUNDOFF["fp32"] * scale
    assert abs(first["loss"] - math.log(2)) <= bound, (first["loss"], bound)
    assert abs(first["reward_margin"]) <= 2 * bound
    assert ("  dropout   off for dpo (preference.keep_dropout: true keeps it): resid_pdrop 0.1, embd_pdrop 0.1, "
            "attn_pdrop 0.1, summary_first_dropout 0.1 -> 0") in proc.stdout, proc.stdout
    config = json.loads((run / "checkpoints" / "step-000001" / "hf" / "config.json").read_text())
    assert config["resid_pdrop"] == config["attn_pdrop"] == config["embd_pdrop"] == 0.0  # what it trained with


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_recipe_can_keep_dropout(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("recipe", "run", "quickstart-dpo", "--output-dir", run, *DROPOUT,
                   "--set", "preference.keep_dropout=true",
                   "--set", "data.max_rows=400", "--set", "training.max_steps=1", "--set", "training.warmup_steps=0",
                   "--set", "training.eval_every_steps=null", "--set", "checkpoint.export_final=false",
                   "--set", "training.mixed_precision=fp32", check=0)
    assert "  dropout   off" not in proc.stdout
    config = json.loads((run / "checkpoints" / "step-000001" / "hf" / "config.json").read_text())
    assert config["resid_pdrop"] == config["attn_pdrop"] == 0.1
