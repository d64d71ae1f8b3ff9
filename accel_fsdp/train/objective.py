"""What a micro-step's loss is: next-token prediction (training.method sft), or a preference loss over pairs of
answers (dpo, simpo, orpo). The loop calls the objective; the objective never steps, logs or communicates.

Both are exact over the global batch however it is split over ranks and micro-steps. FSDP averages gradients over the
W ranks and `accelerator.backward` divides by the k accumulation steps, so a micro-step's loss is a *sum* over its
part of the global batch divided by (global count) / (W x k), and the k x W micro-steps add up to the mean over the
global batch. The counts come from the per-sequence counts the data stores, the same on every rank: no communication.
  sft     token sum / (loss-carrying tokens of the global batch / (W x k))   (transformers' num_items_in_batch)
  pairs   sum of pair losses / (pairs of the global batch / (W x k)) = / micro batch
  orpo    adds the chosen answers' NLL sum / (chosen loss-carrying tokens of the global batch / (W x k))

Preference losses, for a pair (x, chosen y_w, rejected y_l); log pi(y|x) is the sum of the answer's token
log-probabilities, |y| its token count, sigma the logistic function, eps = preference.label_smoothing:
  dpo    z = beta ((log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)))
         loss = -(1 - eps) log sigma(z) - eps log sigma(-z)                     (Rafailov et al., 2023; eps: cDPO)
  simpo  z = beta (log pi(y_w) / |y_w| - log pi(y_l) / |y_l|) - gamma
         loss = -(1 - eps) log sigma(z) - eps log sigma(-z)                     (Meng et al., 2024)
  orpo   a = log pi(y) / |y|, log odds(y) = a - log(1 - exp(a))
         loss = NLL(y_w) + lambda (-log sigma(log odds(y_w) - log odds(y_l)))   (Hong et al., 2024)
Rewards (what users watch): dpo beta (log pi(y) - log ref(y)); simpo beta a(y); orpo lambda a(y) (as TRL logs them).

A micro-batch of pairs holds 2B sequences, chosen and rejected of each pair side by side ([c1, r1, c2, r2, ...]), so
both answers of a pair go through one forward: one all-gather of each FSDP unit for the pair.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from accel_fsdp.data.store import IGNORE_INDEX

PREFERENCE_METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "logps_chosen",
                      "logps_rejected")
"""What a preference run logs besides the loss (train rows; eval rows with an eval_ prefix)."""


@dataclass(frozen=True)
class Norm:
    """The global counts a step's micro-step losses are divided by, each already divided by W x k."""

    tokens: float = 1.0
    """Loss-carrying tokens (sft), or the chosen answers' (orpo)."""
    pairs: float = 1.0
    """Preference pairs."""


class NextToken:
    """training.method sft: the model's own causal LM loss, as a token sum over the global normalizer."""

    method = "sft"
    reference = None

    def norm(self, data, units: list[int], ranks: int, accumulation: int, *, global_mean: bool = True) -> Norm | None:
        """None: each micro-step takes its own mean (only `verify`'s proof that its equivalence check can fail)."""
        if not global_mean:
            return None
        return Norm(tokens=max(1, sum(data.label_count(u) for u in units)) / (ranks * accumulation))

    def __call__(self, model, batch: dict, norm: Norm | None) -> tuple[torch.Tensor, dict]:
        # use_cache=False: with a KV cache transformers skips the packed-document mask
        # (masking_utils.py, _preprocess_mask_arguments needs past_key_values None; 5.23.0).
        loss = model(**batch, num_items_in_batch=None if norm is None else norm.tokens, use_cache=False).loss
        return loss, {}


