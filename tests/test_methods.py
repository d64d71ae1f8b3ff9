"""The training method as one component: the registry and the method modules agree, each pair method logs the one
list of statistics, rows keep their keys, and a `preference.*` setting the chosen method does not read is refused."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from click.testing import CliRunner
from conftest import REPO, collated, save_tiny_model, write_jsonl

from accel_fsdp.cli import main
from accel_fsdp.config.methods import METHODS, REGISTRY
from accel_fsdp.config.recipe import recipe_from_text
from accel_fsdp.data.prepare import prepare_data
from accel_fsdp.data.synthetic import build_tokenizer
from accel_fsdp.train.methods import Norm, build_loss_path, build_objective
from accel_fsdp.train.metrics import EvalRow, PairStatistics, TrainRow, row_from_dict, row_to_dict
from accel_fsdp.train.reference import NoReference

SHARED = {"__init__", "base", "logps", "chunked", "pairs"}
"""The modules of train/methods/ that are not a method."""


def test_every_registered_method_has_its_module_and_every_module_is_registered():
    folder = REPO / "accel_fsdp" / "train" / "methods"
    modules = {p.stem for p in folder.glob("*.py")} - SHARED
    assert modules == set(METHODS), "a method is one file under train/methods/ and one line of config/methods.py"
    for spec in REGISTRY:
        assert callable(importlib.import_module(f"accel_fsdp.train.methods.{spec.name}").build), spec.name
        assert spec.keys == () or spec.pairs, spec.name  # preference keys belong to pair methods


@pytest.mark.parametrize("method", [spec.name for spec in REGISTRY if spec.pairs])
def test_a_pair_method_logs_the_statistics_rows_write(tmp_path, method):
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    pairs = [{"prompt": "who has a dog ?", "chosen": "bob has a dog .", "rejected": "bob dog a has ."},
             {"prompt": "who has a cat ?", "chosen": "alice has a cat .", "rejected": "cat alice ."}]
    recipe = recipe_from_text(f"""
