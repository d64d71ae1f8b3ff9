"""An independent replay of what a run logs: the numbers of metrics.jsonl recomputed from the run's files (its recipe,
the prepared data, the units each step read, the starting weights and the exported model) by the definitions the
docs give (README's metrics table, docs/DATA.md, docs/PREFERENCE.md, the recipe keys' docstrings), in float64,
without the package's loss or optimizer code. What the product's code computes is only read from metrics.jsonl and
the exported weights. Every step is replayed from the starting weights (the loss of its global batch, its gradient
and norm, clipping, AdamW with decoupled decay on the matrices, the schedule's lr; LoRA's adapters, QLoRA's base
through 4 bits and back), so the exported weights are held against the replay's too (assert_weights_replayed). Borrowed
from the package: the prepared data and the units each step read (what is checked is what the run did with them), the
first values of LoRA's A (drawn from the seed) and the NF4 quantization (README states its format, not its rounding).

Tolerances follow the noise model of tests/conftest.py and accel_fsdp/tools/noise.py: the run computes in fp32, the
replay in float64 on the same weights, so they differ by fp32 rounding alone. A token's log-probability z_y -
logsumexp(z) is within twice a logit's error, and a logit within reordered(LOGIT_PATH) of the logits' scale; a mean
over N tokens adds reordered(N) of itself. A gradient element sums the products of all N tokens' backward paths
(LOGIT_PATH each): reordered(N x LOGIT_PATH) of the norm. A weight after S AdamW steps: assert_weights_replayed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import (LOGIT_PATH, TRACE_UNITS, load_weights, read_metrics, run_cli, save_tiny_model, tiny_recipe,
                      units_by_step)

from accel_fsdp.config.recipe import load_recipe
from accel_fsdp.data.store import IGNORE_INDEX
from accel_fsdp.tools.noise import ROUNDOFF, adam_step_bound, reordered

LR, WARMUP, STEPS, MIN_LR_RATIO = 3e-3, 1, 3, 0.1
WEIGHT_DECAY = 1.0
"""Large, so that the decay's move of a weight stands above the replay's bound (assert_weights_replayed)."""
GPT2_LORA_TARGETS = ["c_attn", "c_proj", "c_fc"]
"""GPT-2's projections as its users name them (Conv1D layers; c_proj is the attention's and the MLP's output)."""
SFT_SOURCES = [{"name": "stories", "path": "builtin:quickstart", "weight": 0.5, "max_rows": 240},
               {"name": "questions", "path": "builtin:quickstart-instruct", "format": "instruction", "weight": 0.3,
                "max_rows": 240},
               {"name": "chats", "path": "builtin:quickstart-chat", "format": "chat", "weight": 0.2, "max_rows": 240}]


# ------------------------------------------------------------------------------ the replay, from the definitions


def documents(sequence):
    """The documents of a prepared sequence (positions restart at 0 at each): docs/DATA.md, a packed sequence's loss
    is the sum of its documents' losses run alone."""
    starts = np.flatnonzero(np.asarray(sequence.positions) == 0).tolist() + [len(sequence.ids)]
    for a, b in zip(starts[:-1], starts[1:]):
        yield np.asarray(sequence.ids[a:b]), np.asarray(sequence.labels[a:b])


def answer_logp(model, sequence) -> tuple[torch.Tensor, int, float]:
    """(sum of log p over the sequence's loss-carrying tokens, with its graph; their count; the largest |logit|): a
    token t whose label is set is predicted by the logits of t - 1 of its own document."""
    total, count, scale = 0.0, 0, 0.0
    for ids, labels in documents(sequence):
        logits = model(input_ids=torch.as_tensor(ids)[None]).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        carries = np.flatnonzero(labels != IGNORE_INDEX)
        assert (carries > 0).all(), "a document's first token carries no loss (docs/DATA.md)"
        total = total + logp[carries - 1, torch.as_tensor(ids[carries])].sum()
        count += len(carries)
        scale = max(scale, float(logits.detach().abs().max()))
    return total, count, scale


def answer_logps(model, sequence) -> tuple[float, int, float]:
    """answer_logp in float64 without a graph."""
    with torch.no_grad():
        total, count, scale = answer_logp(model, sequence)
    return float(total), count, scale


def token_error(scale: float) -> float:
    """The largest fp32 error of one token's log-probability with logits of magnitude up to `scale`."""
    return 2 * reordered(LOGIT_PATH) * max(1.0, scale)


def float64_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()


def prepared(recipe_path):
    """The prepared data the run read (the same cache: tests/conftest.py isolates one per session)."""
    from accel_fsdp.data.prepare import prepare_data
    from accel_fsdp.data.synthetic import build_tokenizer

    return prepare_data(load_recipe(recipe_path), build_tokenizer())


