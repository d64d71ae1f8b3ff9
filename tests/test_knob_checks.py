"""`verify` proves each knob a recipe turns on (tools/knob_checks.py): 2 steps with it and without it, losses and
gradient norms within the knob's bound; the checks fail when the knob's arithmetic is broken on purpose
(ACCEL_FSDP_BREAK compile-skew, offload-bf16), so neither passes vacuously."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.tools.knob_checks import FP8_GRAD_BOUND, FP8_LOSS_BOUND, KNOBS

TINY = """
model: {architecture: gpt2, tokenizer: "builtin:quickstart", config_overrides: {n_layer: 2, n_embd: 64, n_head: 4}}
data: {path: "builtin:quickstart", seq_len: 64}
training: {micro_batch_size: 1, global_batch_size: 8, max_steps: 4}
"""
KNOB = {knob.check: knob for knob in KNOBS}


def test_a_knob_is_proven_only_where_the_recipe_turns_it_on():
    plain = recipe_from_text(TINY, source="r.yaml")
    on = recipe_from_text(TINY, source="r.yaml", overrides=["training.compile=true",
                                                             "training.activation_offload=true"])
    assert not any(knob.enabled(plain, "bf16") for knob in KNOBS)
    assert KNOB["compile"].enabled(on, "bf16") and KNOB["activation-offload"].enabled(on, "bf16")
    assert KNOB["fp8"].enabled(plain, "fp8") and not KNOB["fp8"].enabled(plain, "bf16")
    assert KNOB["fp8"].probes() == [("fp8-on", ["training.mixed_precision=fp8", "training.max_steps=2"]),
                                    ("fp8-off", ["training.mixed_precision=bf16", "training.max_steps=2"])]


def test_each_knob_states_its_bound():
    recipe = recipe_from_text(TINY, source="r.yaml")
    assert KNOB["activation-offload"].tolerance(recipe, "fp32", "cpu")[0] == {"loss": 0.0, "grad_norm": 0.0}
    assert KNOB["activation-offload"].tolerance(recipe, "bf16", "cuda")[0]["loss"] > 0
    compiled, stated = KNOB["compile"].tolerance(recipe, "bf16", "cuda")
    assert compiled == {"loss": 2 * 2 * 2**-8, "grad_norm": 2 * 2 * 8**0.5 * 2**-8} and "(bf16)" in stated
    fp8, stated = KNOB["fp8"].tolerance(recipe, "fp8", "cuda")
    assert fp8 == {"loss": 2 * FP8_LOSS_BOUND, "grad_norm": 2 * FP8_GRAD_BOUND} and "fp8 vs bf16" in stated


def report_of(folder) -> dict:
    return json.loads((folder / "report.json").read_text())


FP32 = ["--set", "training.mixed_precision=fp32"]  # the tightest bounds: a rounding to bf16 shows


@pytest.mark.multiprocess
def test_verify_proves_compile_and_offload_where_the_recipe_turns_them_on(tmp_path):
    out = tmp_path / "verify"
    proc = run_cli("verify", "quickstart", "--quick", "--only", "compile", "--only", "activation-offload",
                   "--only", "fp8", "--output-dir", out, *FP32, "--set", "training.compile=true",
                   "--set", "training.activation_offload=true", check=0)
    status = {c["name"]: c["status"] for c in report_of(out)["checks"]}
    assert status == {"compile": "PASS", "activation-offload": "PASS", "fp8": "SKIP"}, proc.stdout
    offload = next(c for c in report_of(out)["checks"] if c["name"] == "activation-offload")
    assert offload["data"] == {"loss_rel": 0.0, "grad_norm_rel": 0.0}  # exact on CPU
    assert set(report_of(out)["probes"]) == {"compile-on", "compile-off", "activation-offload-on",
                                             "activation-offload-off"}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("broken,check,key", [("compile-skew", "compile", "training.compile"),
                                              ("offload-bf16", "activation-offload", "training.activation_offload")])
def test_a_knob_check_fails_when_the_knobs_arithmetic_is_broken(tmp_path, broken, check, key):
    out = tmp_path / "verify"
    proc = run_cli("verify", "quickstart", "--quick", "--only", check, "--output-dir", out, *FP32,
                   "--set", f"{key}=true", env={"ACCEL_FSDP_BREAK": broken})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    (result,) = report_of(out)["checks"]
    assert result["status"] == "FAIL" and f"{key}=true vs false over 2 steps" in result["measured"], result
