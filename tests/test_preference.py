"""Preference tuning (DPO, SimPO, ORPO): the published losses against an independent computation, the pairs as the
data builds them, the bad rows, and quickstart-dpo through the real CLI on 2 CPU ranks (ln 2 at the first step,
held-out reward accuracy, the same recipe with every method, split invariance and exact resume through verify)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import (
    collated,
    precomputed_reference_start,
    read_metrics,
    run_cli,
    save_tiny_model,
    tiny_recipe,
    write_jsonl,
)

from accel_fsdp.cli import main
from accel_fsdp.config.recipe import PreferenceConfig, recipe_from_text
from accel_fsdp.config.shipped import shipped_recipes
from accel_fsdp.data.prepare import prepare_data
from accel_fsdp.data.store import IGNORE_INDEX
from accel_fsdp.data.synthetic import build_tokenizer
from accel_fsdp.data.tokenize import Example, fit_pair
from accel_fsdp.errors import UserError
from accel_fsdp.train.methods import Norm, build_loss_path, build_objective
from accel_fsdp.train.reference import NoReference

PAIRS = [{"prompt": "alice has a red cat . what color is the cat of alice ?", "chosen": "the cat is red .",
          "rejected": "red the . is cat"},
         {"prompt": "bob has a dog . who has a dog ?", "chosen": "bob has a dog .", "rejected": "bob has swim dog ."},
         {"prompt": "emma and the duck go to the park . where do they go ?", "chosen": "they go to the park .",
          "rejected": "they go to the happy ."}]


def recipe(path, method="dpo", seq_len=64):
    return recipe_from_text(f"""