def documented_lr(step: int, training=None) -> float:
    """The recipe keys' docstrings (of `training`; default: this module's cosine schedule): step s <= W uses lr s /
    (W + 1); after, lr (r + (1 - r) shape(p)), p = (s - 1 - W) / (N - W), shape (1 + cos(pi p)) / 2 (cosine) or 1 - p
    (linear); constant: lr."""
    lr, warmup, steps, ratio, scheduler = ((LR, WARMUP, STEPS, MIN_LR_RATIO, "cosine") if training is None else
                                           (training.lr, training.warmup_steps, training.max_steps,
                                            training.min_lr_ratio, training.scheduler))
    if step <= warmup:
        return lr * step / (warmup + 1)
    if scheduler == "constant":
        return lr
    p = (step - 1 - warmup) / (steps - warmup)
    shape = (1 + math.cos(math.pi * p)) / 2 if scheduler == "cosine" else 1 - p
    return lr * (ratio + (1 - ratio) * shape)


def sft_batch_loss(model, data, units: list[int]) -> tuple[torch.Tensor, int, float]:
    """README's `loss` of one optimizer step: the sum of -log p over the loss-carrying tokens of the global batch (the
    units every rank and micro-step read), each document run alone (docs/DATA.md), divided by their count. Returns
    (the loss, with its graph; the count; the largest |logit|)."""
    total, count, scale = 0.0, 0, 0.0
    for u in units:
        for sequence in data.sequences(u):
            for ids, labels in documents(sequence):
                logits = model(input_ids=torch.as_tensor(ids)[None]).logits[0]
                carries = np.flatnonzero(labels != IGNORE_INDEX)
                logp = torch.log_softmax(logits, dim=-1)[carries - 1, torch.as_tensor(ids[carries])]
                total = total - logp.sum()
                count += len(carries)
                scale = max(scale, float(logits.detach().abs().max()))
    return total / count, count, scale


def replay_adamw(parameters: dict, training, lrs: list[float], step_losses: list) -> list[tuple]:
    """Optimizer steps s = 1..S replayed in place on the trainable `parameters` (name: tensor) by the recipe keys'
    docstrings (training.*) and README's metrics table: g = the gradient of the step's loss (`step_losses[s - 1]()`:
    loss, count, logit scale) over every trainable parameter; n = |g| (the logged grad_norm); g x min(1, max_grad_norm
    / (n + 1e-6)) (clipping, as torch.nn.utils.clip_grad_norm_); then AdamW, its decoupled decay on the parameters of
    2 or more dimensions:
    p <- p (1 - lr_s wd); m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
    p <- p - lr_s (m / (1 - b1^s)) / (sqrt(v / (1 - b2^s)) + eps). Returns each step's (loss, n, count, scale)."""
    params = list(parameters.values())
    first, second = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    b1, b2, limit = training.adam_beta1, training.adam_beta2, training.max_grad_norm
    rows = []
    for s, (lr, step_loss) in enumerate(zip(lrs, step_losses), start=1):
        for p in params:
            p.grad = None
        loss, count, scale = step_loss()
        if loss.requires_grad:  # else step_loss set the gradients itself (tests/test_bf16_replay.py)
            loss.backward()
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params if p.grad is not None))
        clip = 1.0 if limit is None else min(1.0, limit / (norm + 1e-6))
        with torch.no_grad():
            for p, m, v in zip(params, first, second):
                g = p.grad * clip if p.grad is not None else torch.zeros_like(p)
                if p.ndim >= 2:
                    p.mul_(1 - lr * training.weight_decay)
                m.mul_(b1).add_((1 - b1) * g)
                v.mul_(b2).add_((1 - b2) * g * g)
                p.sub_(lr * (m / (1 - b1**s)) / ((v / (1 - b2**s)).sqrt() + training.adam_eps))
        rows.append((loss.item(), norm, count, scale))
    return rows


