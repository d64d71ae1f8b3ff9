"""The test switches of a run, and what tests and `accel-fsdp verify` attach to it outside the loop body.

Switches, set in the environment of a run by tests and by `verify` (never by a user's run):
  ACCEL_FSDP_BREAK=<name>[,<name>]  break one property on purpose (BREAKS), so tests prove each `verify` check can fail
  ACCEL_FSDP_FAULT=<kind>:<step>[@<rank>]  a crash or hang after an optimizer step or inside a save (faults.py)
  ACCEL_FSDP_PROBE=<name>[,<name>]  measurements of internals through model hooks (probes.py)
  ACCEL_FSDP_TRACE_UNITS=1          per rank and step, the training units read, in <run>/trace/ (resume tests)
  ACCEL_FSDP_SLOW_DATA=<seconds>    each source's build waits this long first (a large dataset's build, for the
                                    tests of what the other ranks do meanwhile)
  ACCEL_FSDP_LOAD_BLOCK=<elements>  streaming loading's block of rows (model/streaming_load.py BLOCK_ELEMENTS) this
                                    small, so a tiny model's blocks cross the ranks' shards

They are read once, by `TestSwitches.from_env` in train/setup.py, and reach the code that acts on them as plain
parameters where a library takes the broken setting (`reduce_dtype`, `preserve_rng_state`, `shard_cpu_ranks`), as a
`Faults` object, or by substitution: `substituted` replaces the part of the run a switch breaks (the sampler's
weights, the objective's normalizer, the collate), and `after_resume` the step a resume starts at, so the code that
trains has no parameter for them. This module and setup.py are the only ones that know the switches exist. Unset,
nothing here runs or changes a result.

And one measurement for the sharding record: at the first optimizer step that really runs (gradients and
optimizer state both exist only inside it), what each rank stores, through an optimizer step hook.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from accel_fsdp.data.store import Sequence
from accel_fsdp.layout import RunLayout
from accel_fsdp.model.nf4 import is_nf4
from accel_fsdp.train import probes
from accel_fsdp.train.faults import KINDS, Faults
from accel_fsdp.train.methods.logps import ChunkedPath
from accel_fsdp.train.sharding import ShardingRecord, gathered_state_bytes
from accel_fsdp.train.state import TrainingState

BREAK_ENV = "ACCEL_FSDP_BREAK"
FAULT_ENV = "ACCEL_FSDP_FAULT"
PROBE_ENV = "ACCEL_FSDP_PROBE"
TRACE_ENV = "ACCEL_FSDP_TRACE_UNITS"
SLOW_DATA_ENV = "ACCEL_FSDP_SLOW_DATA"
LOAD_BLOCK_ENV = "ACCEL_FSDP_LOAD_BLOCK"

BREAKS = {
    "unsharded": "CPU ranks: leave Accelerate's state as it comes (unsharded replicas), and skip the check that stops "
                 "that",
    "bf16-reduce": "reduce gradients in bf16 instead of fp32",
    "mean-loss": "normalize each micro-step's loss by its own tokens instead of the global batch's",
    "skip-batch": "skip one optimizer step's batch when resuming",
    "mask-leak": "let packed documents attend to each other (positions not restarted per document)",
    "ac-rng": "recompute checkpointed activations with new random draws (dropout)",
    "mix-weights": "draw from the data sources in equal shares, whatever their weights",
    "offload-bf16": "keep offloaded activations in bf16 host buffers (a copy that rounds)",
    "compile-skew": "scale each compiled block's output by 1 + 2^-8 (a compiled graph a bf16 unit off)",
    "chunked-loss": "the chunked loss leaves out the last loss-carrying token of every micro-batch",
    "nf4-scales": "dequantize every 4-bit weight 16 times too large (its block scales misread)",
}


def _names(text: str | None) -> frozenset[str]:
    return frozenset(n.strip() for n in (text or "").split(",") if n.strip())


@dataclass(frozen=True)
class TestSwitches:
    """Every test switch of a run, read once."""

    __test__ = False  # not a pytest class

    breaks: frozenset[str] = frozenset()
    """Properties broken on purpose (BREAKS)."""
    fault: str | None = None
    """A fault to inject (faults.py)."""
    probes: frozenset[str] = frozenset()
    """Measurements to record (probes.py)."""
    trace_units: bool = False
    """Record the training sequences each rank reads at each step."""
    slow_data: float = 0.0
    """Seconds each data source's build waits before it starts."""
    load_block: int | None = None
    """Elements of streaming loading's block of rows (None: model/streaming_load.py's own)."""

    @classmethod
    def from_env(cls, env=None) -> TestSwitches:
        env = os.environ if env is None else env
        switches = cls(breaks=_names(env.get(BREAK_ENV)), fault=env.get(FAULT_ENV) or None,
                       probes=_names(env.get(PROBE_ENV)), trace_units=bool(env.get(TRACE_ENV)),
                       slow_data=float(env.get(SLOW_DATA_ENV) or 0),
                       load_block=int(env[LOAD_BLOCK_ENV]) if env.get(LOAD_BLOCK_ENV) else None)
        for names, known, var in ((switches.breaks, BREAKS, BREAK_ENV), (switches.probes, probes.PROBES, PROBE_ENV)):
            if names - set(known):
                raise ValueError(f"{var}: unknown {', '.join(sorted(names - set(known)))}; known: {', '.join(known)}")
        if switches.fault and switches.fault.partition(":")[0] not in KINDS:
            raise ValueError(f"{FAULT_ENV}={switches.fault!r}: expected one of {', '.join(KINDS)} followed by :STEP")
        return switches

    def broken(self, name: str) -> bool:
        assert name in BREAKS, name
        return name in self.breaks