model: {{architecture: gpt2, tokenizer: "builtin:quickstart"}}
data: {{path: "{path}", format: preference, seq_len: {seq_len}, eval_fraction: 0}}
training: {{method: {method}, micro_batch_size: 1, global_batch_size: 2, max_steps: 2}}
""", source="r.yaml")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


# ------------------------------------------------------------------------------------------------ the data


def test_pairs_share_the_prompt_and_carry_a_loss_only_on_the_answers(tmp_path, tok):
    data = prepare_data(recipe(write_jsonl(tmp_path / "p.jsonl", PAIRS)), tok)
    assert data.pairs and len(data) == 3
    for unit, row in enumerate(PAIRS):
        chosen, rejected = data.sequences(unit)
        for sequence, answer in ((chosen, row["chosen"]), (rejected, row["rejected"])):
            kept = [int(i) for i, y in zip(sequence.ids, sequence.labels) if y != IGNORE_INDEX]
            assert tok.decode(kept) == f"{answer} <end>"  # the assistant turn the chat template writes, nothing else
        start = int(np.flatnonzero(chosen.labels != IGNORE_INDEX)[0])
        assert chosen.ids[:start].tolist() == rejected.ids[:start].tolist()  # the same prompt
        assert data.label_count(unit) == int((chosen.labels != IGNORE_INDEX).sum() + (rejected.labels != -100).sum())


def test_conversations_share_everything_before_the_last_assistant_turn(tmp_path, tok):
    shared = [{"role": "user", "content": "alice has a cat . who has a cat ?"},
              {"role": "assistant", "content": "alice has a cat ."}, {"role": "user", "content": "what color ?"}]
    rows = [{"chosen": shared + [{"role": "assistant", "content": "a cat ."}],
             "rejected": shared + [{"role": "assistant", "content": "cat a ."}]},
            {"prompt": "who has a dog ?", "chosen": [{"role": "assistant", "content": "bob has a dog ."}],
             "rejected": [{"role": "assistant", "content": "bob dog a has ."}]}]
    data = prepare_data(recipe(write_jsonl(tmp_path / "c.jsonl", rows)), tok)
    chosen, rejected = data.sequences(0)
    assert tok.decode([int(i) for i, y in zip(chosen.ids, chosen.labels) if y != -100]) == "a cat . <end>"
    assert tok.decode([int(i) for i, y in zip(rejected.ids, rejected.labels) if y != -100]) == "cat a . <end>"
    # the earlier assistant turn is part of the prompt: no loss on it
    assert tok.decode(chosen.ids.tolist()) == ("<user> alice has a cat . who has a cat ? <end> <assistant> alice has a "
                                               "cat . <end> <user> what color ? <end> <assistant> a cat . <end>")
    chosen, _ = data.sequences(1)
    assert tok.decode(chosen.ids.tolist()).startswith("<user> who has a dog ? <end> <assistant>")


def test_a_pair_too_long_loses_prompt_from_the_left_and_keeps_its_answers():
    def example(prompt, answer):
        return Example(np.arange(prompt + answer), np.r_[np.zeros(prompt, bool), np.ones(answer, bool)], 1)

    chosen, rejected, cut, answer_cut = fit_pair(example(20, 6), example(20, 9), 16)
    assert cut and not answer_cut and len(rejected) == 16 and len(chosen) == 13
    assert chosen.ids[:11].tolist() == rejected.ids[:11].tolist() == list(range(13, 20)) + [20, 21, 22, 23]
    assert chosen.mask[7:].all() and rejected.mask[7:].all()  # whole answers
    _, long, _, answer_cut = fit_pair(example(5, 3), example(5, 30), 16)
    assert answer_cut and len(long) == 16 and long.mask[1:].all() and not long.mask[0]  # one prompt token kept


def test_prompts_cut_are_counted_in_the_summary(tmp_path, tok):
    rows = [dict(PAIRS[0], prompt="alice has a red cat . " * 20)] + PAIRS[1:]
    data = prepare_data(recipe(write_jsonl(tmp_path / "long.jsonl", rows), seq_len=32), tok)
    assert data.stats.sources[0].prompts_cut == 1
    assert "1 pairs had their prompt cut from the left to fit seq_len" in data.stats.summary()


@pytest.mark.parametrize("row,expected", [
    ({"prompt": "who ?", "chosen": "alice ."}, "line 1: has no field 'rejected' (its fields: chosen, prompt)"),
    ({"prompt": "who ?", "chosen": "alice .", "rejected": "  "}, "line 1: answer 'rejected' is empty"),
    ({"prompt": "who ?", "chosen": "alice .", "rejected": "alice ."},
     "line 1: the chosen and the rejected answer are the same"),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b ."}],
      "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d ."}]},
     "line 1: chosen and rejected differ before their last assistant turn"),
])
def test_a_bad_pair_is_named_by_file_and_line(tmp_path, tiny_gpt2, row, expected):
    data = write_jsonl(tmp_path / "pairs.jsonl", [row])
    r = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, data, data={"format": "preference"}, training={"method": "dpo"})
    result = CliRunner().invoke(main, ["recipe", "run", str(r), "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 2 and expected in result.output and "pairs.jsonl" in result.output, result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("change,expected", [
    (["training.method=dpo", "data.format=text"], "text: training.method dpo trains on preference pairs"),
    (["data.format=preference"], "preference pairs need a preference method, and training.method is sft"),
    (["training.method=dpo", "data.format=preference", "preference.label_smoothing=0.5"],
     "preference.label_smoothing: 0.5 is outside [0, 0.5)"),
    (["training.method=simpo", "data.format=preference", "preference.beta=0"], "preference.beta: 0.0 must be positive"),
])
def test_a_method_without_its_data_or_with_a_bad_parameter_is_refused(change, expected):
    args = ["recipe", "validate", "quickstart"] + [x for c in change for x in ("--set", c)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and expected in result.output, result.output


# ------------------------------------------------------------------------- the losses, independently


def independent_loss(method, logits, labels, reference, *, beta, eps, gamma, lam):
    """The published formulas, written out again in float64 from the model's logits."""
    logp = torch.log_softmax(logits.double(), dim=-1)[:, :-1]
    target = labels[:, 1:]
    keep = target != IGNORE_INDEX
    token = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0] * keep
    total, count = token.sum(-1), keep.sum(-1).double()
    w, l_ = slice(0, None, 2), slice(1, None, 2)
    if method == "dpo":  # Rafailov et al. 2023, eq. 7; label smoothing: Mitchell 2023 (cDPO)
        z = beta * ((total[w] - reference[w]) - (total[l_] - reference[l_]))
        return (-(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))).mean()
    if method == "simpo":  # Meng et al. 2024, eq. 6
        z = beta / count[w] * total[w] - beta / count[l_] * total[l_] - gamma
        return (-(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))).mean()
    # ORPO, Hong et al. 2024, eqs. 6-7: P(y|x) = exp(mean token log-prob), odds = P / (1 - P)
    p_w, p_l = torch.exp(total[w] / count[w]), torch.exp(total[l_] / count[l_])
    ratio = torch.log((p_w / (1 - p_w)) / (p_l / (1 - p_l)))
    sft = -total[w].sum() / count[w].sum()
    return sft + lam * (-torch.log(torch.sigmoid(ratio))).mean()