def assert_weights_replayed(weights: dict, replayed: dict, start: dict, training, lrs: list[float],
                            counts: list[int], gradient_noise: list[float] | None = None) -> None:
    """A run's exported fp32 weights against the float64 replay's (`replayed`, after replay_adamw) from the same
    `start`, by name.

    The noise model: a step's gradient in fp32 is within rho_s = reordered(count_s x LOGIT_PATH) of itself (the
    elements that do not cancel). Bias-corrected Adam's step m^ / sqrt(v^) has both sides move by at most rho of
    themselves, so by at most 2 U rho_s (U = adam_step_bound, the largest step, in units of lr), and clipping scales
    the whole gradient (the step does not change). A later step's gradient is taken at the run's weights, which
    differ from the replay's by this bound: its loss and norm, held per step by the caller, say that moved it by far
    less than rho. The fp32 weight rounds at each of its 3 operations a step (decay,
    update, the sum), 2^-24 of itself each. So at least half of each tensor's elements lie within 2 U sum(lr_s rho_s)
    + 3 S 2^-24 |w|, and every element within 2 U sum(lr_s) + that: an element whose gradient is itself rounding noise
    (GPT-2's key biases) can step either way. The decay's own move, lr wd |w| summed, is held to be twice the bound
    at the median |w| where it applies, so a decay left out fails here; a decay wrongly applied to the norms' weights
    (1) moves them far more (biases start at 0 and move little: not told apart). `gradient_noise`: each step's rho_s
    where the run computes its gradients in another precision than fp32 (tests/test_bf16_replay.py)."""
    u = adam_step_bound(training.adam_beta1, training.adam_beta2, len(lrs))
    steps = len(lrs)
    rho = gradient_noise or [reordered(n * LOGIT_PATH) for n in counts]
    step_noise = 2 * u * sum(lr * r for lr, r in zip(lrs, rho))
    largest = 2 * u * sum(lrs)
    assert set(weights) == set(replayed), set(weights) ^ set(replayed)
    for key, exported in weights.items():
        run, replay = exported.double(), replayed[key].detach().double()
        rounding = 3 * steps * ROUNDOFF["fp32"] * replay.abs()
        difference = (run - replay).abs()
        assert bool((difference <= largest + rounding).all()), (key, float(difference.max()), largest)
        within = float((difference <= step_noise + rounding).double().mean())
        assert within >= 0.5, (key, within, step_noise, float(difference.median()))
        if training.weight_decay and start[key].ndim >= 2 and start[key].any():
            # a decay missing here would move half the elements (|w| above the median) by more than twice the bound:
            # out of it, whatever the rounding did
            typical = float(start[key].double().abs().median())  # 0: LoRA's B, which starts at 0
            decay = sum(lrs) * training.weight_decay * typical
            assert decay >= 2 * (step_noise + 3 * steps * ROUNDOFF["fp32"] * typical), (key, decay, step_noise)


