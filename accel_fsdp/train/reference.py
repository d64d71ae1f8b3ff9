"""The reference of a DPO run, at no cost of a second model.

With LoRA the reference is the base model: the same weights with the adapters switched off (objective.py
`AdaptersOff`), one extra forward per micro-step under no_grad. For a full fine-tune it is the model as it starts:
before the first step, the sharded model (every rank takes part in every forward, as in training) computes the
log-probability of every answer of the training and held-out pairs once; they are stored next to the data cache
(`<source cache>/reference/<key>/`), keyed by the starting weights, the precision and the attention kernel, and read
back by later runs. A resumed run reads them, or computes them again from the starting weights: setup builds the
model from them before it loads a checkpoint.

The key of the starting weights: a local folder's weight files (names, sizes, modification times) and config; a hub
model's snapshot (commit) in the local cache; a model built from scratch, its config, the seed and the torch version
that initialized it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from accel_fsdp.train.objective import answer_logps, sequence_index

DONE = "done.json"


@dataclass
class Precomputed:
    """Reference log-probabilities of every sequence of every source's tables, memory-mapped."""

    kind = "precomputed"
    arrays: list[dict[str, np.ndarray]]
    """Per source: {"train": float32 per sequence of its train table, "eval": ... of its eval table}."""
    folders: list[Path]
    seconds: float
    """What computing them took in this run (0 when read from the cache)."""
    pairs: int
    """Pairs they cover (train and held out)."""

    @property
    def cached(self) -> bool:
        return self.seconds == 0

    def lookup(self, source: int, pair: int, split: str) -> torch.Tensor:
        """The reference log-probabilities of a pair's chosen and rejected answers."""
        return torch.from_numpy(np.asarray(self.arrays[source][split][2 * pair:2 * pair + 2], dtype=np.float32))

    def describe(self) -> str:
        where = self.folders[0].parent if len(self.folders) == 1 else "each source's cache folder"
        if self.cached:
            return f"precomputed log-probabilities of the starting weights, read from the cache ({where})"
        return (f"precomputed log-probabilities of the starting weights: {self.pairs:,} pairs in {self.seconds:.1f}s "
                f"({1000 * self.seconds / max(1, self.pairs):.2f}s per 1,000 pairs), cached in {where}")


def starting_weights_key(recipe, settings) -> str:
    """What the reference log-probabilities depend on besides the data: the starting weights, how they compute."""
    m = recipe.model
    if m.architecture:
        import transformers

        identity = {"architecture": m.architecture, "overrides": m.config_overrides, "seed": recipe.training.seed,
                    "torch": torch.__version__, "transformers": transformers.__version__}
    elif Path(m.name_or_path).expanduser().is_dir():
        folder = Path(m.name_or_path).expanduser().resolve()
        files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
        identity = {"folder": str(folder), "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}
    else:
        identity = {"hub": m.name_or_path, "snapshot": _hub_snapshot(m.name_or_path)}
    identity.update(precision=settings.mixed_precision.value, attention=m.attn_implementation,
                    lora=False, trust_remote_code=m.trust_remote_code)
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _hub_snapshot(repo: str) -> str | None:
    """The commit of the hub model's snapshot in the local cache (what from_pretrained read), if it is there."""
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(repo, "config.json")
    except Exception:  # an id the hub library refuses: the name alone is the key
        return None
    return Path(path).parent.name if isinstance(path, str) else None


def precompute(run, key: str) -> Precomputed:
    """Collective: the reference log-probability of every sequence of the training and held-out pairs, computed by
    the model as it is now (the starting weights), or read back from the cache."""
    acc, data = run.accelerator, run.data
    folders = [s.folder / "reference" / key for s in data.sources]
    if all((f / DONE).exists() for f in folders):
        return Precomputed(_load(data, folders), folders, 0.0, _pairs(data))
    start = time.monotonic()
    model = run.model
    model.eval()
    results: list[dict[str, np.ndarray]] = []
    with torch.no_grad():
        for source in data.sources:
            arrays = {}
            for split in ("train", "eval"):
                if source.units(split) == 0:
                    continue
                arrays[split] = _split_logps(run, source, split)
            results.append(arrays)
    model.train()
    if acc.is_local_main_process:
        for arrays, folder in zip(results, folders):
            folder.mkdir(parents=True, exist_ok=True)
            for split, values in arrays.items():
                tmp = folder / f".{split}.{os.getpid()}"
                values.astype(np.float32).tofile(tmp)
                os.replace(tmp, folder / f"{split}.bin")
            (folder / DONE).write_text(json.dumps({"sequences": {k: len(v) for k, v in arrays.items()},
                                                   "seconds": round(time.monotonic() - start, 3)}))
    acc.wait_for_everyone()
    return Precomputed(results, folders, max(1e-3, time.monotonic() - start), _pairs(data))


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
        units = chunk or [0]
        batch = run.collate([s for u in units for s in source.sequences(u, split)])
        labels = batch.pop("labels")
        with acc.autocast():
            logits = run.model(**batch, use_cache=False).logits
        logps = answer_logps(logits, labels, sequence_index(batch, labels))[0].cpu().tolist()
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


def _load(data, folders: list[Path]) -> list[dict[str, np.ndarray]]:
    out = []
    for source, folder in zip(data.sources, folders):
        arrays = {}
        for split, table in (("train", source.train), ("eval", source.eval)):
            if table is not None and (folder / f"{split}.bin").exists():
                arrays[split] = np.memmap(folder / f"{split}.bin", dtype=np.float32, mode="r", shape=(len(table),))
        out.append(arrays)
    return out


def _pairs(data) -> int:
    return sum(s.units("train") + s.units("eval") for s in data.sources)
