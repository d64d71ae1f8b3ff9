"""The probes `accel-fsdp verify` runs and what it keeps of them: a probe is a real `recipe run` of the user's recipe
in a folder of its own (`run_probe`, with the few steps on a slice of the data `base_sets` makes of it); the
Verification holds the probes and the checks' results; the report and the table say them. tools/verify.py decides
which probes run and reads them in its checks.

This module must not import torch: verify's table and the CLI's help read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from accel_fsdp.checkpoint.records import Manifest
from accel_fsdp.config.settings import FsdpSettings
from accel_fsdp.config.binder import later_wins
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.files import discard_folder, remove_dead_temporaries, write_atomic
from accel_fsdp.layout import CHECKPOINTS_DIR, MANIFEST, STEP_PREFIX, RunLayout
from accel_fsdp.model.facts import base_values
from accel_fsdp.train.lifetime import tied_to_this_process
from accel_fsdp.train.metrics import read_metrics

MARKER = "verify.json"
DROPOUT_KEYS = {"gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"), "llama": ("attention_dropout",)}


@dataclass
class Check:
    name: str
    status: str
    """PASS, FAIL, SKIP (cannot be measured here, with the reason) or INFO (for the record)."""
    measured: str
    tolerance: str = ""
    data: dict = field(default_factory=dict)


@dataclass
class RunParameters:
    """A probe run's parameter counts (run_parameters.json), from its checkpoint manifest: the run's own count."""

    parameters: int
    trainable: int

    @classmethod
    def read(cls, path: Path) -> RunParameters | None:
        """None where the probe wrote none (it failed before its first checkpoint)."""
        if not path.exists():
            return None
        saved = json.loads(path.read_text())
        return cls(parameters=saved["parameters"], trainable=saved["trainable"])

    def write(self, path: Path) -> None:
        write_atomic(path, json.dumps(asdict(self)))


@dataclass
class Probe:
    name: str
    folder: Path
    returncode: int
    stderr_tail: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def layout(self) -> RunLayout:
        return RunLayout.at(self.folder)

    def train_rows(self) -> list:

        return [r for r in read_metrics(self.layout.metrics_file, strict=False) if r.kind == "train"]

    def sharding(self):
        from accel_fsdp.train.sharding import ShardingRecord

        return ShardingRecord.read(self.layout.sharding_file)

    def counts(self) -> RunParameters | None:
        return RunParameters.read(self.layout.run_parameters_file)

    def settings(self) -> FsdpSettings:
        return FsdpSettings.read(self.layout.settings_file)

    def trace(self, name: str) -> list[dict]:
        out = []
        for path in sorted(self.layout.trace.glob(f"{name}-rank*.json")):
            out.append(json.loads(path.read_text()))
        return out

    def failure(self) -> str:
        return f"the {self.name} run failed (exit {self.returncode}): {self.stderr_tail}"


@dataclass
class Verification:
    recipe: object
    config: object
    world: int
    precision: str
    device: str
    steps: int
    out_dir: Path
    overrides: list[str]
    layers: int | None = None
    cpu: bool = False
    """--cpu: every probe runs the config on CPU ranks, whatever it was written for."""
    probes: dict[str, Probe] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    def sets(self, *extra: str) -> list[str]:
        return list(self.overrides) + list(extra)


# ------------------------------------------------------------------------------------------------- running


def run_probe(v: Verification, name: str, sets: list[str], *, extra_args=(), env: dict | None = None) -> Probe:
    folder = v.out_dir / name
    argv = [sys.executable, "-m", "accel_fsdp", "recipe", "run", str(Path(v.recipe.source).absolute()),
            "--accelerate-config", str(v.config.path), "--output-dir", str(folder), *extra_args,
            *(["--cpu"] if v.cpu else [])]
    if folder.exists():
        argv.append("--overwrite")
    for item in later_wins(sets):  # a probe's own settings replace the user's
        argv += ["--set", item]
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True,
                          env=tied_to_this_process(dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))))
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip() and not x.startswith(("training:", "W1", "["))]
    probe = Probe(name, folder, proc.returncode, " / ".join(lines[-3:])[-600:], time.monotonic() - start)
    v.probes[name] = probe
    print(f"  probe {name:<14} {'ok' if probe.ok else 'FAILED'} in {probe.seconds:.0f}s", flush=True)
    return probe


def base_sets(v: Verification, steps: int) -> list[str]:
    """What every probe changes in the recipe: a few steps on a slice of the data, no evaluation, no sample, no
    trackers (the user's wandb stays clean), a checkpoint every other step kept, and no export (EXPORTED adds the
    fp32 export to the probes whose weights the resume check compares)."""
    t = v.recipe.training
    rows = max(64, t.global_batch_size * (steps + 2) * 4)
    sets = list(v.overrides) + [f"training.max_steps={steps}", "training.epochs=null", "training.warmup_steps=0",
            "training.eval_every_steps=null",
            "data.eval_fraction=0", f"data.max_rows={min(rows, v.recipe.data.max_rows or rows)}",
            "logging.every_steps=1", "logging.sample_prompt=null", "logging.trackers=[]",
            "checkpoint.every_steps=2", "checkpoint.keep_last=null", "checkpoint.export_final=false",
            "checkpoint.export_dtype=fp32", f"checkpoint.dir={CHECKPOINTS_DIR}", "output_dir=null"]
    if v.layers:
        sets.append(f"model.config_overrides.{layer_key(v.recipe)}={v.layers}")
    # Without dropout: two splits of a batch, or two ranks, would draw different masks and could not agree.
    sets += [f"model.config_overrides.{k}=0.0" for k in DROPOUT_KEYS.get(model_type(v.recipe), ())]
    if v.recipe.model.lora.enabled:
        sets.append("model.lora.dropout=0.0")
    return sets


def layer_key(recipe) -> str:
    base = base_values(recipe)
    return "n_layer" if base and base[0] == "gpt2" else "num_hidden_layers"


def split_micro_batch(recipe, world: int) -> int | None:
    """A different micro batch for the same global batch on the same ranks (so accumulation changes), or None."""
    t = recipe.training
    for micro in (t.micro_batch_size // 2, t.micro_batch_size * 2):
        if micro >= 1 and micro != t.micro_batch_size and replace(t, micro_batch_size=micro).splits_evenly(world):
            return micro
    return None


def model_type(recipe) -> str | None:
    """The model type of the recipe's base (gpt2, llama, ...), or None where its facts are unknown."""
    base = base_values(recipe)
    return base[0] if base else None


