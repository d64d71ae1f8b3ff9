"""The chunked loss (training.chunked_loss) through the real CLI on 2 CPU ranks under FSDP2: the losses, gradient norms
and held-out losses of the plain path, and the head's FSDP unit all-gathered once a micro-step however many chunks
(counted by the `all-gathers` probe: a chunk loop that called the head module per chunk gathers it again in backward,
trl#6076). SFT on GPT-2 (its head tied to the embedding), DPO on Llama with its reference precomputed through the
same path, and LoRA-DPO with the head adapted and the reference its adapters switched off.

Tolerance: verify's equivalence bound for fp32 (the same sums in other orders over the global batch's tokens, per
step, adding up over the steps)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import precomputed_reference_start, read_metrics, run_cli, save_tiny_model, tiny_recipe

from accel_fsdp.tools.verify import equivalence_tolerance

pytestmark = pytest.mark.multiprocess

STEPS = 3


def run_both(tmp_path, recipe, *sets: str) -> dict[str, dict]:
    """The recipe with the chunked loss (16 positions a chunk: many chunks) and with the plain one, fp32, probing
    all-gathers: each run's rows, start summary and per-micro-step all-gathers of each rank."""
    out = {}
    for name, knob in (("chunked", ["training.loss_chunk_tokens=16"]), ("plain", ["training.chunked_loss=false"])):
        run = tmp_path / name
        args = [a for s in [*sets, "training.mixed_precision=fp32", f"training.max_steps={STEPS}", *knob]
                for a in ("--set", s)]
        proc = run_cli("recipe", "run", recipe, "--output-dir", run, *args, env={"ACCEL_FSDP_PROBE": "all-gathers"},
                       check=0)
        gathers = [[json.loads(line) for line in (run / "trace" / f"all-gathers-rank{rank}.jsonl").read_text()
                    .splitlines()][1:] for rank in (0, 1)]  # the first line is everything before the first forward
        out[name] = {"rows": read_metrics(run), "stdout": proc.stdout, "gathers": gathers}
    return out


def assert_same_training(runs: dict, tokens: int, micro_steps: int) -> None:
    tol = equivalence_tolerance("fp32", tokens, micro_steps, STEPS)
    train = {name: [r for r in run["rows"] if r["kind"] == "train"] for name, run in runs.items()}
    assert len(train["chunked"]) == len(train["plain"]) == STEPS
    for a, b in zip(train["chunked"], train["plain"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=tol["loss"]), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=tol["grad_norm"]), (a, b)
    held = {name: [r for r in run["rows"] if r["kind"] == "eval"] for name, run in runs.items()}
    assert held["chunked"] and len(held["chunked"]) == len(held["plain"])
    for a, b in zip(held["chunked"], held["plain"]):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=tol["loss"]), (a, b)
    # every micro-step gathers the same units, as often and as much, with the head in 16-position chunks
    chunked, plain = runs["chunked"]["gathers"], runs["plain"]["gathers"]
    # a rank's micro-steps; the probe writes a line at each training forward, so the last one has none
    assert len(chunked[0]) == len(plain[0]) == STEPS * micro_steps // 2 - 1
    assert chunked == plain


@pytest.mark.slow  # a knob's own promise: the whole suite's (docs/ARCHITECTURE.md, Tests)
def test_the_chunked_loss_on_2_ranks_is_the_plain_loss_and_gathers_the_head_once(tmp_path, tiny_gpt2, stories):
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, stories, training={"micro_batch_size": 2},
                         checkpoint={"export_final": False})
    runs = run_both(tmp_path, recipe)
    assert ("  loss      from the hidden states of the loss-carrying positions only, 16 tokens a chunk "
            "(training.loss_chunk_tokens)") in runs["chunked"]["stdout"]
    assert "  loss      full logits (training.chunked_loss: false)" in runs["plain"]["stdout"]
    # global 8 rows of 64 tokens; 2 rows a micro-step on 2 ranks: 2 micro-steps a rank, 4 in all
    assert_same_training(runs, tokens=8 * 64, micro_steps=4)
    assert all(line["all_gathers"] > 0 for line in runs["chunked"]["gathers"][0])


PREFERENCE = ["data.path=builtin:quickstart-pref", "data.format=preference", "data.max_rows=400",
              "data.seq_len=96", "training.method=dpo", "training.micro_batch_size=2", "training.global_batch_size=8"]


@pytest.mark.slow
def test_dpo_on_llama_with_a_precomputed_reference_is_the_plain_dpo(tmp_path, tiny_llama, stories):
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_llama, stories, checkpoint={"export_final": False})
    runs = run_both(tmp_path, recipe, *PREFERENCE)
    assert "reference: precomputed log-probabilities" in runs["chunked"]["stdout"]
    first = [r for r in runs["chunked"]["rows"] if r["kind"] == "train"][0]
    # the reference read the same way as the policy, in batches of other shapes (DPO's beta 0.1; 8 pairs a step)
    margin, loss = precomputed_reference_start(beta=0.1, seq_len=96, pairs=8,
                                               logp_scale=2 * max(-first["logps_chosen"], -first["logps_rejected"]))
    assert first["loss"] == pytest.approx(math.log(2), abs=loss) and abs(first["reward_margin"]) <= margin
    assert_same_training(runs, tokens=16 * 96, micro_steps=4)
    tol = equivalence_tolerance("fp32", 16 * 96, 4, STEPS)["loss"]  # sums of the same token log-probabilities
    for key in ("reward_margin", "reward_accuracy", "logps_chosen"):
        a, b = ([r[key] for r in runs[n]["rows"] if r["kind"] == "train"] for n in ("chunked", "plain"))
        assert a == pytest.approx(b, rel=tol, abs=tol), key


@pytest.mark.slow
def test_lora_dpo_with_the_head_adapted_is_the_plain_lora_dpo(tmp_path, stories):
    model = save_tiny_model(tmp_path / "llama", "llama")
    recipe = tiny_recipe(tmp_path / "r.yaml", model, stories, checkpoint={"export_final": False},
                         model={"lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0,
                                         "target_modules": ["q_proj", "v_proj", "lm_head"]}})
    runs = run_both(tmp_path, recipe, *PREFERENCE)
    assert "the LoRA-adapted head checkpointed" in runs["chunked"]["stdout"]
    assert "reference: the base model with the LoRA adapters switched off" in runs["chunked"]["stdout"]
    assert_same_training(runs, tokens=16 * 96, micro_steps=4)