@pytest.mark.parametrize("method,eps", [("dpo", 0.0), ("dpo", 0.2), ("simpo", 0.0), ("simpo", 0.1), ("orpo", 0.0)])
def test_each_loss_and_its_gradients_equal_the_published_formula(tmp_path, tok, method, eps):
    """The same model, two computations: ours (the recipe's default loss path, chunked from the hidden states: the
    head's products and the fp32 log-softmax of the answers only; the reference from the batch) and the formula in
    float64 over the full logits. Their difference is fp32 rounding of the head's sums over the width, of log-softmax
    sums over the vocabulary and of at most a few hundred answer tokens: a relative 2**-24 x sqrt(width + vocabulary +
    tokens) per term, bounded here by 1e-5."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "m", "gpt2"), dtype=torch.float32)
    r = recipe(write_jsonl(tmp_path / "p.jsonl", PAIRS), method)
    data = prepare_data(r, tok)
    batch = collated([s for u in range(3) for s in data.sequences(u)], tok.pad_token_id)
    torch.manual_seed(0)
    reference = -30 + 5 * torch.rand(6, dtype=torch.float64)
    p = PreferenceConfig(beta=0.7, label_smoothing=eps, gamma=0.4, lambda_=0.3)
    ours = build_objective(dataclasses.replace(r, preference=p), NoReference(), build_loss_path(r, model))
    chosen_tokens = sum(data.chosen_label_count(u) for u in range(3))
    loss, stats = ours(model, dict(batch, reference_logps=reference.float()), Norm(tokens=chosen_tokens, pairs=3))
    loss.backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    expected = independent_loss(method, logits, batch["labels"], reference, beta=0.7, eps=eps, gamma=0.4, lam=0.3)
    expected.backward()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    for name, q in model.named_parameters():
        scale = q.grad.abs().max().clamp(min=1e-12)
        assert float((grads[name].double() - q.grad.double()).abs().max() / scale) <= 1e-5, name
    assert int(stats["pairs"]) == 3


def test_dpo_on_equal_policy_and_reference_is_ln2_and_its_rewards_zero(tmp_path, tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "m", "gpt2"))
    r = recipe(write_jsonl(tmp_path / "p.jsonl", PAIRS))
    data = prepare_data(r, tok)
    batch = collated([s for u in range(3) for s in data.sequences(u)], tok.pad_token_id)
    objective = build_objective(r, NoReference(), build_loss_path(r, model))
    with torch.no_grad():  # the reference as the precomputation makes it: the same weights on the same sequences
        reference = objective.loss_path.sequence_logps(model, batch)[0]
        loss, stats = objective(model, dict(batch, reference_logps=reference), Norm(pairs=3))
    # z = 0 exactly: -log sigmoid(0) = ln 2, rounded to fp32 (a relative 2**-24)
    assert float(loss) == pytest.approx(math.log(2), rel=2**-23)
    assert float(stats["reward_accuracy"]) == 0 and float(stats["reward_chosen"]) == 0


# ------------------------------------------------------------------------------- the real CLI on 2 ranks


@pytest.mark.slow
@pytest.mark.multiprocess
def test_quickstart_dpo_starts_at_ln2_logs_from_step_1_and_prefers_the_chosen_answers(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("recipe", "run", "quickstart-dpo", "--output-dir", run, "--set", "training.mixed_precision=fp32",
                   check=0)
    assert "method    dpo (beta 0.1, label smoothing 0.0); reference: precomputed log-probabilities" in proc.stdout
    rows = read_metrics(run)
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 61))
    # The first step: policy == reference, computed by the same weights on the same sequences in batches of another
    # shape. The recipe's tiny GPT-2 (width 128, 4 heads, 128 positions) sums 2 x (128 + 32 + 128 + 128 + 128 + 512)
    # + 128 = 2,240 products on the way to a logit; a token's |log-prob| is at most twice the logged mean per token.
    first = train[0]
    margin, loss = precomputed_reference_start(beta=0.1, seq_len=96, pairs=32, logit_path=2**12,
                                               logp_scale=2 * max(-first["logps_chosen"], -first["logps_rejected"]))
    assert first["loss"] == pytest.approx(math.log(2), abs=loss)
    assert abs(first["reward_margin"]) <= margin
    for key in ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "logps_chosen",
                "logps_rejected"):
        assert all(isinstance(r[key], float) for r in train), key
    final = [r for r in rows if r["kind"] == "eval"][-1]
    assert final["step"] == 60 and final["eval_reward_accuracy"] >= 0.9 and final["eval_reward_margin"] > 0
    # a second run reads the reference back from the cache
    again = run_cli("recipe", "run", "quickstart-dpo", "--output-dir", tmp_path / "again", "--set",
                    "training.max_steps=1", "--set", "training.warmup_steps=0", "--set",
                    "training.mixed_precision=fp32", check=0)
    assert "read from the cache" in again.stdout
    assert "not writable" not in again.stdout + again.stderr  # torch's warning about a read-only array, on every rank
    assert read_metrics(tmp_path / "again")[1]["loss"] == train[0]["loss"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("method", ["simpo", "orpo"])
def test_simpo_and_orpo_run_from_the_dpo_recipe(tmp_path, method):
    run = tmp_path / method
    proc = run_cli("recipe", "run", "quickstart-dpo", "--output-dir", run, "--set", f"training.method={method}",
                   "--set", "training.max_steps=8", "--set", "training.warmup_steps=0",
                   "--set", "training.eval_every_steps=null", check=0)
    assert f"method    {method} (" in proc.stdout and "no reference model" in proc.stdout
    rows = read_metrics(run)
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 8 and train[-1]["loss"] < train[0]["loss"]
    assert [r for r in rows if r["kind"] == "eval"][-1]["eval_reward_accuracy"] > 0.5


@pytest.mark.slow
@pytest.mark.multiprocess
def test_verify_proves_split_invariance_and_exact_resume_on_a_preference_recipe(tmp_path):
    out = tmp_path / "verify"
    run_cli("verify", "quickstart-dpo", "--quick", "--only", "equivalence", "--only", "resume", "--output-dir", out,
            "--set", "training.mixed_precision=fp32", check=0)
    checks = {c["name"]: c for c in json.loads((out / "report.json").read_text())["checks"]}
    assert checks["equivalence"]["status"] == "PASS" and "split" in checks["equivalence"]["data"]
    assert checks["resume"]["status"] == "PASS" and checks["resume"]["data"]["max_abs_difference"] == 0.0


def test_the_shipped_preference_recipes_validate_for_their_hardware():
    for name, config in (("quickstart-dpo", "fsdp_cpu"), ("llama-3.2-1b-dpo", "fsdp_1gpu"),
                         ("llama-3.1-8b-dpo", "llama_fsdp_8gpu")):
        assert name in shipped_recipes()
        result = CliRunner().invoke(main, ["recipe", "validate", name, "--accelerate-config", config])
        assert result.exit_code == 0, (name, result.output)


def test_a_preference_run_refuses_an_unknown_method():
    with pytest.raises(UserError, match="training.method: expected one of sft, dpo, simpo, orpo, found 'ipo'"):
        recipe_from_text("data: {path: x.jsonl}\ntraining: {method: ipo}\nmodel: {architecture: gpt2}\n",
                         source="r.yaml")


def test_report_draws_the_margin_and_accuracy_beside_the_loss(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "0123456789abcdef", "recipe_name": "dpo"}))
    rows = [{"kind": "train", "step": s, "loss": 0.69 - 0.05 * s, "tokens_per_s": 1000.0,
             "tokens_per_s_per_rank": 500.0, "step_time_s": 0.1, "tokens_seen": 100 * s, "peak_memory_bytes": [1 << 20],
             "reward_chosen": 0.1 * s, "reward_rejected": -0.1 * s, "reward_margin": 0.2 * s,
             "reward_accuracy": min(1.0, 0.5 + 0.1 * s), "logps_chosen": -1.0, "logps_rejected": -2.0}
            for s in range(1, 9)]
    rows.append({"kind": "eval", "step": 8, "eval_loss": 0.3, "eval_ppl": 1.35, "eval_reward_margin": 1.5,
                 "eval_reward_accuracy": 0.95, "eval_reward_chosen": 0.7, "eval_reward_rejected": -0.8,
                 "eval_logps_chosen": -1.0, "eval_logps_rejected": -2.1})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert ("reward margin 1.6000, accuracy 1.000 at the end (train); held out: margin 1.5000, accuracy 0.950"
            in result.output and "perplexity" not in result.output)
    from PIL import Image

    assert Image.open(run / "loss_curve.png").size[0] > 2 * Image.open(run / "loss_curve.png").size[1]  # 3 panels


def test_the_dry_run_counts_two_sequences_per_pair_and_the_reference():
    from accel_fsdp.config.accelerate import load_accelerate_config
    from accel_fsdp.planning.plan import build_plan

    out = CliRunner().invoke(main, ["recipe", "run", "quickstart-dpo", "--dry-run"]).output
    assert "micro batch 4 pairs (8 sequences) x seq_len 96" in out
    assert "DPO reference: before the first step, one forward over every training and held-out pair" in out
    out = CliRunner().invoke(main, ["estimate", "quickstart-dpo", "--gpus", "2"]).output
    assert "micro batch 8 x 96 tokens" in out and "dpo: 2 sequences per pair, micro batch 4 pairs" in out
    out = CliRunner().invoke(main, ["estimate", "quickstart-dpo", "--gpus", "2", "--micro-batch", "2"]).output
    assert "micro batch 4 x 96 tokens" in out  # --micro-batch counts pairs, as the recipe does
    config = load_accelerate_config("fsdp_cpu")
    plans = {}
    for method in ("dpo", "sft"):
        r = recipe_from_text(f"""
model: {{architecture: gpt2, tokenizer: "builtin:quickstart", config_overrides: {{n_layer: 2, n_embd: 64, n_head: 4}}}}
data: {{path: "builtin:{'quickstart-pref' if method == 'dpo' else 'quickstart-instruct'}",
        format: {'preference' if method == 'dpo' else 'instruction'}, seq_len: 64}}
training: {{method: {method}, micro_batch_size: 2, global_batch_size: 8}}
""", source="r.yaml")
        plans[method] = build_plan(r, config).memory.activations
    assert plans["dpo"] == pytest.approx(2 * plans["sft"])  # the activations of 2 x micro batch sequences
