"""An fp8 recipe's verify (GPU only, so its decisions are tested here): the run-to-run checks (equivalence, resume)
hold to float8's bound from the noise model, and packing is measured in the recipe's bf16 twin probe, where a leak
between documents is not hidden by float8's rounding."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.tools import verify
from accel_fsdp.tools.noise import FLOAT8_ROUNDOFF, ROUNDOFF, equivalence_tolerance

FP8 = "model: {architecture: llama-3.2-1b}\ndata: {path: builtin:quickstart}\ntraining: {mixed_precision: fp8}\n"


def test_two_fp8_runs_of_the_same_batches_are_held_to_float8s_units():
    tol = equivalence_tolerance("fp8", tokens=4096, micro_steps=4, steps=2)
    assert tol == {"loss": 2 * 2 * FLOAT8_ROUNDOFF["e4m3"], "grad_norm": 2 * 2 * math.sqrt(4) * FLOAT8_ROUNDOFF["e5m2"]}
    bf16 = equivalence_tolerance("bf16", tokens=4096, micro_steps=4, steps=2)
    assert tol["loss"] == bf16["loss"] * FLOAT8_ROUNDOFF["e4m3"] / ROUNDOFF["bf16"]


def test_an_fp8_recipes_packing_is_probed_in_its_bf16_twin():
    recipe = recipe_from_text(FP8, source="r.yaml")
    plan = {name: (sets, packing) for name, sets, packing in verify.knob_probe_plan(recipe, "fp8", {"packing"})}
    assert plan == {verify.FP8_TWIN: (["training.mixed_precision=bf16", "training.max_steps=2"], True)}
    both = verify.knob_probe_plan(recipe, "fp8", {"packing", "fp8"})
    assert [(name, packing) for name, _, packing in both] == [("fp8-on", False), (verify.FP8_TWIN, True)]
    assert [name for name, *_ in verify.knob_probe_plan(recipe, "fp8", {"fp8"})] == ["fp8-on", verify.FP8_TWIN]
    bf16 = recipe_from_text(FP8.replace("fp8", "bf16"), source="r.yaml")
    assert verify.knob_probe_plan(bf16, "bf16", {"packing"}) == []


def probe(*differences: float):
    records = [{"relative_difference": d, "documents": 8, "sequences": 2, "layout": "padded", "attention": "sdpa"}
               for d in differences]
    return SimpleNamespace(ok=True, trace=lambda name: records if name == "packing" else [], failure=lambda: "")


def verification(precision: str, **probes) -> verify.Verification:
    return verify.Verification(recipe=None, config=None, world=2, precision=precision, device="cuda", steps=3,
                               out_dir=Path("."), overrides=[], probes=probes)


def test_the_packing_check_of_an_fp8_recipe_reads_the_bf16_twin_against_bf16s_limit():
    limit = verify.PACKING_LIMIT["bf16"]
    float8_noise, leak = 0.2, 0.5  # the fp8 reference's own rounding would hide a leak; the twin's does not
    ok = verify.check_packing(verification("fp8", reference=probe(float8_noise), **{verify.FP8_TWIN: probe(limit / 2)}))
    assert ok.status == "PASS" and "(bf16)" in ok.tolerance and verify.FP8_TWIN in ok.measured
    leaking = verify.check_packing(verification("fp8", reference=probe(0.0), **{verify.FP8_TWIN: probe(leak)}))
    assert leaking.status == "FAIL"
    plain = verify.check_packing(verification("bf16", reference=probe(limit / 2)))
    assert plain.status == "PASS" and verify.FP8_TWIN not in plain.measured