NO_SWITCHES = TestSwitches()
"""A run as users run it (and the baseline of `bench`)."""


class TestHooks:
    """What the switches attach to a run: row traces, faults, probes; and the measurement of optimizer state."""

    __test__ = False  # not a pytest class

    def __init__(self, switches: TestSwitches, *, accelerator, model, optimizer, sampler, sharding: ShardingRecord,
                 layout: RunLayout, packing_probe: Callable[[Path], None], knobs=None):
        self.switches = switches
        self.accelerator, self.model, self.optimizer, self.sharding, self.layout = (accelerator, model, optimizer,
                                                                                     sharding, layout)
        rank = accelerator.process_index
        self.faults = Faults(switches.fault, rank)
        self.trace = None
        if switches.trace_units:
            layout.trace.mkdir(parents=True, exist_ok=True)
            self.trace = (layout.trace / f"units-rank{rank}.jsonl").open("a")
        probes.install(model, layout.trace, rank, switches.probes)
        if "packing" in switches.probes:
            packing_probe(layout.trace / f"packing-rank{rank}.json")
        if "data" in switches.probes:
            probes.data_order(sampler, layout.trace / f"data-rank{rank}.json")
        self.knobs, self.knob_trace = knobs, None
        if "knobs" in switches.probes:
            layout.trace.mkdir(parents=True, exist_ok=True)
            self.knob_trace = (layout.trace / f"knobs-rank{rank}.jsonl").open("a")
        self._state_bytes_hook = _torch_optimizer(optimizer).register_step_post_hook(self._record_state_bytes)

    def after_resume(self, state: TrainingState) -> None:
        """`skip-batch`: the resumed run starts one optimizer step later than it stopped (a global batch is lost)."""
        if self.switches.broken("skip-batch"):
            state.step += 1

    def after_step(self, step: int, micro_batches: list[list[int]]) -> None:
        if self.trace:
            units = [unit for micro_batch in micro_batches for unit in micro_batch]
            self.trace.write(json.dumps({"step": step, "units": units}) + "\n")
            self.trace.flush()
        if self.knob_trace:
            self.knob_trace.write(json.dumps(probes.knob_record(self.knobs, step)) + "\n")
            self.knob_trace.flush()
        self.faults.after_step(step, self.model)

    def close(self) -> None:
        for trace in (self.trace, self.knob_trace):
            if trace:
                trace.close()

    def _record_state_bytes(self, *_) -> None:
        """Called by the optimizer after its step (before zero_grad): every rank steps at once (collective)."""
        self._state_bytes_hook.remove()
        self.sharding.record_state_bytes(gathered_state_bytes(self.accelerator, self.model, self.optimizer))
        if self.accelerator.is_main_process:
            self.sharding.write(self.layout.sharding_file)


def substituted(run, switches: TestSwitches):
    """The run with the parts that the switches break replaced by broken ones, so the code that trains has no switch
    for them: `mix-weights` draws the sources in equal shares, `mean-loss` lets each micro-step take its own mean,
    `mask-leak` numbers packed documents' positions straight through, `chunked-loss` drops a token from the chunked
    loss, `nf4-scales` scales every 4-bit weight's block scales by 16. The run as it is without those switches."""
    if switches.broken("mix-weights"):
        run.sampler.weights = [1.0 / len(run.sampler.weights)] * len(run.sampler.weights)
    if switches.broken("chunked-loss") and isinstance(run.loss_path, ChunkedPath):
        path = run.loss_path
        broken = _DropsLastToken(path.head, path.chunk_tokens, vocab=path.vocab)
        run.objective.loss_path = broken  # the objective reads through it (the reference was read before)
        run = dataclasses.replace(run, loss_path=broken)
    if switches.broken("mean-loss"):
        run = dataclasses.replace(run, objective=_PerMicroStepMean(run.objective))
    if switches.broken("nf4-scales"):
        _misscale_nf4(run.model, 16.0)
    if switches.broken("mask-leak"):
        collate = run.collator
        run = dataclasses.replace(run, collator=lambda sequences: collate(
            [Sequence(s.ids, s.labels, np.arange(len(s), dtype=np.int64)) for s in sequences]))
    return run


def _misscale_nf4(model, factor: float) -> None:
    """Every 4-bit weight dequantizes `factor` times too large: torchao's block scale is code / quantization_factor
    + scaler_mean (nf4_tensor.py dequantize_scalers), so both scale by `factor`. Every rank its own shards."""
    with torch.no_grad():
        for parameter in model.parameters():
            local = parameter._local_tensor if hasattr(parameter, "_local_tensor") else parameter
            if is_nf4(local):
                local.quantization_factor.div_(factor)
                local.scaler_mean.mul_(factor)


class _DropsLastToken(ChunkedPath):
    """A chunked loss that leaves out the last loss-carrying token of every micro-batch: `chunked-loss`."""

    def token_logps(self, model, batch: dict):
        logps = super().token_logps(model, batch)
        return torch.cat([logps[:-1], logps[-1:] * 0])


class _PerMicroStepMean:
    """An objective whose micro-steps each take their own mean (no global normalizer): `mean-loss`."""

    def __init__(self, objective):
        self.objective = objective

    def __getattr__(self, name: str):
        return getattr(self.objective, name)

    def __call__(self, model, batch: dict, norm):
        return self.objective(model, batch, norm)

    def norm(self, *args, **kwargs):
        return None


def _torch_optimizer(optimizer):
    """The torch optimizer inside Accelerate's wrapper, whose `step` runs only on the last micro-step
    (accelerate/optimizer.py, AcceleratedOptimizer.step checks gradient_state.sync_gradients; 1.15.0)."""
    return getattr(optimizer, "optimizer", optimizer)
