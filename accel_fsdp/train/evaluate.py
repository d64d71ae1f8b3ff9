"""Held-out loss and perplexity, and the sample generated at the end. The evaluator decides its own cadence
(`training.eval_every_steps`, and once at the end)."""

from __future__ import annotations

import torch

from accel_fsdp.data import batches
from accel_fsdp.data.store import IGNORE_INDEX
from accel_fsdp.train.metrics import EvalRow, MetricsWriter, perplexity
from accel_fsdp.train.observe import preference_means
from accel_fsdp.train.state import TrainingState


class Evaluator:
    def __init__(self, run, metrics: MetricsWriter):
        self.run = run
        self.metrics = metrics
        self.every = run.recipe.training.eval_every_steps
        self.last_step: int | None = None

    def after_step(self, state: TrainingState) -> None:
        if self.every and state.step % self.every == 0 and state.step != self.run.total_steps:
            self.evaluate(state.step)

    def at_end(self, state: TrainingState) -> None:
        if self.last_step != state.step:
            self.evaluate(state.step)

    def evaluate(self, step: int) -> EvalRow | None:
        """Mean token loss of each source's held-out sequences, exact over ranks, and their mixture: the losses
        weighted by the sources' shares (what the training loss estimates)."""
        run = self.run
        if run.data.pairs:
            return self._evaluate_pairs(step)
        held = [s for s in run.data.sources if s.eval is not None and len(s.eval)]
        if not held:
            return None
        acc, model, t = run.accelerator, run.model, run.recipe.training
        totals = torch.zeros(len(held), 2, device=acc.device, dtype=torch.float64)
        model.eval()
        with torch.no_grad():
            for k, source in enumerate(held):  # one source per batch: its loss is its own
                for rows in batches.iter_eval_batches(len(source.eval), micro_batch=t.micro_batch_size,
                                                      world_size=acc.num_processes, rank=acc.process_index,
                                                      max_batches=t.eval_max_batches):
                    dummy = rows is None  # this rank ran out of sequences but must join the collective forward
                    batch = run.collate([source.eval.sequence(j) for j in rows or [0]])
                    if dummy:
                        batch["labels"].fill_(IGNORE_INDEX)
                    with acc.autocast():
                        loss_sum = model(**batch, num_items_in_batch=1, use_cache=False).loss
                    totals[k, 0] += loss_sum.double()
                    totals[k, 1] += batches.label_count(batch["labels"])
        model.train()
        totals = acc.reduce(totals, reduction="sum").cpu()
        by_source = {s.name: (totals[k, 0] / totals[k, 1]).item() for k, s in enumerate(held) if totals[k, 1] > 0}
        weights = {s.name: s.weight for s in held if s.name in by_source}
        if not by_source:
            return None
        loss = sum(weights[n] * v for n, v in by_source.items()) / sum(weights.values())
        row = EvalRow(step=step, eval_loss=loss, eval_ppl=perplexity(loss), eval_tokens=int(totals[:, 1].sum()),
                      eval_loss_by_source=by_source)
        self.metrics.write(row)
        self.last_step = step
        each = ", ".join(f"{n} {v:.4f}" for n, v in by_source.items()) if len(by_source) > 1 else ""
        run.say(f"eval @ step {step}: loss {loss:.4f}, perplexity {row.eval_ppl:.2f} ({row.eval_tokens:,} tokens)"
                + (f"; by source: {each}" if each else ""))
        return row


    def _evaluate_pairs(self, step: int) -> EvalRow | None:
        """Held-out preference pairs: each source's mean loss, their mixture by weight, and the rewards and
        log-probabilities of all pairs pooled, exact over ranks."""
        run = self.run
        held = [(i, s) for i, s in enumerate(run.data.sources) if s.units("eval")]
        if not held:
            return None
        acc, model, t, objective = run.accelerator, run.model, run.recipe.training, run.objective
        reference = getattr(objective.reference, "kind", None) == "precomputed" and objective.reference
        names: list[str] = []
        totals = None
        model.eval()
        with torch.no_grad():
            for k, (i, source) in enumerate(held):
                for units in batches.iter_eval_batches(source.units("eval"), micro_batch=t.micro_batch_size,
                                                       world_size=acc.num_processes, rank=acc.process_index,
                                                       max_batches=t.eval_max_batches):
                    batch = run.collate([s for u in units or [0] for s in source.sequences(u, "eval")])
                    if reference:
                        batch["reference_logps"] = torch.cat([reference.lookup(i, u, "eval") for u in units or [0]]) \
                            .to(acc.device)
                    with acc.autocast():
                        sums = objective.evaluate(model, batch)
                    if totals is None:
                        names = sorted(sums)
                        totals = torch.zeros(len(held), len(names), device=acc.device, dtype=torch.float64)
                    if units is not None:  # a rank out of pairs joined the forwards; its dummy counts nothing
                        totals[k] += torch.stack([sums[n] for n in names])
        model.train()
        totals = acc.reduce(totals, reduction="sum").cpu()
        per_source = [dict(zip(names, row.tolist())) for row in totals]
        by_source = {s.name: objective.eval_loss(v) for (_, s), v in zip(held, per_source)}
        weights = {s.name: s.weight for _, s in held}
        loss = sum(weights[n] * v for n, v in by_source.items()) / sum(weights.values())
        pooled = {n: float(totals[:, j].sum()) for j, n in enumerate(names)}
        row = EvalRow(step=step, eval_loss=loss, eval_ppl=perplexity(loss), eval_tokens=int(pooled["chosen_tokens"]),
                      eval_loss_by_source=by_source, **preference_means(pooled, prefix="eval_"))
        self.metrics.write(row)
        self.last_step = step
        run.say(f"eval @ step {step}: loss {loss:.4f}, reward accuracy {row.eval_reward_accuracy:.3f}, margin "
                f"{row.eval_reward_margin:.4f} ({int(pooled['pairs']):,} held-out pairs)")
        return row


def generate_sample(run, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation with the sharded model (every rank takes part in each forward)."""
    tok, model, acc = run.tokenizer, run.model, run.accelerator
    ids = tok(prompt, return_tensors="pt")["input_ids"].to(acc.device)
    model.eval()
    with torch.no_grad(), acc.autocast():
        for _ in range(max_new_tokens):  # a fixed number of steps: every rank must run the same forwards
            logits = model(input_ids=ids).logits[:, -1, :]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    model.train()
    new = ids[0, -max_new_tokens:].tolist()
    if tok.eos_token_id in new:
        new = new[:new.index(tok.eos_token_id)]
    return tok.decode(new, skip_special_tokens=True).strip()
