"""`verify` proves each knob a recipe turns on (tools/knob_checks.py): 2 steps with it and without it, losses and
gradient norms within the knob's bound; the checks fail when the knob's arithmetic is broken on purpose
(ACCEL_FSDP_BREAK compile-skew, offload-bf16; the chunked loss's in tests/test_verify.py), so none passes vacuously.
Which recipes run which probes: tests/test_verify_knobs.py."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.tools.knob_checks import FP8_GRAD_BOUND, FP8_LOSS_BOUND, KNOBS, NF4_RMS_ERROR, QUANTIZE_BOUND

TINY = """
model: {architecture: gpt2, tokenizer: "builtin:quickstart", config_overrides: {n_layer: 2, n_embd: 64, n_head: 4}}
data: {path: "builtin:quickstart", seq_len: 64}
training: {micro_batch_size: 1, global_batch_size: 8, max_steps: 4}
"""
KNOB = {knob.check: knob for knob in KNOBS}


def test_each_knob_states_its_bound():
    recipe = recipe_from_text(TINY, source="r.yaml")
    assert KNOB["activation-offload"].tolerance(recipe, "fp32", "cpu")[0] == {"loss": 0.0, "grad_norm": 0.0}
    assert KNOB["activation-offload"].tolerance(recipe, "bf16", "cuda")[0]["loss"] > 0
    compiled, stated = KNOB["compile"].tolerance(recipe, "bf16", "cuda")
    assert compiled == {"loss": 2 * 2 * 2**-8, "grad_norm": 2 * 2 * 8**0.5 * 2**-8} and "(bf16)" in stated
    fp8, stated = KNOB["fp8"].tolerance(recipe, "fp8", "cuda")
    assert fp8 == {"loss": 2 * FP8_LOSS_BOUND, "grad_norm": 2 * FP8_GRAD_BOUND} and "fp8 vs bf16" in stated
    # the chunked loss: micro-steps x the backward's vocabulary blocks (64 tokens a micro-step, one block of them)
    assert KNOB["chunked-loss"].tolerance(recipe, "bf16", "cuda")[0] == compiled
    chunked = recipe_from_text(TINY, source="r.yaml", overrides=["training.loss_chunk_tokens=16"])
    assert KNOB["chunked-loss"].tolerance(chunked, "bf16", "cuda")[0]["grad_norm"] == 2 * 2 * 32**0.5 * 2**-8
    nf4, stated = KNOB["quantize"].tolerance(recipe, "bf16", "cpu")
    assert nf4 == {"loss": 2 * QUANTIZE_BOUND, "grad_norm": 2 * QUANTIZE_BOUND} and "NF4 vs the 16-bit base" in stated
    # an exact knob of an fp8 recipe is held to bf16's model (the precision outside the float8 products)
    assert KNOB["compile"].tolerance(recipe, "fp8", "cuda")[0] == KNOB["chunked-loss"].tolerance(recipe, "fp8",
                                                                                                "cuda")[0] == compiled


def report_of(folder) -> dict:
    return json.loads((folder / "report.json").read_text())


FP32 = ["--set", "training.mixed_precision=fp32"]  # the tightest bounds: a rounding to bf16 shows


@pytest.mark.slow
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


def test_nf4_moves_normal_weights_by_at_most_its_stated_rms_error():
    """The quantize knob's bound rests on NF4's relative rms error on normally distributed weights (QLoRA's premise):
    torchao's quantization of the tests' block and group sizes, in both compute dtypes, stays under NF4_RMS_ERROR; a
    4-bit base whose codes or scales were scrambled would move its weights by their whole size."""
    import torch

    from accel_fsdp.model.nf4 import to_nf4

    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(1024, 1024, generator=generator) * 0.02
    for dtype in (torch.bfloat16, torch.float32):
        dequantized = to_nf4(weights.to(dtype)).get_original_weight().float()
        error = ((dequantized - weights).pow(2).mean() / weights.pow(2).mean()).sqrt().item()
        assert 0.05 < error < NF4_RMS_ERROR, (dtype, error)
        shuffled = dequantized.reshape(-1)[torch.randperm(weights.numel(), generator=generator)].view_as(weights)
        assert ((shuffled - weights).pow(2).mean() / weights.pow(2).mean()).sqrt().item() > 1


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("broken", [None, "nf4-scales"])
def test_verify_holds_a_4bit_base_to_its_bound_against_the_16bit_one(tmp_path, broken):
    """quickstart-qlora's NF4 base against the bf16 one under the same adapters, 2 steps each on 2 ranks: within the
    quantize knob's bound; 4-bit weights dequantized 16 times too large (their block scales misread) fail it."""
    out = tmp_path / "verify"
    proc = run_cli("verify", "quickstart-qlora", "--quick", "--only", "quantize", "--output-dir", out,
                   env={"ACCEL_FSDP_BREAK": broken} if broken else None, check=None)
    (result,) = report_of(out)["checks"]
    assert set(report_of(out)["probes"]) == {"quantize-on", "quantize-off"}
    assert "model.quantize=nf4 vs null over 2 steps" in result["measured"], result
    if broken is None:
        assert proc.returncode == 0 and result["status"] == "PASS", proc.stdout[-2000:]
        assert max(result["data"].values()) < 2 * QUANTIZE_BOUND
    else:
        assert proc.returncode == 1 and result["status"] == "FAIL", result
