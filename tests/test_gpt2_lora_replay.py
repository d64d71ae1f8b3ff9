"""LoRA on GPT-2's Conv1D layers, replayed from the docs: GPT-2 holds each projection's weight as in x out and computes
x W + b (PEFT's fan_in_fan_out), so an adapter that reads A or B in the other orientation, or a merge that adds B A
untransposed, trains or exports another model. The recipe keys' docstrings (model.lora.*) give the formula: W x +
(alpha / r) B A dropout(x), A r x in and B out x r; `checkpoint consolidate --merge` writes W + (alpha / r) (B A)^T
into GPT-2's in x out layout. A run with `target_modules` as GPT-2 users write them (c_attn, c_proj, c_fc), a
clipping small enough to clip every step and a linear schedule after a warm-up is replayed in float64 by the helpers
of tests/test_logged_numbers_replay.py (their noise model: fp32 rounding alone).

With lora.dropout > 0 the masks are drawn inside each rank's forward and cannot be recovered from the run's files,
so what a replay can hold is: step 1's loss (B starts at 0, so the adapters add exactly 0 whatever their input's
mask: a loss off the base's means the dropout reached the base path), the evaluation after the last step (dropout
off) from the exported adapters, the merge, and, one layer at a time in-process, that the mask falls on the adapter's
input alone at 1 / (1 - p) scale.
"""

from __future__ import annotations

import pytest
import torch
from conftest import LOGIT_PATH, TRACE_UNITS, load_weights, read_metrics, run_cli, run_in_process, units_by_step
from conftest import tiny_recipe
from test_logged_numbers_replay import (GPT2_LORA_TARGETS, LR, WEIGHT_DECAY, adapter_key, answer_logps,
                                        assert_weights_replayed, documented_lora, documented_lr, float64_model,
                                        prepared, replay_adamw, sft_batch_loss, token_error)

from accel_fsdp.config.recipe import load_recipe
from accel_fsdp.tools.noise import ROUNDOFF, reordered

STEPS = 3
CLIP = 0.01
"""training.max_grad_norm: below every step's gradient norm here (asserted), so every step clips."""
WINDOW = 2
"""logging.every_steps and training.eval_every_steps of the run replayed step by step: train rows at steps 2 (the
mean of steps 1 and 2) and 3 (step 3 alone), evaluations after steps 2 and 3."""
EVAL_BATCHES = 1
"""training.eval_max_batches of that run: the first 1 x micro batch 2 x 2 ranks = 4 held-out sequences (of 7)."""


