"""A bf16 run (the default precision users run) replayed from what the docs say bf16 is (the recipe key
training.mixed_precision, README "An optimizer step, exactly"): the fp32 master weights cast to bf16 for every
forward and backward (FSDP2's param_dtype; norms and embeddings too), every operation of the model in bf16 (autocast),
the logits turned to fp32 for the log-softmax and the loss, each micro-step's bf16 gradient cast to fp32 before the
ranks' reduction (reduce_dtype) and added up over the micro-steps in fp32, then clipping and AdamW on the fp32 master
weights with fp32 moments. The replay does exactly that on one process, the model's operations in bf16 through
torch's own kernels, everything after them in float64; only the run's numbers are read.

The noise model (accel_fsdp/tools/noise.py equivalence_tolerance, the one `verify` holds two bf16 runs of the same
batches to): the run and the replay round the same bf16 operations of the same bf16 inputs, a unit (2^-8) apart at
most where their kernels add the fp32 products in other orders (another batch shape: the run packs documents and
batches two sequences, the replay runs each document alone): a step's loss within 2 units; a gradient element is a
sum of bf16-rounded parts (the run's micro-batches, the replay's documents), each part's rounding independent, so its
norm within 2 sqrt(parts) units; both carried into the next step's weights, so step s within s times that. Reducing
in bf16, a bf16 loss or bf16 moments would each add a rounding of their own: within these bounds, so they are what
the docs say, not what this replay catches; master weights held in bf16 are (every exported weight would lie on the
bf16 grid, where an fp32 weight falls by chance with probability 2^-16).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import TRACE_UNITS, load_weights, read_metrics, run_cli, tiny_recipe, units_by_step
from test_logged_numbers_replay import (GPT2_LORA_TARGETS, LR, adapter_key, assert_weights_replayed,
                                        documented_lora, documented_lr, documents, float64_model, prepared,
                                        replay_adamw)

from accel_fsdp.config.recipe import load_recipe
from accel_fsdp.data.store import IGNORE_INDEX
from accel_fsdp.tools.noise import ROUNDOFF, equivalence_tolerance

STEPS = 2
BF16_WEIGHT_DECAY = 50.0
"""Large, so that the decay's move of a weight stands above the replay's bf16 bound (assert_weights_replayed)."""


def bf16_loss_and_gradient(model16, master: dict | None, data, units: list[int]) -> tuple[torch.Tensor, int, float,
                                                                                         int]:
    """The documented bf16 step of one global batch: a full fine-tune's `master` values cast to bf16 (via fp32, as the
    run holds them; LoRA: `master` None, the float64 adapters cast by autocast at each product over the bf16 base),
    each document run alone in bf16, its logits in float64 for the log-softmax, -log p summed over its loss-carrying
    tokens divided by the batch's count, backward in bf16, its gradients added up in float64 (into each master's
    .grad; LoRA: into the adapters' own). Returns (the loss, the count, the largest |logit|, the documents)."""
    if master is not None:
        with torch.no_grad():
            for name, p in model16.named_parameters():
                p.copy_(master[name].detach().float().to(torch.bfloat16))
        for p in master.values():
            p.grad = torch.zeros_like(p)
    pieces = [piece for u in units for sequence in data.sequences(u) for piece in documents(sequence)]
    count = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in pieces)
    total, scale = 0.0, 0.0
    for ids, labels in pieces:
        model16.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model16(input_ids=torch.as_tensor(ids)[None]).logits[0]
        carries = np.flatnonzero(labels != IGNORE_INDEX)
        logp = torch.log_softmax(logits.double(), dim=-1)[carries - 1, torch.as_tensor(ids[carries])]
        loss = -logp.sum() / count
        loss.backward()
        total += float(loss.detach())
        scale = max(scale, float(logits.detach().abs().max()))
        if master is not None:
            for name, p in model16.named_parameters():
                master[name].grad += p.grad.double()
    return torch.tensor(total, dtype=torch.float64), count, scale, len(pieces)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("lora", [False, True])