model: {{architecture: gpt2, tokenizer: "builtin:quickstart"}}
data: {{path: "{write_jsonl(tmp_path / 'p.jsonl', pairs)}", format: preference, seq_len: 32, eval_fraction: 0}}
training: {{method: {method}, micro_batch_size: 1, global_batch_size: 2, max_steps: 1}}
""", source="r.yaml")
    data = prepare_data(recipe, tok)
    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "m", "gpt2"))
    batch = collated([s for u in range(2) for s in data.sequences(u)], tok.pad_token_id)
    batch["reference_logps"] = torch.full((4,), -20.0)
    objective = build_objective(recipe, NoReference(), build_loss_path(recipe, model))
    with torch.no_grad():
        loss, sums = objective(model, batch, Norm(tokens=10, pairs=2))
        held_out = objective.evaluate(model, batch)
    assert set(sums) == set(PairStatistics.summed()) | {"pairs"}
    assert {total for total, _ in objective.eval_terms} | {count for _, count in objective.eval_terms} <= set(held_out)
    statistics = objective.statistics({k: float(v) for k, v in sums.items()})
    assert statistics.reward_margin == statistics.reward_chosen - statistics.reward_rejected
    assert math.isfinite(float(loss)) and f"  method    {method} (" in objective.summary()
    # rows write the statistics as the top-level keys they always had, and read them back
    row = TrainRow(step=1, loss=0.7, tokens_per_s=1.0, tokens_per_s_per_rank=1.0, step_time_s=1.0,
                   peak_memory_bytes=[1], preference=statistics)
    flat = row_to_dict(row)
    assert {"reward_chosen", "reward_margin", "logps_rejected"} <= set(flat) and "preference" not in flat
    assert row_from_dict(flat) == row
    held = row_to_dict(EvalRow(step=1, eval_loss=0.5, eval_ppl=1.6, preference=statistics))
    assert held["eval_reward_accuracy"] == statistics.reward_accuracy and "reward_accuracy" not in held


def test_an_sft_row_has_no_preference_keys():
    flat = row_to_dict(TrainRow(step=1, loss=2.0, tokens_per_s=1.0, tokens_per_s_per_rank=1.0, step_time_s=1.0,
                                peak_memory_bytes=[1]))
    assert not any(k.startswith(("reward", "logps")) for k in flat) and row_from_dict(flat).preference is None


@pytest.mark.parametrize("change,expected", [
    (["preference.gamma=0.5"], "preference.gamma: 0.5 has no effect with training.method dpo (only simpo reads it)"),
    (["training.method=simpo", "preference.lambda=0.2"],
     "preference.lambda: 0.2 has no effect with training.method simpo (only orpo reads it)"),
    (["training.method=orpo", "preference.beta=0.3"],
     "preference.beta: 0.3 has no effect with training.method orpo (only dpo, simpo read it)"),
    (["training.method=orpo", "preference.label_smoothing=0.1"],
     "preference.label_smoothing: 0.1 has no effect with training.method orpo"),
])
def test_a_preference_key_of_another_method_is_refused_with_its_fix(change, expected):
    result = CliRunner().invoke(main, ["recipe", "validate", "quickstart-dpo"] + [x for c in change for x in ("--set", c)])
    assert result.exit_code == 2 and expected in result.output, result.output
    key = expected.split(":")[0]
    assert f"fix: remove {key}" in result.output and "or use training.method:" in result.output


def test_preference_keys_with_sft_are_refused_unless_left_at_their_defaults():
    result = CliRunner().invoke(main, ["recipe", "validate", "quickstart", "--set", "preference.beta=0.2",
                                       "--set", "preference.keep_dropout=true"])
    assert result.exit_code == 2, result.output
    assert "preference.beta: 0.2 has no effect with training.method sft (only dpo, simpo read it)" in result.output
    assert "preference.keep_dropout: true has no effect with training.method sft" in result.output
    # a key written out at its default changes nothing: not refused (quickstart-dpo has label_smoothing: 0.0)
    for method in ("simpo", "orpo"):
        ok = CliRunner().invoke(main, ["recipe", "validate", "quickstart-dpo", "--set", f"training.method={method}"])
        assert ok.exit_code == 0, ok.output
    ok = CliRunner().invoke(main, ["recipe", "validate", "quickstart", "--set", "preference.gamma=1.0"])
    assert ok.exit_code == 0, ok.output


def test_orpo_on_an_answer_the_model_is_certain_of_has_finite_gradients():
    """Every token of the chosen answer at probability 1 (to fp32's precision: an overfit model, a short answer): its
    log odds are infinite, and their gradient was nan (torch.where's other branch too), which would stop the run. The
    odds-ratio term then goes to 0 with a gradient of 0, as in the limit; the NLL term keeps its own; an answer short
    of certain is computed as before."""
    from accel_fsdp.train.methods.orpo import CERTAIN, log1mexp, orpo_loss

    chosen = torch.tensor([0.0, -0.5], requires_grad=True)
    rejected = torch.tensor([-3.0, -1.0], requires_grad=True)
    out = orpo_loss(policy_chosen_logps=chosen, policy_rejected_logps=rejected, chosen_tokens=torch.tensor([2.0, 2.0]),
                    rejected_tokens=torch.tensor([2.0, 2.0]), lambda_=0.1)
    (out.losses + out.chosen_nll).sum().backward()
    assert torch.isfinite(chosen.grad).all() and torch.isfinite(rejected.grad).all()
    assert chosen.grad[0].item() == -1.0  # the NLL's alone
    assert 0 <= out.losses[0].item() < 1e-8  # 0.1 x log(1 + e^-(15.9 + 1.25)): the odds capped at log(1/CERTAIN)
    a_c, a_r = -0.25, -0.5
    odds = (a_c - math.log(-math.expm1(a_c))) - (a_r - math.log(-math.expm1(a_r)))
    # fp32 against float64: five elementwise functions (expm1, log, log1p, exp, logsigmoid), each within a few units of
    # 2^-24 on any CPU's kernels, through a chain whose condition number here is below 3: 1e-6 holds with room.
    assert out.losses[1].item() == pytest.approx(0.1 * math.log1p(math.exp(-odds)), rel=1e-6)
    assert log1mexp(torch.tensor(-CERTAIN)).item() == pytest.approx(math.log(CERTAIN), rel=1e-6)
