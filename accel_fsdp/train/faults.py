"""Fault injection, so tests can prove that crashes lose nothing: `ACCEL_FSDP_FAULT=<kind>:<step>[@<rank>]`.

Kinds:
  kill:N          SIGKILL this process right after optimizer step N (before its checkpoint, if any).
  kill-in-save:N  SIGKILL while the checkpoint of step N is being written (after the shards, before the rename).
  enospc-in-save:N  raise "No space left on device" while writing the checkpoint of step N.
  sigterm:N       send SIGTERM to this rank right after optimizer step N (a preemption of one rank).
  sigusr1-launcher:N  send SIGUSR1 to the launcher (this rank's parent) after optimizer step N (SLURM's warning).
  hang:N          stop making progress after optimizer step N (sleep), as a stuck rank would.
`@R` limits the fault to rank R (default: rank 0). Unset, this module does nothing; it never changes results.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

ENV = "ACCEL_FSDP_FAULT"
KINDS = ("kill", "kill-in-save", "enospc-in-save", "sigterm", "sigusr1-launcher", "hang")


class Faults:
    def __init__(self, spec: str | None, rank: int):
        self.kind, self.step = None, None
        if not spec:
            return
        target = 0
        if "@" in spec:
            spec, target_text = spec.rsplit("@", 1)
            target = int(target_text)
        kind, _, step = spec.partition(":")
        if kind not in KINDS or not step.isdigit():
            raise ValueError(f"{ENV}={spec!r}: expected one of {', '.join(KINDS)} followed by :STEP")
        if rank == target:
            self.kind, self.step = kind, int(step)

    @classmethod
    def from_env(cls, rank: int) -> "Faults":
        return cls(os.environ.get(ENV), rank)

    def after_step(self, step: int) -> None:
        if step != self.step:
            return
        if self.kind == "kill":
            self._kill(f"after optimizer step {step}")
        elif self.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind == "sigusr1-launcher":
            os.kill(os.getppid(), signal.SIGUSR1)
        elif self.kind == "hang":
            print(f"[{ENV}] hanging after optimizer step {step}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)

    def in_save(self, step: int) -> None:
        if step != self.step:
            return
        if self.kind == "kill-in-save":
            self._kill(f"while saving the checkpoint of step {step}")
        if self.kind == "enospc-in-save":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "(injected by ACCEL_FSDP_FAULT)")

    @staticmethod
    def _kill(when: str) -> None:
        print(f"[{ENV}] SIGKILL {when}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


BREAK_ENV = "ACCEL_FSDP_BREAK"
BREAKS = {
    "unsharded": "CPU ranks: leave Accelerate's state as it comes (unsharded replicas), and skip the check that stops "
                 "that",
    "bf16-reduce": "reduce gradients in bf16 instead of fp32",
    "mean-loss": "normalize each micro-step's loss by its own tokens instead of the global batch's",
    "skip-batch": "skip one optimizer step's batch when resuming",
    "mask-leak": "let packed documents attend to each other (positions not restarted per document)",
    "ac-rng": "recompute checkpointed activations with new random draws (dropout)",
}
"""`ACCEL_FSDP_BREAK=<name>[,<name>]` breaks one property on purpose, so tests prove each `accel-fsdp verify` check
can fail. Unset (always, outside those tests), nothing changes."""


def broken(name: str) -> bool:
    assert name in BREAKS, name
    return name in os.environ.get(BREAK_ENV, "").split(",")