def slots_by_step(run, ranks: int, micro_batch: int) -> dict[int, list[int]]:
    """Each step's units in the order of its global batch's slots: rank r's micro-step m took slots (m W + r) B to
    (m W + r + 1) B (docs/DATA.md, "Exact at any rank count"), from the per-rank traces (in micro-step order)."""
    import json

    slots: dict[int, dict[int, int]] = {}
    for rank in range(ranks):
        for line in (run / "trace" / f"units-rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            for i, unit in enumerate(record["units"]):
                m, b = divmod(i, micro_batch)
                slots.setdefault(record["step"], {})[(m * ranks + rank) * micro_batch + b] = unit
    return {step: [by_slot[i] for i in sorted(by_slot)] for step, by_slot in slots.items()}


def assert_mixture_replayed(data, slots: list[int], weights: dict[str, float], mix_by: str) -> None:
    """docs/DATA.md, "What a weight shares out": each slot, in order, goes to the source with the smallest (d_i + c_i)
    / w_i (d_i what it gave so far, c_i what its next sequence costs: loss-carrying tokens, or 1 with mix_by rows;
    weights normalized), a tie to the source listed first. A source's next sequence is known where the run drew it
    later; the others' keys are not known, and not checked."""
    total = sum(weights.values())
    w = [weights[name] / total for name in data.names]

    def cost(unit: int) -> int:
        return int(data.label_count(unit)) if mix_by == "tokens" else 1

    given = [0] * len(w)
    for position, unit in enumerate(slots):
        chosen = data.split(unit)[0]
        later = {}
        for u in slots[position:]:
            later.setdefault(data.split(u)[0], u)
        keys = {i: (given[i] + cost(u)) / w[i] for i, u in later.items()}
        for i, key in keys.items():
            assert keys[chosen] < key or (keys[chosen] == key and chosen <= i), (position, keys, chosen)
        given[chosen] += cost(unit)


@pytest.mark.parametrize("schedule", [(LR, WARMUP, MIN_LR_RATIO, STEPS, "cosine"), (1e-3, 2, 0.2, 7, "cosine"),
                                      (1e-3, 2, 0.2, 7, "linear"), (1e-3, 2, 0.2, 7, "constant"),
                                      (1e-3, 0, 0.0, 5, "linear")])
def test_the_documented_schedule_is_the_one_the_optimizer_steps_with(schedule):
    """Unit level: the factor the LambdaLR gets at each 0-based index is the documented one of step index + 1."""
    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.train.optimizer import lr_schedule

    lr, warmup, ratio, steps, scheduler = schedule
    recipe = recipe_from_text(f"""
model: {{architecture: gpt2, tokenizer: "builtin:quickstart"}}
data: {{path: "builtin:quickstart"}}
training: {{lr: {lr}, warmup_steps: {warmup}, min_lr_ratio: {ratio}, max_steps: {steps}, scheduler: {scheduler}}}
""", source="r.yaml")
    factor = lr_schedule(recipe, steps)
    assert [lr * factor(i) for i in range(steps)] == pytest.approx(
        [documented_lr(s, recipe.training) for s in range(1, steps + 1)], rel=1e-15)


# ------------------------------------------------------------------------------------------- sft, 2 ranks


def sft_run(tmp_path, tiny_gpt2, mix_by: str, *launch, env: dict | None = None, check: int = 0):
    data = {"path": "", "mix_by": mix_by, "sources": SFT_SOURCES, "seq_len": 128, "eval_fraction": 0.05}
    recipe = tiny_recipe(tmp_path / "sft.yaml", tiny_gpt2, "unused", data=data,
                         training={"micro_batch_size": 2, "global_batch_size": 8, "max_steps": STEPS, "lr": LR,
                                   "warmup_steps": WARMUP, "min_lr_ratio": MIN_LR_RATIO, "mixed_precision": "fp32",
                                   "weight_decay": WEIGHT_DECAY},
                         checkpoint={"export_dtype": "fp32"})
    run = tmp_path / "run"
    run_cli("recipe", "run", recipe, "--output-dir", run, *launch, env=TRACE_UNITS | (env or {}), check=check)
    return recipe, run


def replay_sft(recipe, run, tiny_gpt2, mix_by: str) -> None:
    data = prepared(recipe)
    rows = read_metrics(run)
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    (held_out,) = [r for r in rows if r["kind"] == "eval"]
    units = units_by_step(run)
    assert sorted(train) == sorted(units) == list(range(1, STEPS + 1))
    slots = slots_by_step(run, ranks=2, micro_batch=2)
    assert_mixture_replayed(data, [u for step in sorted(slots) for u in slots[step]],
                            {s["name"]: s["weight"] for s in SFT_SOURCES}, mix_by)
    seen = 0
    for step in range(1, STEPS + 1):
        seen += sum(len(s.ids) for u in units[step] for s in data.sequences(u))
        assert train[step]["tokens_seen"] == seen, step  # every token of the step's sequences, no padding
        expected = dict.fromkeys(data.names, 0)
        for u in units[step]:
            expected[data.names[data.split(u)[0]]] += int(sum((s.labels != IGNORE_INDEX).sum()
                                                              for s in data.sequences(u)))
        assert train[step]["source_tokens"] == expected, step
        for u in units[step]:  # docs/DATA.md: text carries a loss on every token but each document's first
            if data.sources[data.split(u)[0]].config.format == "text":
                (sequence,) = data.sequences(u)
                assert (sequence.labels != IGNORE_INDEX).sum() == len(sequence.ids) - (sequence.positions == 0).sum()
        assert train[step]["lr"] == pytest.approx(documented_lr(step), rel=1e-12), step

    # Every step replayed from the starting weights by the documented loss and AdamW: its loss and gradient norm, and
    # the exported weights after the last step.
    recipe_ = load_recipe(recipe)
    model = float64_model(tiny_gpt2)
    model.train()  # the tiny model has no dropout: train mode computes what eval mode does
    parameters = dict(model.named_parameters())  # a tied output projection is its embedding
    replayed = replay_adamw(parameters, recipe_.training, [documented_lr(s) for s in range(1, STEPS + 1)],
                            [lambda s=s: sft_batch_loss(model, data, units[s]) for s in range(1, STEPS + 1)])
    for step, (loss, grad_norm, tokens, scale) in enumerate(replayed, start=1):
        # a later step's weights differ from the run's by the earlier steps' rounding: its gradient's bound grows
        assert train[step]["loss"] == pytest.approx(loss, abs=token_error(scale) + step * reordered(tokens) * loss)
        assert train[step]["grad_norm"] == pytest.approx(grad_norm, rel=step * reordered(tokens * LOGIT_PATH))
    assert_weights_replayed(load_weights(run / "final"), parameters, load_weights(tiny_gpt2), recipe_.training,
                            [documented_lr(s) for s in range(1, STEPS + 1)], [r[2] for r in replayed])

    # The evaluation at the end: the exported weights (after the last step) on every held-out sequence.
    final = float64_model(run / "final")
    by_source, tokens, scale = {}, 0, 0.0
    for source in data.sources:
        sums = [answer_logps(final, s) for j in range(source.units("eval")) for s in source.sequences(j, "eval")]
        by_source[source.name] = -sum(t for t, _, _ in sums) / sum(c for _, c, _ in sums)
        tokens += sum(c for _, c, _ in sums)
        scale = max([scale] + [m for _, _, m in sums])
    tolerance = token_error(scale) + reordered(tokens) * max(by_source.values())
    assert held_out["eval_tokens"] == tokens
    assert held_out["eval_loss_by_source"] == pytest.approx(by_source, abs=tolerance)
    # docs/DATA.md: with mix_by tokens a source's share is its weight; with rows, weight x its training sequences' mean
    # loss-carrying tokens, normalized
    weights = {s["name"]: s["weight"] for s in SFT_SOURCES}
    if mix_by == "rows":
        weights = {s.name: weights[s.name] * float(np.mean(s.train.labels)) for s in data.sources}
    expected = sum(weights[n] * by_source[n] for n in by_source) / sum(weights.values())
    assert held_out["eval_loss"] == pytest.approx(expected, abs=tolerance)
    assert held_out["eval_ppl"] == pytest.approx(math.exp(held_out["eval_loss"]), rel=1e-12)


@pytest.mark.slow  # the mixture's replay; the fast tier's runs are the core promises (docs/ARCHITECTURE.md)
@pytest.mark.multiprocess
def test_an_sft_mixture_by_rows_logs_what_a_replay_computes(tmp_path, tiny_gpt2):
    """Text (packed), instruction and chat sources mixed by rows, 2 ranks x 2 micro-steps, warm-up then decay: every
    train row's lr, tokens_seen and source_tokens, every step's loss and gradient norm and the exported weights
    replayed from the starting weights (AdamW with weight decay, clipping), and the final evaluation."""
    recipe, run = sft_run(tmp_path, tiny_gpt2, "rows")
    replay_sft(recipe, run, tiny_gpt2, "rows")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_sft_mixture_by_tokens_logs_what_a_replay_computes(tmp_path, tiny_gpt2):
    recipe, run = sft_run(tmp_path, tiny_gpt2, "tokens")
    replay_sft(recipe, run, tiny_gpt2, "tokens")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_sft_run_under_fsdp1_killed_and_resumed_logs_what_a_replay_computes(tmp_path, tiny_gpt2):
    """FSDP1, killed after step 3 and resumed from step 2's checkpoint, ends where the replay of 3 uninterrupted steps
    does. FSDP1 flattens each parameter into a 1-D view of its shard: the optimizer built after wrapping decayed no
    matrix (training.weight_decay was silently 0); and its AdamW moments were not read back on resume (fresh ones went
    on: 3e-3 off)."""
    launch = ("--accelerate-config", "fsdp1_2gpu", "--cpu", "--set", "checkpoint.every_steps=2")
    recipe, run = sft_run(tmp_path, tiny_gpt2, "rows", *launch, env={"ACCEL_FSDP_FAULT": "kill:3"}, check=1)
    resumed = run_cli("recipe", "run", recipe, "--output-dir", run, *launch, "--resume", env=TRACE_UNITS, check=0)
    assert "continuing from" in resumed.stdout and "at step 2" in resumed.stdout
    replay_sft(recipe, run, tiny_gpt2, "rows")


# ------------------------------------------------------------------------------------ preference, 2 ranks


def documented_pair(method: str, chosen: tuple, rejected: tuple, reference: tuple | None, *, beta: float,
                    gamma: float, lam: float, eps: float) -> dict:
    """docs/PREFERENCE.md, one pair: its loss terms and rewards from (log pi(y), |y|) of each answer; eps the label
    smoothing."""
    (pc, nc), (pr, nr) = chosen, rejected

    def logistic(z: float) -> float:  # -(1 - eps) log sigma(z) - eps log sigma(-z)
        return (1 - eps) * math.log(1 + math.exp(-z)) + eps * math.log(1 + math.exp(z))

    if method == "dpo":
        rc, rr = beta * (pc - reference[0]), beta * (pr - reference[1])
        return {"pair": logistic(rc - rr), "rewards": (rc, rr)}
    if method == "simpo":
        rc, rr = beta * pc / nc, beta * pr / nr
        return {"pair": logistic(rc - rr - gamma), "rewards": (rc, rr)}
    odds = [math.log(math.exp(a) / (1 - math.exp(a))) for a in (pc / nc, pr / nr)]
    ratio = -math.log(1 / (1 + math.exp(-(odds[0] - odds[1]))))
    return {"pair": lam * ratio, "rewards": (lam * pc / nc, lam * pr / nr), "nll": -pc}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("method,lora,eps", [("dpo", None, 0.1), ("simpo", None, 0.0), ("orpo", None, 0.0),
                                             ("dpo", "lora", 0.0), ("dpo", "qlora", 0.0),
                                             ("dpo", "lora-gpt2", 0.0)])
def test_a_preference_run_logs_what_a_replay_computes(tmp_path, method, lora, eps):
    """Built-in pairs, 2 ranks x 2 micro-steps, 2 steps with weight decay, a full fine-tune of a GPT-2 (DPO with label
    smoothing) or LoRA on a Llama, on its 4-bit base (QLoRA) too, or on a GPT-2's Conv1D layers named as GPT-2 users
    name them (its lora.dropout set, which preference tuning turns off): step 1's loss and every statistic recomputed
    from the starting weights' log-probabilities by docs/PREFERENCE.md (DPO's reference is the starting weights too:
    precomputed, or the base with the adapters off, whose B matrices start at 0, so LoRA's step 1 ties every pair
    exactly at ln 2 and its last step, the adapters on in the policy alone, does not; QLoRA's base is dequantized); both
    steps' gradient norms and the exported weights (LoRA: the adapters) replayed from the start by the documented
    loss, LoRA and AdamW; and the final evaluation's from the exported model."""
    model_path = save_tiny_model(tmp_path / "m", "llama" if lora in ("lora", "qlora") else "gpt2")
    adapters = {"lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}} if lora else {}
    if lora == "lora-gpt2":
        adapters["lora"].update(target_modules=GPT2_LORA_TARGETS, dropout=0.1)
    if lora == "qlora":
        pytest.importorskip("torchao")
        adapters["quantize"] = "nf4"
    recipe = tiny_recipe(tmp_path / "pref.yaml", model_path, "builtin:quickstart-pref",
                         data={"format": "preference", "max_rows": 200, "seq_len": 64, "eval_fraction": 0.05},
                         training={"method": method, "micro_batch_size": 2, "global_batch_size": 8, "max_steps": 2,
                                   "mixed_precision": "fp32", "weight_decay": WEIGHT_DECAY},
                         model=adapters, checkpoint={"export_dtype": "fp32"},
                         preference={"label_smoothing": eps})
    run = tmp_path / "run"
    proc = run_cli("recipe", "run", recipe, "--output-dir", run, env=TRACE_UNITS, check=0)
    loaded = load_recipe(recipe)
    p = loaded.preference
    beta, gamma, lam = p.beta_for(method) if method != "orpo" else 0.0, p.gamma, p.lambda_
    data = prepared(recipe)
    rows = read_metrics(run)
    train = [r for r in rows if r["kind"] == "train"]
    start = starting_model(model_path, loaded)
    parameters = dict(beta=beta, gamma=gamma, lam=lam, eps=p.label_smoothing)
    steps = [[data.sequences(u) for u in units] for _, units in sorted(units_by_step(run).items())]
    assert [len(pairs) for pairs in steps] == [8, 8]
    assert_pairs_replayed(train[0], "", method, steps[0], start, start, **parameters)
    if lora and method == "dpo":  # the adapters' B starts at 0: policy and reference are the same bits, all ties
        assert "reference: the base model with the LoRA adapters switched off" in proc.stdout, proc.stdout
        assert train[0]["reward_margin"] == 0 and train[0]["reward_accuracy"] == 0  # docs: a tie counts as wrong
        assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)  # every pair's z is exactly 0
        # after a step the adapters are on in the policy and off in the reference (train/reference.py AdaptersOff):
        # a reference that left them on would tie every pair at every step
        assert train[-1]["reward_margin"] != 0
    replay_preference_steps(run, model_path, loaded, method, steps, train, start, **parameters)
    # The evaluation at the end: the exported weights (after the last step) on every held-out pair; DPO's reference
    # is the starting weights, a held-out source's loss its mean pair loss (ORPO: + its chosen answers' NLL per token).
    (held_out,) = [r for r in rows if r["kind"] == "eval"]
    (source,) = data.sources
    pairs = [source.sequences(j, "eval") for j in range(source.units("eval"))]
    final = float64_model(run / "final")
    if lora:  # the exported adapters on the documented (dequantized) base
        final = starting_model(model_path, loaded)
        documented_lora(final, loaded, {adapter_key(k): v for k, v in load_weights(run / "final").items()})
    chosen_tokens = assert_pairs_replayed(held_out, "eval_", method, pairs, final, start, **parameters)
    assert held_out["eval_tokens"] == chosen_tokens
    assert held_out["eval_loss_by_source"] == {source.name: pytest.approx(held_out["eval_loss"], rel=1e-12)}


def documented_batch_loss(method: str, model, pairs: list, references: list | None, *, beta: float, gamma: float,
                          lam: float, label_smoothing: float) -> tuple[torch.Tensor, int, float]:
    """docs/PREFERENCE.md, one global batch: the mean pair loss over its pairs (ORPO: lambda x the mean odds-ratio
    term + the chosen answers' NLL summed over their tokens / their count). Returns (the loss with its graph, the
    answers' loss-carrying tokens, the largest |logit|)."""
    import torch.nn.functional as F

    losses, nll, chosen_tokens, tokens, scale = [], 0.0, 0, 0, 0.0
    for i, (chosen, rejected) in enumerate(pairs):
        (pc, nc, sc), (pr, nr, sr) = answer_logp(model, chosen), answer_logp(model, rejected)
        tokens, scale = tokens + nc + nr, max(scale, sc, sr)
        if method == "orpo":
            log_odds = [a - torch.log(-torch.expm1(a)) for a in (pc / nc, pr / nr)]
            losses.append(lam * -F.logsigmoid(log_odds[0] - log_odds[1]))
            nll, chosen_tokens = nll - pc, chosen_tokens + nc
            continue
        z = (beta * ((pc - references[i][0]) - (pr - references[i][1])) if method == "dpo"
             else beta * (pc / nc - pr / nr) - gamma)
        losses.append(-(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z))
    loss = sum(losses) / len(losses)
    return (loss + nll / chosen_tokens if method == "orpo" else loss), tokens, scale


def replay_preference_steps(run, model_path, recipe, method: str, steps: list, train: list, start, *, beta: float,
                            gamma: float, lam: float, eps: float) -> None:
    """The run's steps replayed from the starting weights (a full fine-tune: all of them; LoRA: the adapters over the
    frozen base) by documented_batch_loss and replay_adamw: each step's gradient norm against its row, and the
    exported weights against the replay's."""
    policy = starting_model(model_path, recipe)
    if recipe.model.lora.enabled:
        parameters, initial = documented_lora(policy, recipe)
        exported = {adapter_key(name): tensor for name, tensor in load_weights(run / "final").items()}
    else:
        parameters = dict(policy.named_parameters())  # a tied output projection is its embedding
        initial, exported = load_weights(model_path), load_weights(run / "final")
    references = [[(answer_logps(start, c)[0], answer_logps(start, r)[0]) for c, r in pairs] if method == "dpo"
                  else None for pairs in steps]
    lrs = [documented_lr(s, recipe.training) for s in range(1, len(steps) + 1)]
    options = dict(beta=beta, gamma=gamma, lam=lam, label_smoothing=eps)
    replayed = replay_adamw(parameters, recipe.training, lrs,
                            [lambda pairs=pairs, ref=ref: documented_batch_loss(method, policy, pairs, ref, **options)
                             for pairs, ref in zip(steps, references)])
    for step, (row, (_, grad_norm, tokens, _)) in enumerate(zip(train, replayed), start=1):
        assert row["lr"] == pytest.approx(lrs[step - 1], rel=1e-12)
        assert row["grad_norm"] == pytest.approx(grad_norm, rel=step * reordered(tokens * LOGIT_PATH)), step
    assert_weights_replayed(exported, parameters, initial, recipe.training, lrs, [r[2] for r in replayed])


def starting_model(model_path, recipe):
    """The weights a run starts from, in float64: the model files; with model.quantize nf4 (README, QLoRA) every
    decoder block's projections (the Linear layers under model.layers) through 4 bits and back, quantized from the
    compute dtype (fp32 here) by torchao's NF4 as the product calls it (only the quantization is borrowed)."""
    model = float64_model(model_path)
    if recipe.model.quantize == "nf4":
        from accel_fsdp.model.nf4 import to_nf4

        blocks = [m for name, m in model.named_modules()
                  if name.startswith("model.layers.") and isinstance(m, torch.nn.Linear)]
        assert len(blocks) == 7 * model.config.num_hidden_layers
        with torch.no_grad():
            for module in blocks:
                module.weight.copy_(to_nf4(module.weight.float()).get_original_weight().double())
    return model


def documented_lora(model, recipe, values: dict | None = None) -> tuple[dict, dict]:
    """The recipe keys' LoRA on a float64 model: each Linear (GPT-2: Conv1D) named in model.lora.target_modules gains
    (alpha / r) B A x (its dropout off), A r x in and B out x r trainable, the base frozen. A's first values are the
    run's (drawn by the product from the recipe's seed: only the drawing is borrowed), B's 0; or `values`. Returns the
    adapters and their first values, named as the exported adapter folder names them."""
    from transformers import AutoModelForCausalLM

    from accel_fsdp.model.build import apply_lora

    lora = recipe.model.lora
    if values is None:
        drawn = apply_lora(AutoModelForCausalLM.from_pretrained(recipe.model.name_or_path), recipe)
        values = {adapter_key(name): tensor for name, tensor in drawn.named_parameters() if "lora_" in name}
    first = {name: tensor.detach().double() for name, tensor in values.items()}
    model.requires_grad_(False)
    parameters = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in lora.target_modules:
            continue
        a = torch.nn.Parameter(first[f"{name}.lora_A.weight"].clone())
        b = torch.nn.Parameter(first[f"{name}.lora_B.weight"].clone())
        # GPT-2's Conv1D holds its weight as in x out and computes x W + b: A is still r x in, B out x r
        fan_in, fan_out = (module.weight.shape if type(module).__name__ == "Conv1D" else module.weight.shape[::-1])
        assert a.shape == (lora.r, fan_in) and b.shape == (fan_out, lora.r), name
        scale = lora.alpha / lora.r
        module.register_forward_hook(lambda _, inputs, out, a=a, b=b: adapted(out, inputs[0], a, b, scale))
        parameters[f"{name}.lora_A.weight"], parameters[f"{name}.lora_B.weight"] = a, b
    assert set(parameters) == set(first), set(parameters) ^ set(first)
    return parameters, first


def adapted(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """A layer's output plus its adapters' scale B A x, the products in the input's dtype (bf16 where the run computes
    in bf16, tests/test_bf16_replay.py: autocast leaves float64 tensors alone, so the float64 adapters are cast
    here)."""
    return out + scale * x @ a.T.to(x.dtype) @ b.T.to(x.dtype)


def adapter_key(name: str) -> str:
    """A LoRA tensor's name without PEFT's prefix and adapter name: model.layers.0.self_attn.q_proj.lora_A.weight."""
    return name.removeprefix("base_model.model.").replace(".default.", ".")


def assert_pairs_replayed(row: dict, prefix: str, method: str, pairs: list, model, reference, *, beta: float,
                          gamma: float, lam: float, eps: float) -> int:
    """A row's loss (train rows: `loss`, eval rows: `eval_loss`) and statistics against docs/PREFERENCE.md's over
    `pairs` (chosen, rejected sequences) with `model` as the policy and `reference` as DPO's reference. Returns the
    chosen answers' loss-carrying tokens."""
    replayed, scale = [], 0.0
    for chosen, rejected in pairs:
        (pc, nc, sc), (pr, nr, sr) = answer_logps(model, chosen), answer_logps(model, rejected)
        references = None
        if method == "dpo":
            (rc, _, rsc), (rr, _, rsr) = answer_logps(reference, chosen), answer_logps(reference, rejected)
            references, scale = (rc, rr), max(scale, rsc, rsr)
        scale = max(scale, sc, sr)
        replayed.append(documented_pair(method, (pc, nc), (pr, nr), references, beta=beta, gamma=gamma, lam=lam,
                                        eps=eps)
                        | {"tokens": (nc, nr), "logps": (pc / nc, pr / nr)})
    n = len(replayed)
    chosen_tokens = sum(q["tokens"][0] for q in replayed)
    loss = sum(q["pair"] for q in replayed) / n
    if method == "orpo":
        loss += sum(q["nll"] for q in replayed) / chosen_tokens
    expected = {"reward_chosen": sum(q["rewards"][0] for q in replayed) / n,
                "reward_rejected": sum(q["rewards"][1] for q in replayed) / n,
                "logps_chosen": sum(q["logps"][0] for q in replayed) / n,
                "logps_rejected": sum(q["logps"][1] for q in replayed) / n}
    expected["reward_margin"] = expected["reward_chosen"] - expected["reward_rejected"]
    # A token's log-prob is within token_error(scale); an answer's mean too, its sum within |y| of them.
    longest = max(max(q["tokens"]) for q in replayed)
    per_token = token_error(scale)
    reward_error = {"dpo": 2 * beta * longest * per_token, "simpo": beta * per_token, "orpo": lam * per_token}[method]
    for key in ("reward_chosen", "reward_rejected"):
        assert row[prefix + key] == pytest.approx(expected[key], abs=reward_error), key
    assert row[prefix + "reward_margin"] == pytest.approx(expected["reward_margin"], abs=2 * reward_error)
    for key in ("logps_chosen", "logps_rejected"):
        mean_error = per_token + reordered(longest) * abs(expected[key])
        assert row[prefix + key] == pytest.approx(expected[key], abs=mean_error), key
    # -(1 - eps) log sigma(z) - eps log sigma(-z) moves by at most z's error (its slope is within 1): DPO's and SimPO's
    # z by two rewards' errors; ORPO's log odds by its means' errors x d log odds / da = 1 / (1 - e^a), plus its NLL
    # per token's error
    loss_error = 2 * reward_error + reordered(n) * loss
    if method == "orpo":
        highest = max(max(q["logps"]) for q in replayed)
        nll = sum(q["nll"] for q in replayed) / chosen_tokens
        loss_error = (lam * 2 * per_token / (1 - math.exp(highest)) + per_token + reordered(chosen_tokens) * nll
                      + reordered(n) * loss)
    assert row[prefix + "loss"] == pytest.approx(loss, abs=loss_error)
    wins = [q["rewards"][0] > q["rewards"][1] for q in replayed]
    ties = sum(abs(q["rewards"][0] - q["rewards"][1]) <= 2 * reward_error for q in replayed)
    assert abs(row[prefix + "reward_accuracy"] - sum(wins) / n) <= ties / n
    return chosen_tokens
