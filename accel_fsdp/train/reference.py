"""The reference of a preference method that compares the policy with the model it starts from (DPO), as one object
with one way to give a batch its log-probabilities: `attach(batch, where, split)`, called by the one batch builder
(train/setup.py `Run.batch_of`) for training and held-out evaluation alike. Three kinds, chosen by `build_reference`:

- `NoReference`: the method needs none (sft, simpo, orpo).
- `AdaptersOff` (LoRA): the base model is the same weights with the adapters switched off: one more forward per
  micro-step under no_grad, no second model.
- `Precomputed` (a full fine-tune): before the first step, the sharded model (every rank takes part in every forward,
  as in training) computes the log-probability of every answer of the training and held-out pairs once. They are
  stored next to the data cache (`<source cache>/reference/<key>/`, or under the run folder's `reference/` when the
  cache cannot be written, as a read-only prepared cache) and read back by later runs. A resumed run reads them, or
  computes them again from the starting weights: setup builds the model from them before it loads a checkpoint.

Every rank decides together whether the stored log-probabilities can be read: with a cache per machine (local disk,
a requeue onto another node) some machines may hold them and others not, and the reference pass is collective.

The key of the starting weights is data/identity.py's `weights_identity` (a local folder's files, a hub model's
snapshot, or a model built from scratch with its seed; always the config overrides and the versions of the libraries
that compute a forward). The tables carry CRC-32s in done.json, checked before they are read.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from accel_fsdp.config.methods import METHODS
from accel_fsdp.data.identity import digest, weights_identity
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.files import write_atomic
from accel_fsdp.train.sharding import gather_ints

DONE = "done.json"
CACHE_SUBDIR = "reference"
"""Inside a source's cache folder: <source cache>/reference/<key>/."""


class NoReference:
    """The method compares with no reference model."""

    kind = "none"
    extra_forward = False

    def attach(self, batch: dict, where: list[tuple[int, int]], split: str) -> None:
        pass

    def describe(self) -> str:
        return "no reference model (the loss needs none)"


class AdaptersOff:
    """The LoRA reference: the same model with every adapter layer switched off. Each LoRA layer's forward returns its
    base layer's output while its `_disable_adapters` flag is set (peft/tuners/lora/layer.py, Linear.forward checks
    `self.disable_adapters`; checked with peft 0.21.2). The flag is set directly, not through `enable_adapters(False)`
    or `PeftModel.disable_adapter()`, which also switch the adapters' requires_grad off and on again (FSDP2 decides
    at its first forward which parameters carry gradients) and scan every parameter for a status."""

    kind = "adapters-off"
    extra_forward = True

    def __init__(self, model, autocast, loss_path):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model = model
        self.autocast = autocast
        """The accelerator's autocast: the reference computes in the precision the policy does."""
        self.loss_path = loss_path
        """How the policy reads log-probabilities (train/methods/logps.py): the reference reads them the same way."""
        self.layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]

    def attach(self, batch: dict, where: list[tuple[int, int]], split: str) -> None:
        with torch.no_grad(), self.disabled(), self.autocast():
            batch["reference_logps"] = self.loss_path.sequence_logps(self.model, batch)[0]

    @contextlib.contextmanager
    def disabled(self):
        for layer in self.layers:
            layer._disable_adapters = True
        try:
            yield
        finally:
            for layer in self.layers:
                layer._disable_adapters = False

    def describe(self) -> str:
        return "the base model with the LoRA adapters switched off: one more forward per micro-step, no more memory"