def record_counts(probe: Probe) -> None:
    """Parameter counts of the probe run, from its checkpoint manifest (the run's own count)."""
    manifests = sorted(probe.layout.checkpoints.glob(f"{STEP_PREFIX}*/{MANIFEST}"))
    if manifests:
        m = Manifest.read(manifests[-1].parent)
        RunParameters(parameters=m.parameters, trainable=m.trainable_parameters).write(probe.layout.run_parameters_file)


def claim_folder(out_dir: Path) -> None:
    """The verify folder is ours alone: created, or an earlier verify's replaced; anything else is refused. The
    earlier one is discarded in one rename (files.discard_folder): a verify killed while deleting it leaves it whole
    or gone, never a folder without its marker that the next verify would refuse as someone else's."""
    remove_dead_temporaries(out_dir)  # what a verify killed while discarding its predecessor left
    if out_dir.exists():
        if not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / MARKER).exists()):
            raise UserError(Problem(str(out_dir), "exists and is not an earlier verify folder",
                                    "give another --output-dir (nothing was changed)"))
        discard_folder(out_dir)
    out_dir.mkdir(parents=True)
    write_atomic(out_dir / MARKER, json.dumps({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))


def write_report(v: Verification) -> Path:
    path = v.out_dir / "report.json"
    report = {"recipe": v.recipe.name, "config": v.config.label, "ranks": v.world, "device": v.device,
              "precision": v.precision, "steps": v.steps, "layers": v.layers,
              "probes": {n: {"exit": p.returncode, "seconds": round(p.seconds, 1), "folder": str(p.folder)}
                         for n, p in v.probes.items()},
              "checks": [asdict(c) for c in v.checks],
              "passed": not any(c.status == "FAIL" for c in v.checks)}
    write_atomic(path, json.dumps(report, indent=1, default=str) + "\n")
    write_atomic(v.out_dir / MARKER, json.dumps({"report": str(path)}))
    return path


def format_table(v: Verification) -> str:
    width = max(len(c.name) for c in v.checks)
    lines = [f"{'CHECK':<{width}}  RESULT  MEASURED (TOLERANCE)"]
    for c in v.checks:
        lines.append(f"{c.name:<{width}}  {c.status:<6}  {c.measured}" + (f"  ({c.tolerance})" if c.tolerance else ""))
    failed = sum(c.status == "FAIL" for c in v.checks)
    passed = sum(c.status == "PASS" for c in v.checks)
    lines.append(f"{passed} passed, {failed} failed" + (f", {sum(c.status == 'SKIP' for c in v.checks)} skipped"
                                                        if any(c.status == "SKIP" for c in v.checks) else "")
                 + f"; report: {v.out_dir / 'report.json'}")
    return "\n".join(lines)