class PreferenceLoss:
    """training.method dpo, simpo or orpo over pairs (see the module docstring). `reference`: how the reference
    log-probabilities of a DPO run are obtained (train/reference.py), None for SimPO and ORPO."""

    def __init__(self, method: str, preference, reference=None):
        self.method = method
        self.beta = preference.beta_for(method)
        self.eps = preference.label_smoothing
        self.gamma = preference.gamma
        self.lam = preference.lambda_
        self.reference = reference

    def norm(self, data, units: list[int], ranks: int, accumulation: int, *, global_mean: bool = True) -> Norm | None:
        if not global_mean:
            return None
        chosen = sum(data.chosen_label_count(u) for u in units) if self.method == "orpo" else 1
        return Norm(tokens=max(1, chosen) / (ranks * accumulation), pairs=len(units) / (ranks * accumulation))

    def terms(self, model, batch: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Per pair terms (`pair_terms`) of a micro-batch, and each sequence's loss-carrying token count."""
        batch = dict(batch)
        labels = batch.pop("labels")
        reference = batch.pop("reference_logps", None)
        segments = sequence_index(batch, labels)
        if self.method == "dpo" and reference is None:  # LoRA: the base model is the adapters switched off
            with torch.no_grad(), self.reference.disabled(model):
                reference = answer_logps(model(**batch, use_cache=False).logits, labels, segments)[0]
        logps, counts = answer_logps(model(**batch, use_cache=False).logits, labels, segments)
        return pair_terms(self.method, logps, counts, reference, beta=self.beta, eps=self.eps, gamma=self.gamma,
                          lam=self.lam), counts

    def __call__(self, model, batch: dict, norm: Norm | None) -> tuple[torch.Tensor, dict]:
        terms, counts = self.terms(model, batch)
        pairs = norm.pairs if norm is not None else len(terms["loss"])
        loss = terms["loss"].sum() / pairs
        if self.method == "orpo":
            tokens = norm.tokens if norm is not None else counts[0::2].sum().clamp(min=1)
            loss = loss + terms["nll"].sum() / tokens
        with torch.no_grad():
            stats = {name: terms[name].detach().sum() for name in ("reward_chosen", "reward_rejected",
                                                                     "reward_accuracy", "logps_chosen",
                                                                     "logps_rejected")}
            stats["pairs"] = torch.tensor(float(len(terms["loss"])), device=loss.device)
        return loss, stats


    def evaluate(self, model, batch: dict) -> dict[str, torch.Tensor]:
        """Sums over a held-out micro-batch's pairs: the pair losses, the chosen answers' NLL and tokens (orpo), and
        the statistics a row reports (no gradient)."""
        terms, counts = self.terms(model, batch)
        out = {name: terms[name].detach().double().sum() for name in ("loss", "reward_chosen", "reward_rejected",
                                                                       "reward_accuracy", "logps_chosen",
                                                                       "logps_rejected")}
        out["nll"] = terms["nll"].detach().double().sum() if "nll" in terms else out["loss"] * 0
        out["chosen_tokens"] = counts[0::2].double().sum()
        out["pairs"] = torch.tensor(float(len(terms["loss"])), dtype=torch.float64, device=out["loss"].device)
        return out

    def eval_loss(self, sums: dict[str, float]) -> float:
        """The held-out loss from `evaluate`'s sums: the mean pair loss (plus orpo's NLL per chosen token)."""
        loss = sums["loss"] / max(1.0, sums["pairs"])
        return loss + (sums["nll"] / max(1.0, sums["chosen_tokens"]) if self.method == "orpo" else 0.0)


def pair_terms(method: str, logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor | None, *,
               beta: float, eps: float, gamma: float, lam: float) -> dict[str, torch.Tensor]:
    """Per pair: the preference loss ("loss"; for orpo only the weighted odds-ratio term), the chosen answer's NLL sum
    ("nll", orpo), the rewards and the mean token log-probabilities. `logps`, `counts`, `reference`: per sequence,
    chosen and rejected interleaved."""
    logps = logps.float()
    pc, pr = logps[0::2], logps[1::2]
    nc, nr = counts[0::2].clamp(min=1).float(), counts[1::2].clamp(min=1).float()
    ac, ar = pc / nc, pr / nr  # mean token log-probabilities
    out = {"logps_chosen": ac, "logps_rejected": ar}
    if method == "dpo":
        rc, rr = beta * (pc - reference[0::2].float()), beta * (pr - reference[1::2].float())
        z = rc - rr
        out["loss"] = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    elif method == "simpo":
        rc, rr = beta * ac, beta * ar
        z = rc - rr - gamma
        out["loss"] = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    elif method == "orpo":
        log_odds = (ac - log1mexp(ac)) - (ar - log1mexp(ar))
        out["loss"] = lam * -F.logsigmoid(log_odds)
        out["nll"] = -pc
        rc, rr = lam * ac, lam * ar
    else:
        raise ValueError(method)
    out.update(reward_chosen=rc, reward_rejected=rr, reward_accuracy=(rc > rr).float())
    return out


def log1mexp(a: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(a)) for a < 0, accurate at both ends (Maechler, 2012): log(-expm1(a)) near 0, log1p(-exp(a))
    below -log 2."""
    return torch.where(a > -0.6931471805599453, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def sequence_index(batch: dict, labels: torch.Tensor) -> torch.Tensor | None:
    """For a padding-free batch (one row, cu_seq_lens), the sequence each token belongs to; None for padded rows."""
    cu = batch.get("cu_seq_lens_q")
    if cu is None:
        return None
    sizes = (cu[1:] - cu[:-1]).to(labels.device).long()
    return torch.repeat_interleave(torch.arange(len(sizes), device=labels.device), sizes)


def answer_logps(logits: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the loss-carrying tokens' log-probabilities, their count) of each sequence: padded rows (B, T), or one
    padding-free row whose tokens `segments` assigns to sequences. Token t's logits predict label t + 1. The
    log-softmax runs in fp32, one row at a time (a row of a 128K vocabulary is what one token costs)."""
    shifted = labels[:, 1:]
    mask = shifted != IGNORE_INDEX
    safe = shifted.masked_fill(~mask, 0)
    token = torch.zeros(shifted.shape, dtype=torch.float32, device=logits.device)
    for r in range(logits.shape[0]):
        row = logits[r, :-1].float()
        token[r] = row.gather(-1, safe[r, :, None])[:, 0] - torch.logsumexp(row, dim=-1)
    token = token * mask
    if segments is None:
        return token.sum(-1), mask.sum(-1)
    owner = segments[1:]  # the sequence of the predicted token
    n = int(segments.max()) + 1
    sums = torch.zeros(n, dtype=torch.float32, device=logits.device).index_add(0, owner, token[0])
    counts = torch.zeros(n, dtype=torch.long, device=logits.device).index_add(0, owner, mask[0].long())
    return sums, counts


class AdaptersOff:
    """The LoRA reference: the same model with every adapter layer switched off. Each LoRA layer's forward returns its
    base layer's output while its `_disable_adapters` flag is set (peft/tuners/lora/layer.py, Linear.forward checks
    `self.disable_adapters`; checked with peft 0.21.2). The flag is set directly, not through `enable_adapters(False)`
    or `PeftModel.disable_adapter()`, which also switch the adapters' requires_grad off and on again (FSDP2 decides
    at its first forward which parameters carry gradients) and scan every parameter for a status."""

    kind = "adapters-off"

    def __init__(self, model):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]

    @contextlib.contextmanager
    def disabled(self, model):
        for layer in self.layers:
            layer._disable_adapters = True
        try:
            yield
        finally:
            for layer in self.layers:
                layer._disable_adapters = False


def build_objective(recipe, model=None, reference=None):
    """The objective of a recipe's training.method."""
    method = recipe.training.method
    if method == "sft":
        return NextToken()
    if method == "dpo" and reference is None and recipe.model.lora.enabled:
        reference = AdaptersOff(model)
    return PreferenceLoss(method, recipe.preference, reference)
