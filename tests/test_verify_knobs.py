"""verify's knob probes (tools/knob_checks.py `Knob`, `KNOBS`; tools/verify.py runs them): which recipes a knob's
probes run for, and what the two probes change in the recipe. The probes themselves run in tests/test_verify.py (the
chunked loss's PASS, and its FAIL when a chunk drops a token) and tests/test_knob_checks.py (compile, offload)."""

from __future__ import annotations

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.tools import verify
from accel_fsdp.tools.knob_checks import KNOBS, Knob

SFT = "model: {architecture: llama-3.2-1b}\ndata: {path: builtin:quickstart}\n"
KNOB = {knob.check: knob for knob in KNOBS}


def probes_of(knob: Knob, text: str, precision: str = "fp32", *overrides: str) -> dict[str, list[str]]:
    """The --set lists of the probes `verify` runs for the knob on the recipe `text` (besides its base sets)."""
    return dict(knob.probes(recipe_from_text(text, source="r.yaml", overrides=list(overrides)), precision))


def test_every_knob_is_a_check_of_verify_in_one_table():
    assert list(KNOB) == ["chunked-loss", "compile", "activation-offload", "fp8", "quantize"]
    assert all(check in verify.CHECKS for check in KNOB)


def test_the_chunked_loss_is_a_knob_proven_on_against_off():
    ran = probes_of(KNOB["chunked-loss"], SFT)  # on by default
    assert ran == {"chunked-loss-on": ["training.max_steps=2"],
                   "chunked-loss-off": ["training.chunked_loss=false", "training.max_steps=2"]}
    assert probes_of(KNOB["chunked-loss"], SFT + "training: {chunked_loss: false}") == {}


def test_a_switch_is_proven_only_where_the_recipe_turns_it_on():
    assert probes_of(KNOB["compile"], SFT) == probes_of(KNOB["activation-offload"], SFT) == {}
    on = probes_of(KNOB["compile"], SFT, "bf16", "training.compile=true", "training.activation_offload=true")
    assert on == {"compile-on": ["training.max_steps=2"],
                  "compile-off": ["training.compile=false", "training.max_steps=2"]}
    assert probes_of(KNOB["activation-offload"], SFT, "bf16", "training.activation_offload=true") != {}


def test_fp8_is_compared_with_bf16_whoever_chose_the_precision():
    """The run's precision decides (the recipe's, else the accelerate config's); the off probe's --set of bf16 is a
    recipe value that wins over the accelerate config's (config/settings.py)."""
    assert probes_of(KNOB["fp8"], SFT, "bf16") == probes_of(KNOB["fp8"], SFT, "fp32") == {}
    ran = probes_of(KNOB["fp8"], SFT + "training: {mixed_precision: fp8}", "fp8")
    assert ran == {"fp8-on": ["training.max_steps=2"],
                   "fp8-off": ["training.mixed_precision=bf16", "training.max_steps=2"]}
    off = recipe_from_text(SFT + "training: {mixed_precision: fp8}", source="r.yaml", overrides=ran["fp8-off"])
    assert off.training.mixed_precision == "bf16"


def test_a_knob_whose_off_is_a_choice_is_compared_with_that_choice():
    """A knob that is not a bool (a quantized base against the 16-bit one, say) names its baseline as `off`: a recipe
    at the baseline runs no probe, any other value is compared with it. Shown here on a key every recipe has."""
    knob = Knob("method", "training.method", lambda recipe, precision, device: ({}, ""), off="sft")
    assert probes_of(knob, SFT) == {}
    dpo = "model: {architecture: llama-3.2-1b}\ndata: {path: builtin:quickstart-pref, format: preference}\n"
    ran = probes_of(knob, dpo + "training: {method: dpo}")
    assert ran["method-off"] == ["training.method=sft", "training.max_steps=2"]


def test_a_4bit_base_is_compared_with_the_16bit_base_under_the_same_adapters():
    """model.quantize: nf4 runs its probes against model.quantize=null (LoRA kept: the same adapters on the bf16
    base); a recipe without it runs none."""
    lora = "model: {architecture: llama-3.2-1b, lora: {enabled: true}%s}\ndata: {path: builtin:quickstart}\n"
    assert probes_of(KNOB["quantize"], lora % "", "bf16") == {}
    ran = probes_of(KNOB["quantize"], lora % ", quantize: nf4", "bf16")
    assert ran == {"quantize-on": ["training.max_steps=2"],
                   "quantize-off": ["model.quantize=null", "training.max_steps=2"]}
    off = recipe_from_text(lora % ", quantize: nf4", source="r.yaml", overrides=ran["quantize-off"])
    assert off.model.quantize is None and off.model.lora.enabled