def lora_run(tmp_path, model_path, dropout: float, windowed: bool):
    recipe = tiny_recipe(tmp_path / "sft.yaml", model_path, "builtin:quickstart",
                         data={"max_rows": 200, "seq_len": 64, "eval_fraction": 0.05},
                         training={"micro_batch_size": 2, "global_batch_size": 8, "max_steps": STEPS, "lr": LR,
                                   "warmup_steps": 1, "min_lr_ratio": 0.2, "scheduler": "linear",
                                   "mixed_precision": "fp32", "weight_decay": WEIGHT_DECAY, "max_grad_norm": CLIP,
                                   "eval_every_steps": WINDOW if windowed else None,
                                   "eval_max_batches": EVAL_BATCHES if windowed else None},
                         model={"lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": GPT2_LORA_TARGETS,
                                         "dropout": dropout}},
                         checkpoint={"export_dtype": "fp32"}, logging={"every_steps": WINDOW if windowed else 1})
    run = tmp_path / "run"
    run_cli("recipe", "run", recipe, "--output-dir", run, env=TRACE_UNITS, check=0)
    return load_recipe(recipe), run


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_on_gpt2_conv1d_layers_trains_and_merges_what_a_replay_computes(tmp_path, tiny_gpt2, dropout):
    """2 ranks x 2 micro-steps, 3 steps: the train rows' windows (README: the mean of the window's steps' losses and
    gradient norms, before clipping; the lr of its last step), the exported adapters (after 3 clipped AdamW steps with
    decay on A and B), the evaluations after steps 2 and 3 and the merged export against the float64 replay. With
    dropout (a row every step): step 1's loss, the last evaluation and the merge."""
    windowed = dropout == 0
    recipe, run = lora_run(tmp_path, tiny_gpt2, dropout, windowed)
    data = prepared(run / "recipe.yaml")
    rows = read_metrics(run)
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    units = units_by_step(run)
    windows = {2: [1, 2], 3: [3]} if windowed else {s: [s] for s in range(1, STEPS + 1)}
    assert sorted(units) == list(range(1, STEPS + 1)) and sorted(train) == sorted(windows)
    lrs = [documented_lr(s, recipe.training) for s in range(1, STEPS + 1)]
    assert [train[s]["lr"] for s in sorted(train)] == pytest.approx([lrs[s - 1] for s in sorted(train)], rel=1e-12)
    (source,) = data.sources
    evaluations = {r["step"]: r for r in rows if r["kind"] == "eval"}
    assert sorted(evaluations) == ([WINDOW, STEPS] if windowed else [STEPS])
    # the recipe key: the first eval_max_batches x micro_batch_size x processes held-out sequences
    evaluated = min(source.units("eval"), EVAL_BATCHES * 2 * 2) if windowed else source.units("eval")
    assert evaluated < source.units("eval") or not windowed  # the limit did leave sequences out
    model = float64_model(tiny_gpt2)
    parameters, initial = documented_lora(model, recipe)
    assert len(parameters) == 2 * 4 * 2  # A and B of c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj, in both blocks
    exported = {adapter_key(name): tensor for name, tensor in load_weights(run / "final").items()}
    if windowed:
        def step_loss(s: int):
            if s == WINDOW + 1:  # the weights after step 2's update: what the evaluation after step 2 saw
                assert_evaluation_replayed(evaluations[WINDOW], model, source, WINDOW, evaluated)
            return sft_batch_loss(model, data, units[s])

        replayed = replay_adamw(parameters, recipe.training, lrs, [lambda s=s: step_loss(s) for s in units])
        for end, steps in windows.items():
            losses, norms = [replayed[s - 1][0] for s in steps], [replayed[s - 1][1] for s in steps]
            # a later step's weights differ from the run's by the earlier steps' rounding: its bound grows
            loss_error = max(token_error(replayed[s - 1][3]) + s * reordered(replayed[s - 1][2]) * replayed[s - 1][0]
                             for s in steps)
            assert train[end]["loss"] == pytest.approx(sum(losses) / len(steps), abs=loss_error), end
            norm_error = max(s * reordered(replayed[s - 1][2] * LOGIT_PATH) for s in steps)
            assert train[end]["grad_norm"] == pytest.approx(sum(norms) / len(steps), rel=norm_error), end
        assert all(r[1] > 2 * CLIP for r in replayed)  # every step clipped (the replay scaled its gradient)
        assert_weights_replayed(exported, parameters, initial, recipe.training, lrs, [r[2] for r in replayed])
    else:
        # step 1: B = 0, so the adapters add 0 under any mask and the loss is the base model's, dropout-free
        with torch.no_grad():
            loss, tokens, scale = sft_batch_loss(model, data, units[1])
        assert train[1]["loss"] == pytest.approx(float(loss), abs=token_error(scale) + reordered(tokens) * float(loss))
        assert set(exported) == set(initial)

    # The evaluation after the last step: the exported adapters over the base, dropout off.
    final = float64_model(tiny_gpt2)
    documented_lora(final, recipe, exported)
    assert_evaluation_replayed(evaluations[STEPS], final, source, 0, evaluated)
    assert_merge_replayed(run, tmp_path / "out", tiny_gpt2, recipe, exported)


