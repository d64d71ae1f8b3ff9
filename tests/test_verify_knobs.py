"""verify's knob probes (tools/knob_probes.py `Knob`, `KNOBS`; tools/verify.py runs them): which recipes a knob's
probes run for, and what the two probes change in the recipe. The probes themselves run in tests/test_verify.py (the chunked loss's PASS, and its
FAIL when a chunk drops a token)."""

from __future__ import annotations

from pathlib import Path

from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.tools import verify
from accel_fsdp.tools.knob_probes import KNOBS, Knob
from accel_fsdp.tools.verify import Verification, run_knob_probes

SFT = "model: {architecture: llama-3.2-1b}\ndata: {path: builtin:quickstart}\n"


def probes_of(knob: Knob, text: str, monkeypatch) -> dict[str, list[str]]:
    """The --set lists of the probes `verify` runs for the knob on the recipe `text`, without running them."""
    ran: dict[str, list[str]] = {}
    monkeypatch.setattr(verify, "run_probe", lambda v, name, sets, **_: ran.setdefault(name, sets))
    v = Verification(recipe_from_text(text, source="r.yaml"), None, 2, "fp32", "cpu", 2, Path("out"), [])
    run_knob_probes(v, knob, ["data.max_rows=64"], [])
    return ran


def test_the_chunked_loss_is_a_knob_proven_on_against_off(monkeypatch):
    knob = next(k for k in KNOBS if k.check == "chunked-loss")
    assert knob.check in verify.CHECKS
    ran = probes_of(knob, SFT, monkeypatch)  # on by default
    assert ran == {"chunked-loss-on": ["data.max_rows=64", "training.max_steps=2"],
                   "chunked-loss-off": ["data.max_rows=64", "training.chunked_loss=false", "training.max_steps=2"]}
    assert probes_of(knob, SFT + "training: {chunked_loss: false}", monkeypatch) == {}


def test_a_knob_whose_off_is_a_choice_is_compared_with_that_choice(monkeypatch):
    """A knob that is not a bool (a quantized base against the 16-bit one, say) names its baseline as `off`: a recipe
    at the baseline runs no probe, any other value is compared with it. Shown here on a key every recipe has."""
    knob = Knob("method", "training.method", lambda v: ({}, ""), off="sft")
    assert probes_of(knob, SFT, monkeypatch) == {}
    dpo = "model: {architecture: llama-3.2-1b}\ndata: {path: builtin:quickstart-pref, format: preference}\n"
    ran = probes_of(knob, dpo + "training: {method: dpo}", monkeypatch)
    assert ran["method-off"] == ["data.max_rows=64", "training.method=sft", "training.max_steps=2"]
