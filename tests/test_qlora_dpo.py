"""DPO with a 4-bit base: the reference is the quantized base with the adapters switched off, so at the first step
policy and reference are one model and the loss is ln 2 exactly; then the reward accuracy rises."""

from __future__ import annotations

import math

import pytest
from conftest import read_metrics, run_cli

from accel_fsdp.tools.noise import ROUNDOFF, reordered

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_dpo_on_a_4bit_base_starts_at_ln2_with_the_adapters_off_as_reference(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("recipe", "run", "quickstart-qlora", "--output-dir", run, "--set", "training.method=dpo",
                   "--set", "data.path=builtin:quickstart-pref", "--set", "data.format=preference",
                   "--set", "data.seq_len=96", "--set", "training.max_steps=6", "--set", "training.warmup_steps=1",
                   "--set", "training.eval_every_steps=null", "--set", "logging.sample_prompt=null",
                   "--set", "logging.every_steps=1", check=0)
    assert "reference: the base model with the LoRA adapters switched off" in proc.stdout
    assert "quantize  nf4" in proc.stdout
    rows = [r for r in read_metrics(run) if r["kind"] == "train"]
    # B = 0: the policy is the reference bit for bit, so every pair's loss is -log sigmoid(0), one fp32 rounding of
    # ln 2; the step's loss is the mean of its 16 pairs, added over micro-steps and ranks in some order.
    assert rows[0]["loss"] == pytest.approx(math.log(2), rel=ROUNDOFF["fp32"] + reordered(16))
    assert max(r["reward_accuracy"] for r in rows[-3:]) > 0.5