def test_a_bf16_run_logs_what_a_replay_of_the_documented_bf16_computes(tmp_path, tiny_gpt2, lora):
    """A GPT-2 in bf16, a full fine-tune or LoRA on its Conv1D layers (the base held in bf16), 2 ranks x 2
    micro-steps, 2 steps with weight decay and clipping, exported in fp32: each step's loss and gradient norm, the
    exported (master) weights and the final evaluation against the replay of the documented bf16 step; and the master
    weights are fp32 (off the bf16 grid)."""
    adapters = {"lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": GPT2_LORA_TARGETS}} if lora else {}
    recipe_path = tiny_recipe(tmp_path / "bf16.yaml", tiny_gpt2, "builtin:quickstart",
                              data={"max_rows": 200, "seq_len": 64, "eval_fraction": 0.05},
                              training={"micro_batch_size": 2, "global_batch_size": 8, "max_steps": STEPS, "lr": LR,
                                        "warmup_steps": 1, "mixed_precision": "bf16",
                                        "weight_decay": BF16_WEIGHT_DECAY},
                              model=adapters, checkpoint={"export_dtype": "fp32"})
    run = tmp_path / "run"
    proc = run_cli("recipe", "run", recipe_path, "--output-dir", run, env=TRACE_UNITS, check=0)
    assert "bf16 compute" in proc.stdout, proc.stdout
    recipe = load_recipe(recipe_path)
    data = prepared(recipe_path)
    rows = read_metrics(run)
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    units = units_by_step(run)
    lrs = [documented_lr(s, recipe.training) for s in range(1, STEPS + 1)]
    model16 = float64_model(tiny_gpt2).to(torch.bfloat16)  # LoRA's frozen base: bf16, read from the fp32 files
    if lora:
        parameters, initial = documented_lora(model16, recipe)
        master = None
        exported = {adapter_key(name): tensor for name, tensor in load_weights(run / "final").items()}
    else:
        parameters = dict(float64_model(tiny_gpt2).named_parameters())  # a tied output projection is its embedding
        initial, master, exported = load_weights(tiny_gpt2), parameters, load_weights(run / "final")
    micro_batches = 2 * 2  # ranks x micro-steps: the run's bf16 gradient parts of a step
    parts: list[int] = []

    def step(s: int):
        loss, count, scale, pieces = bf16_loss_and_gradient(model16, master, data, units[s])
        parts.append(micro_batches + pieces)
        return loss, count, scale

    replayed = replay_adamw(parameters, recipe.training, lrs, [lambda s=s: step(s) for s in range(1, STEPS + 1)])
    for s, (loss, grad_norm, tokens, _) in enumerate(replayed, start=1):
        bound = equivalence_tolerance("bf16", tokens, parts[s - 1], s)
        assert train[s]["loss"] == pytest.approx(loss, rel=bound["loss"]), s
        assert train[s]["grad_norm"] == pytest.approx(grad_norm, rel=bound["grad_norm"]), s
    gradient_noise = [2 * math.sqrt(n) * ROUNDOFF["bf16"] for n in parts]
    assert_weights_replayed(exported, parameters, initial, recipe.training, lrs, [r[2] for r in replayed],
                            gradient_noise=gradient_noise)
    # fp32 master weights: an fp32 value lies on the bf16 grid with probability 2^-16 (its 16 low bits all 0)
    values = torch.cat([w.flatten() for w in exported.values()])
    on_grid = float((values.bfloat16().float() == values).double().mean())
    assert on_grid < 0.01, on_grid

    # The evaluation after the last step: the exported weights cast to bf16 (LoRA: the exported adapters over the
    # bf16 base), the same computation without gradients.
    final16 = float64_model(tiny_gpt2 if lora else run / "final").to(torch.bfloat16)
    if lora:
        documented_lora(final16, recipe, exported)
    (source,) = data.sources
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        sums = []
        for j in range(source.units("eval")):
            for sequence in source.sequences(j, "eval"):
                for ids, labels in documents(sequence):
                    carries = np.flatnonzero(labels != IGNORE_INDEX)
                    logits = final16(input_ids=torch.as_tensor(ids)[None]).logits[0].double()
                    sums.append((float(torch.log_softmax(logits, -1)[carries - 1, torch.as_tensor(ids[carries])].sum()),
                                 len(carries)))
    tokens = sum(c for _, c in sums)
    (held_out,) = [r for r in rows if r["kind"] == "eval"]
    assert held_out["eval_tokens"] == tokens
    assert held_out["eval_loss"] == pytest.approx(-sum(t for t, _ in sums) / tokens,
                                                  rel=equivalence_tolerance("bf16", tokens, 1, 1)["loss"])
