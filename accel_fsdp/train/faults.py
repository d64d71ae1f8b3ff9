"""Fault injection, so tests can prove that crashes lose nothing: a spec `<kind>:<step>[@<rank>]`, which
train/hooks.py reads from the environment once (ACCEL_FSDP_FAULT) and train/setup.py hands to the run.

Kinds:
  kill:N          SIGKILL this process right after optimizer step N (before its checkpoint, if any).
  kill-in-save:N  SIGKILL while the checkpoint of step N is being written (after the shards, before the rename).
  enospc-in-save:N  raise "No space left on device" while writing the checkpoint of step N.
  enospc-in-export:N  raise "No space left on device" while writing the final export of step N's checkpoint (after
                  its weights, before the rename).
  sigterm:N       send SIGTERM to this rank right after optimizer step N (a preemption of one rank); N 0: as the
                  rank's setup begins, after its imports and before its process group (a preemption during a start).
  sigusr1:N       the same with SIGUSR1 (SLURM's warning signal, whose default action ends a process).
  sigint:N        send SIGINT to this rank right after optimizer step N (Ctrl-C to one rank alone: `kill -INT`).
  sigusr1-launcher:N  send SIGUSR1 to the launcher (this rank's parent) after optimizer step N (SLURM's warning).
  hang:N          stop making progress after optimizer step N (sleep), as a stuck rank would.
  user-error:N    raise a UserError after optimizer step N on this rank alone (a mistake one rank finds).
  enospc:N        raise "No space left on device" after optimizer step N, naming no file (as a write() of an open
                  file raises it): a disk filled by a write the run does not guard itself.
  nan:N           write nan into one weight of this rank's shards after optimizer step N (a diverged update, a
                  flipped bit): the next step's gradients are not finite.
`@R` limits the fault to rank R (default: rank 0). Without a spec this module does nothing; it never changes results.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

from accel_fsdp.errors import Problem, UserError

KINDS = ("kill", "kill-in-save", "enospc-in-save", "enospc-in-export", "sigterm", "sigusr1", "sigint",
         "sigusr1-launcher", "hang", "user-error", "nan", "enospc")


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
            raise ValueError(f"fault {spec!r}: expected one of {', '.join(KINDS)} followed by :STEP")
        if rank == target:
            self.kind, self.step = kind, int(step)

    def after_step(self, step: int, model=None) -> None:
        if step != self.step:
            return
        if self.kind == "nan" and model is not None:
            _poison_one_weight(model, step)
        if self.kind == "kill":
            self._kill(f"after optimizer step {step}")
        elif self.kind in ("sigterm", "sigusr1", "sigint"):
            os.kill(os.getpid(), signal.Signals[self.kind.upper()])
        elif self.kind == "sigusr1-launcher":
            os.kill(os.getppid(), signal.SIGUSR1)
        elif self.kind == "hang":
            print(f"[fault] hanging after optimizer step {step}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)
        elif self.kind == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        elif self.kind == "user-error":
            raise UserError(Problem("(injected fault)", "a mistake found by one rank alone after optimizer step "
                                    f"{step}", "nothing to fix: a test fault"))

    def at_start(self) -> None:
        """Step 0 of `sigterm` and `sigusr1`: the signal as the rank's setup begins."""
        if self.kind in ("sigterm", "sigusr1"):
            self.after_step(0)

    def in_save(self, step: int) -> None:
        if step != self.step:
            return
        if self.kind == "kill-in-save":
            self._kill(f"while saving the checkpoint of step {step}")
        if self.kind == "enospc-in-save":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "(injected fault)")

    def in_export(self, step: int) -> None:
        if step == self.step and self.kind == "enospc-in-export":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write() raises it: no file name

    @staticmethod
    def _kill(when: str) -> None:
        print(f"[fault] SIGKILL {when}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _poison_one_weight(model, step: int) -> None:
    """nan into the first element of this rank's shard of its first floating-point weight that has one."""
    import torch

    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if local.numel() and local.is_floating_point():
            with torch.no_grad():
                local.view(-1)[0] = float("nan")
            print(f"[fault] nan written into {name} after optimizer step {step}", file=sys.stderr, flush=True)
            return