@dataclass
class Precomputed:
    """Reference log-probabilities of every sequence of every source's tables."""

    kind = "precomputed"
    extra_forward = False
    arrays: list[dict[str, np.ndarray]]
    """Per source: {"train": float32 per sequence of its train table, "eval": ... of its eval table}."""
    where: str
    """Where they were read from or written to, for the start summary."""
    seconds: float
    """What computing them took in this run (0 when read back)."""
    pairs: int
    """Pairs they cover (train and held out)."""
    notes: list[str] = field(default_factory=list)
    """Where they went, when not where they were looked for."""

    def attach(self, batch: dict, where: list[tuple[int, int]], split: str) -> None:
        # Copied out of the arrays (read-only when read back from the cache): a tensor over a read-only NumPy array
        # is what torch warns about.
        values = np.concatenate([self.arrays[source][split][2 * pair:2 * pair + 2] for source, pair in where])
        values = torch.from_numpy(values.astype(np.float32))
        device = batch["labels"].device
        # pinned, as the batch itself (train/setup.py `Run.collate`): the copy does not make the host wait
        batch["reference_logps"] = (values.pin_memory() if device.type == "cuda" else values).to(device,
                                                                                                 non_blocking=True)

    def describe(self) -> str:
        if self.seconds == 0:
            return f"precomputed log-probabilities of the starting weights, read from {self.where}"
        return (f"precomputed log-probabilities of the starting weights: {self.pairs:,} pairs in {self.seconds:.1f}s "
                f"({1000 * self.seconds / max(1, self.pairs):.2f}s per 1,000 pairs), stored in {self.where}"
                + "".join(f"; {note}" for note in self.notes))


def build_reference(run, settings):
    """The reference the recipe's method needs. Collective for a precomputed one (every rank calls it)."""
    recipe = run.recipe
    if not METHODS[recipe.training.method].reference:
        return NoReference()
    if recipe.model.lora.enabled:
        return AdaptersOff(run.model, run.accelerator.autocast, run.loss_path)
    # Before any checkpoint is loaded: the model holds the starting weights (a resumed run computes them again when
    # the cache lost them).
    return precompute(run, starting_weights_key(recipe, settings))


def starting_weights_key(recipe, settings) -> str:
    """What the reference log-probabilities depend on besides the data: the starting weights and what changes their
    forward (data/identity.py `weights_identity`: the config overrides and the versions of torch, transformers and
    peft included), and how they compute here (precision, attention kernel)."""
    return digest(weights_identity(recipe), {"precision": settings.mixed_precision.value,
                                             "attention": recipe.model.attn_implementation})


def precompute(run, key: str) -> Precomputed:
    """Collective: the reference log-probability of every sequence of the training and held-out pairs, read back
    where every rank finds them, else computed by the model as it is now (the starting weights) on every rank."""
    acc, data = run.accelerator, run.data
    places = [(s.folder / CACHE_SUBDIR / key, run.layout.reference / s.name / key) for s in data.sources]
    found = [next((f for f in place if _complete(f, s)), None) for place, s in zip(places, data.sources)]
    if all(gather_ints(acc, [int(all(found))])):
        return Precomputed(_load(data, found), _where(found, places), 0.0, _pairs(data))
    run.say(f"reference: log-probabilities of the starting weights for {len(data):,} training pairs and the held-out "
            "ones (once; cached)")
    start = time.monotonic()
    results = _compute(run)
    seconds = max(1e-3, time.monotonic() - start)
    written, notes, error = list(found), [], None
    if acc.is_local_main_process:  # once per machine: a machine that found them has nothing to write
        try:
            for i, (folder, place, arrays) in enumerate(zip(found, places, results)):
                if folder is None:
                    written[i], note = _store(place, arrays, seconds)
                    notes += [note] if note else []
        except UserError as e:
            e.rank_local = not acc.is_main_process
            error = e
    if not all(gather_ints(acc, [int(error is None)])):  # every rank stops, or none
        raise error or UserError("the reference log-probabilities could not be stored (the message is above)")
    return Precomputed(results, _where(written, places), seconds, _pairs(data), notes)


def _where(folders: list[Path | None], places: list[tuple[Path, Path]]) -> str:
    """"the cache (<folder>)" or "the run folder (<folder>)"; several sources: where each source's folders are."""
    kinds = sorted({"the cache" if folder == place[0] else "the run folder"
                    for folder, place in zip(folders, places) if folder is not None}) or ["the cache"]
    if len(folders) == 1 and folders[0] is not None:
        return f"{kinds[0]} ({folders[0].parent})"
    return f"{' and '.join(kinds)} (each source's folder)"


