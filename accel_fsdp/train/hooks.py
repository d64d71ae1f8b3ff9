"""What tests and `accel-fsdp verify` attach to a run, outside the loop body. Unset, none of it runs.

  ACCEL_FSDP_TRACE_ROWS=1   per rank and step, the training sequences read, in <run>/trace/ (resume tests)
  ACCEL_FSDP_FAULT=...      a crash or hang injected after an optimizer step or inside a save (faults.py)
  ACCEL_FSDP_PROBE=...      measurements of internals through model hooks (probes.py)

And one measurement for the sharding record: at the first optimizer step that really runs (gradients and
optimizer state both exist only inside it), what each rank stores, through an optimizer step hook.
"""

from __future__ import annotations

import json
import os

from accel_fsdp.train import probes
from accel_fsdp.train.faults import Faults
from accel_fsdp.train.sharding import gathered_state_bytes

TRACE_ENV = "ACCEL_FSDP_TRACE_ROWS"
"""Set to 1 to record, per rank and step, the training sequences read (in <run>/trace/); used by resume tests."""


class TestHooks:
    __test__ = False  # not a pytest class

    def __init__(self, run):
        self.run = run
        self.faults = Faults.from_env(run.accelerator.process_index)
        self.trace = None
        if os.environ.get(TRACE_ENV):
            run.layout.trace.mkdir(parents=True, exist_ok=True)
            self.trace = (run.layout.trace / f"rows-rank{run.accelerator.process_index}.jsonl").open("a")
        probes.install(run.model, run.layout.trace, run.accelerator.process_index)
        self._state_bytes_hook = _torch_optimizer(run.optimizer).register_step_post_hook(self._record_state_bytes)

    def after_step(self, step: int, micro_batches: list[list[int]]) -> None:
        if self.trace:
            self.trace.write(json.dumps({"step": step, "rows": [r for rows in micro_batches for r in rows]}) + "\n")
            self.trace.flush()
        self.faults.after_step(step)

    def close(self) -> None:
        if self.trace:
            self.trace.close()

    def _record_state_bytes(self, *_) -> None:
        """Called by the optimizer after its step (before zero_grad): every rank steps at once (collective)."""
        self._state_bytes_hook.remove()
        run = self.run
        run.sharding.state_bytes = gathered_state_bytes(run.accelerator, run.model, run.optimizer)
        if run.accelerator.is_main_process:
            run.sharding.write(run.layout.sharding_file)


def _torch_optimizer(optimizer):
    """The torch optimizer inside Accelerate's wrapper, whose `step` runs only on the last micro-step
    (accelerate/optimizer.py, AcceleratedOptimizer.step checks gradient_state.sync_gradients; 1.15.0)."""
    return getattr(optimizer, "optimizer", optimizer)