def assert_evaluation_replayed(row: dict, model, source, carried_steps: int, evaluated: int) -> None:
    """An eval row against `model` on the first `evaluated` held-out sequences (README: -log p summed over their
    loss-carrying tokens over their count), within fp32 rounding (tests/test_logged_numbers_replay.py) and, for weights
    replayed through `carried_steps` steps, the rounding those steps carried into them (as a later step's loss)."""
    sums = [answer_logps(model, s) for j in range(evaluated) for s in source.sequences(j, "eval")]
    tokens = sum(c for _, c, _ in sums)
    expected = -sum(t for t, _, _ in sums) / tokens
    assert row["eval_tokens"] == tokens
    assert row["eval_loss"] == pytest.approx(
        expected, abs=token_error(max(m for _, _, m in sums)) + max(1, carried_steps) * reordered(tokens) * expected)


def assert_merge_replayed(run, out, model_path, recipe, adapters: dict) -> None:
    """`checkpoint consolidate --merge`: every base tensor, each adapted Conv1D weight (in x out) plus (alpha / r)
    (B A)^T. Noise: fp32 computes B A (r products summed), its scaling and the sum with W, each rounding at most 2^-24
    of the magnitudes it adds (Higham's gamma_n, worst case): within (r + 2) 2^-24 (|W| + (alpha / r) |B| |A|)."""
    run_in_process("checkpoint", "consolidate", run, out, "--merge", check=0)
    merged = load_weights(out / "merged")
    base = load_weights(model_path)
    lora = recipe.model.lora
    scale = lora.alpha / lora.r
    assert set(merged) >= set(base) - {"lm_head.weight"} and not any("lora" in k for k in merged), sorted(merged)
    adapted = 0
    for name, weight in base.items():
        if name not in merged:
            continue
        module = name.removesuffix(".weight")
        w = weight.double()
        if f"{module}.lora_A.weight" in adapters:
            a, b = adapters[f"{module}.lora_A.weight"].double(), adapters[f"{module}.lora_B.weight"].double()
            assert w.shape == (a.shape[1], b.shape[0]), name  # Conv1D: in x out
            expected = w + scale * (b @ a).T
            bound = (lora.r + 2) * ROUNDOFF["fp32"] * (w.abs() + scale * (b.abs() @ a.abs()).T)
            # the transposed (wrong) orientation would be off by |B A - (B A)^T|: far above the bound (c_proj: 64 x 64)
            adapted += 1
        else:
            expected, bound = w, torch.zeros_like(w)
        assert bool(((merged[name].double() - expected).abs() <= bound).all()), (
            name, float((merged[name].double() - expected).abs().max()))
    assert adapted == 8


def test_lora_dropout_on_a_conv1d_layer_masks_the_adapter_input_alone():
    """One adapted GPT-2 layer in train mode, p = 0.5: its output is x W + b + (alpha / r) (dropout(x) A^T) B^T with
    the mask of torch's dropout drawn from the same seed (kept entries scaled by 1 / (1 - p)); in eval mode x W + b +
    (alpha / r) x A^T B^T. fp32 against float64 on the same values: the products of at most 64 + 4 + 4 terms (width 64,
    rank 4), each within (72) 2^-24 of the magnitudes it adds."""
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.model.build import apply_lora

    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=64, n_head=4, n_positions=32, vocab_size=50)
    recipe = recipe_from_text("model: {architecture: gpt2, tokenizer: 'builtin:quickstart', lora: {enabled: true, "
                              "r: 4, alpha: 8, dropout: 0.5, target_modules: [c_fc]}}\ndata: {path: x.jsonl}\n",
                              source="r.yaml")
    model = apply_lora(AutoModelForCausalLM.from_config(config), recipe)
    layer = model.base_model.model.transformer.h[0].mlp.c_fc
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    w, bias = layer.base_layer.weight.double(), layer.base_layer.bias.double()
    a, b = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
    x = torch.randn(3, 7, 64)
    for train in (True, False):
        layer.train(train)
        torch.manual_seed(11)
        with torch.no_grad():
            out = layer(x).double()
        torch.manual_seed(11)
        seen = F.dropout(x, 0.5, training=train).double()
        expected = x.double() @ w + bias + 2.0 * (seen @ a.T) @ b.T
        magnitude = x.double().abs() @ w.abs() + bias.abs() + 2.0 * (seen.abs() @ a.abs().T) @ b.abs().T
        assert bool(((out - expected).abs() <= 72 * ROUNDOFF["fp32"] * magnitude).all()), train
        if train:  # the mask did fall (else this proves nothing): half the adapter's input entries are 0
            assert 0.3 < float((seen == 0).double().mean()) < 0.7