def _compute(run) -> list[dict[str, np.ndarray]]:
    model = run.model
    model.eval()
    results = []
    with torch.no_grad():
        for source in run.data.sources:
            results.append({split: _split_logps(run, source, split) for split in ("train", "eval")
                            if source.units(split)})
    model.train()
    return results


def _split_logps(run, source, split: str) -> np.ndarray:
    """This split's sequences, shared out over the ranks a micro batch of pairs at a time; every rank runs the same
    number of forwards (a rank out of pairs repeats pair 0 and drops the result); the results gathered to all."""
    acc = run.accelerator
    world, rank, micro = acc.num_processes, acc.process_index, run.recipe.training.micro_batch_size
    pairs = source.units(split)
    mine = list(range(rank, pairs, world))
    rounds = math.ceil(math.ceil(pairs / world) / micro)
    found: dict[int, tuple[float, float]] = {}
    for b in range(rounds):
        chunk = mine[b * micro:(b + 1) * micro]
        batch = run.collate([s for u in chunk or [0] for s in source.sequences(u, split)])
        with acc.autocast():
            logps = run.loss_path.sequence_logps(run.model, batch)[0].cpu().tolist()
        for k, u in enumerate(chunk):
            found[u] = (logps[2 * k], logps[2 * k + 1])
    if world > 1:
        from accelerate.utils import gather_object

        merged: dict[int, tuple[float, float]] = {}
        for part in gather_object([found]):
            merged.update(part)
        found = merged
    out = np.zeros(2 * pairs, dtype=np.float32)
    for u, (chosen, rejected) in found.items():
        out[2 * u], out[2 * u + 1] = chosen, rejected
    return out


def _store(place: tuple[Path, Path], arrays: dict[str, np.ndarray], seconds: float) -> tuple[Path, str]:
    """Write one source's reference into the cache, else under the run folder: (where, a note when not the cache)."""
    cache, run_folder = place
    try:
        _write_reference(cache, arrays, seconds)
        return cache, ""
    except OSError as e:
        why = e.strerror or type(e).__name__
    try:
        _write_reference(run_folder, arrays, seconds)
    except OSError as e:
        raise UserError(Problem(str(cache), f"cannot be written ({why}), and neither can {run_folder} "
                                f"({e.strerror or type(e).__name__}): the reference log-probabilities have nowhere "
                                "to go", "make the cache writable, or point ACCEL_FSDP_CACHE at a writable folder "
                                "(`accel-fsdp data prepare` fills it)")) from None
    return run_folder, (f"the cache {cache.parent} cannot be written ({why}): kept under the run folder instead (a run "
                        "in another folder computes them again)")


def _write_reference(folder: Path, arrays: dict[str, np.ndarray], seconds: float) -> None:
    """The one writer of a reference folder: each split's table, then done.json with their CRC-32s, each written whole
    (files.write_atomic: a temporary name with host, PID and a random part, fsynced, renamed)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {f"{split}.bin": values.astype(np.float32).tobytes() for split, values in arrays.items()}
    done = {"sequences": {split: len(values) for split, values in arrays.items()},
            "crc32": {split: zlib.crc32(files[f"{split}.bin"]) for split in arrays}, "seconds": round(seconds, 3)}
    files[DONE] = json.dumps(done).encode()  # last: a folder without it is never read
    for name, data in files.items():
        write_atomic(folder / name, data)


def _complete(folder: Path, source) -> bool:
    """The folder holds this source's reference whole: done.json, and each split's table of the right size and
    CRC-32 (a table damaged or cut short is computed again, not trained on)."""
    try:
        done = json.loads((folder / DONE).read_text())
        for split in ("train", "eval"):
            if source.units(split):
                data = (folder / f"{split}.bin").read_bytes()
                if len(data) != 8 * source.units(split) or zlib.crc32(data) != done["crc32"][split]:
                    return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def _load(data, folders: list[Path]) -> list[dict[str, np.ndarray]]:
    return [{split: np.fromfile(folder / f"{split}.bin", dtype=np.float32) for split in ("train", "eval")
             if source.units(split)} for source, folder in zip(data.sources, folders)]


def _pairs(data) -> int:
    return sum(s.units("train") + s.units("eval") for s in data.sources)
