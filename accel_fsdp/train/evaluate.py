"""Held-out loss (each source's, and the mixture's: what the training loss estimates) and the objective's statistics,
and the sample generated at the end. The evaluator decides its own cadence (`training.eval_every_steps`, and once at
the end)."""

from __future__ import annotations

import torch

from accel_fsdp.data import batches
from accel_fsdp.train.methods import eval_loss
from accel_fsdp.train.metrics import EvalRow, MetricsWriter, perplexity
from accel_fsdp.train.state import TrainingState


class Evaluator:
    def __init__(self, run, metrics: MetricsWriter):
        self.run = run
        self.metrics = metrics
        self.every = run.recipe.training.eval_every_steps
        self.last_step: int | None = None
        self._shares: dict[str, dict[str, float]] | None = None

    def due(self, step: int) -> bool:
        """Optimizer step `step` is followed by an evaluation (the last one's is the end's)."""
        return bool(self.every) and step % self.every == 0 and step != self.run.total_steps

    def after_step(self, state: TrainingState) -> None:
        if self.due(state.step):
            self.evaluate(state.step)

    def resumed_at_end(self, step: int, evaluated_on_main: bool) -> None:
        """A resume from the checkpoint of the run's last step (a finished run resumed): its evaluation, kept in the
        metrics file (the main process read it), is not computed and logged a second time at the end."""
        from accelerate.utils import broadcast_object_list

        box = [evaluated_on_main]
        if self.run.accelerator.num_processes > 1:  # every rank evaluates, or none
            broadcast_object_list(box, from_process=0)
        if box[0]:
            self.last_step = step

    def at_end(self, state: TrainingState) -> None:
        if self.last_step != state.step:
            self.evaluate(state.step)

    def evaluate(self, step: int) -> EvalRow | None:
        """Each source's held-out loss, exact over ranks, and their mixture (what the training loss estimates); a
        preference run's statistics over every held-out pair. One path for every method: the objective says what a
        batch's sums are and how they make a loss (train/methods/base.py)."""
        run, objective = self.run, self.run.objective
        held = [(i, s) for i, s in enumerate(run.data.sources) if s.units("eval")]
        if not held:
            return None
        per_source = self._held_out_sums(held)
        terms = objective.eval_terms
        counted = {s.name: sums for (_, s), sums in zip(held, per_source) if sums[terms[0][1]] > 0}
        if not counted:
            return None
        by_source = {name: eval_loss(terms, sums) for name, sums in counted.items()}
        loss = mixture_loss(terms, counted, self.shares())
        pooled = {name: sum(sums[name] for sums in per_source) for name in per_source[0]}
        row = EvalRow(step=step, eval_loss=loss, eval_ppl=perplexity(loss), eval_tokens=int(pooled["tokens"]),
                      eval_loss_by_source=by_source, preference=objective.statistics(pooled))
        self.metrics.write(row)
        self.last_step = step
        each = ", ".join(f"{n} {v:.4f}" for n, v in by_source.items()) if len(by_source) > 1 else ""
        run.say(f"eval @ step {step}: loss {loss:.4f}, {objective.eval_summary(pooled, loss)}"
                + (f"; by source: {each}" if each else ""))
        return row

    def _held_out_sums(self, held: list) -> list[dict[str, float]]:
        """Each held-out source's sums of the objective's `evaluate` over all of its units (every rank's share)."""
        run = self.run
        acc, model, t, objective = run.accelerator, run.model, run.recipe.training, run.objective
        names: list[str] = []
        totals = None
        model.eval()
        with torch.no_grad():
            for k, (i, source) in enumerate(held):  # one source per batch: its loss is its own
                for units in batches.iter_eval_batches(source.units("eval"), micro_batch=t.micro_batch_size,
                                                       world_size=acc.num_processes, rank=acc.process_index,
                                                       max_batches=t.eval_max_batches):
                    batch = run.batch_of([(i, u) for u in units or [0]], "eval")
                    with acc.autocast():
                        sums = objective.evaluate(model, batch)
                    if totals is None:
                        names = sorted(sums)
                        totals = torch.zeros(len(held), len(names), device=acc.device, dtype=torch.float64)
                    if units is not None:  # a rank out of units joined the collective forwards; it counts nothing
                        totals[k] += torch.stack([sums[n] for n in names])
        model.train()
        totals = acc.reduce(totals, reduction="sum").cpu()
        return [dict(zip(names, row)) for row in totals.tolist()]

    def shares(self) -> dict[str, dict[str, float]]:
        """Each source's expected share of what the training loss averages over (once: the data does not change)."""
        if self._shares is None:
            self._shares = loss_shares(self.run.data, self.run.objective)
        return self._shares


def loss_shares(data, objective) -> dict[str, dict[str, float]]:
    """Per source, its expected share of each count the training loss is divided by (loss-carrying tokens; pairs;
    ORPO's chosen tokens) in an optimizer step: the weights held-out losses are mixed by, so that eval_loss estimates
    what the training loss does. data.mix_by tokens gives source i the share w_i of the loss-carrying tokens, so its
    units come in proportion to w_i / c_i (c_i: its mean loss-carrying tokens per unit); mix_by rows gives it w_i of
    the units. A count of n_i per unit then falls to it in proportion to its units x n_i: with tokens and a token loss
    that is w_i, with rows it is the realized token share w_i c_i / sum_j w_j c_j."""
    costs = data.mean_costs() or [1.0] * len(data.sources)  # mix_by rows: the weights share out units
    units = [s.weight / (cost or 1.0) for s, cost in zip(data.sources, costs)]
    per_unit = [objective.unit_counts(s) for s in data.sources]
    names = {count for _, count in objective.eval_terms}
    totals = {name: sum(u * counts[name] for u, counts in zip(units, per_unit)) or 1.0 for name in names}
    return {s.name: {name: u * counts[name] / totals[name] for name in names}
            for s, u, counts in zip(data.sources, units, per_unit)}


def mixture_loss(terms, sums_by_source: dict[str, dict[str, float]], shares: dict[str, dict[str, float]]) -> float:
    """The mixture's held-out loss: each term of each source weighted by the source's share of the term's count,
    among the sources evaluated."""
    loss = 0.0
    for total, count in terms:
        weights = {name: shares[name][count] for name in sums_by_source}
        loss += sum(weights[name] * sums[total] / max(1.0, sums[count]) for name, sums in sums_by_source.items()) / (
            sum(weights.values()) or 1.0)
    return loss


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