def test_lora_on_gpt2_says_fan_in_fan_out_itself_and_peft_warns_of_nothing(tiny_gpt2):
    """PEFT told every rank of every GPT-2 LoRA run, in a UserWarning, that it had set fan_in_fan_out itself; the
    config now says it (Conv1D targets only), and the adapter folder records it."""
    import warnings

    from transformers import AutoModelForCausalLM

    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.model.build import apply_lora

    recipe = recipe_from_text(f"model: {{name_or_path: '{tiny_gpt2}', lora: {{enabled: true, target_modules: "
                              f"{GPT2_LORA_TARGETS}}}}}\ndata: {{path: x.jsonl}}\n", source="r.yaml")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_gpt2), recipe)
    assert not [w for w in caught if "fan_in_fan_out" in str(w.message)], [str(w.message) for w in caught]
    assert model.peft_config["default"].fan_in_fan_out is True


def test_lora_on_linear_layers_keeps_fan_in_fan_out_off(tiny_llama):
    """The other side of the choice above: Linear targets (Llama's; a 4-bit GPT-2's, whose Conv1D layers became
    Linear) store out x in, and fan_in_fan_out stays off, without PEFT's warning that it turned it off itself."""
    import warnings

    from transformers import AutoModelForCausalLM

    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.model.build import apply_lora

    recipe = recipe_from_text(f"model: {{name_or_path: '{tiny_llama}', lora: {{enabled: true, target_modules: "
                              "[q_proj, v_proj, down_proj]}}\ndata: {path: x.jsonl}\n", source="r.yaml")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_llama), recipe)
    assert not [w for w in caught if "fan_in_fan_out" in str(w.message)], [str(w.message) for w in caught]
    assert model.peft_config["default"].fan_in_fan_out is False


def test_lora_on_conv1d_and_linear_targets_together_sets_each_and_warns_of_nothing(tiny_gpt2):
    """GPT-2's Conv1D blocks and its (tied) Linear head as targets together: PEFT sets fan_in_fan_out per layer as it
    wraps it, and warned on every rank for the layers of the other kind, and of "complications when merging" an
    adapted tied head, which the merge handles (tests/test_merging_a_tied_head.py). Under the filters every command
    sets (accel_fsdp/quiet.py), as a rank has them."""
    import warnings

    from transformers import AutoModelForCausalLM

    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.model.build import apply_lora
    from accel_fsdp.quiet import quiet_warnings

    recipe = recipe_from_text(f"model: {{name_or_path: '{tiny_gpt2}', lora: {{enabled: true, target_modules: "
                              f"[c_attn, lm_head]}}}}\ndata: {{path: x.jsonl}}\n", source="r.yaml")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_warnings()
        model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_gpt2), recipe)
    assert not [str(w.message) for w in caught if "fan_in_fan_out" in str(w.message)
                or "tie_word_embeddings" in str(w.message)], [str(w.message) for w in caught]
    layers = {name.rsplit(".", 1)[-1]: m for name, m in model.named_modules() if hasattr(m, "fan_in_fan_out")}
    assert layers["c_attn"].fan_in_fan_out is True and layers["lm_head"].fan_in_fan_out is False
