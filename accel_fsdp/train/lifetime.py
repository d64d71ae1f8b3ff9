"""How a rank's life ends: with its launcher, or on a preemption signal after a checkpoint.

Ranks die with their launcher. `accelerate launch` (torchrun underneath) starts every rank in a session of its own
(torch/distributed/elastic/multiprocessing/subprocess_handler, `start_new_session=True`, checked with torch 2.13.0),
so a SIGKILL of the launcher (a CI cancel, `timeout -s KILL`, the OOM killer) would leave the ranks training. Each
rank asks the kernel for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG on Linux; a watchdog thread
elsewhere). A checkpoint is written under a temporary name and renamed last, so a rank killed mid-save leaves no
half checkpoint.

Preemption: SIGTERM or SIGUSR1 (SLURM's warning signal) to a rank or to the launcher asks the run to stop: every rank
finishes the optimizer step the signal arrived in, the run writes a checkpoint of that step, and the processes exit
with PREEMPTED (75, EX_TEMPFAIL: "resumable"). The ranks agree on that step through one all-reduce of a 4-byte CPU
flag after each optimizer step (gloo: it waits for the other ranks' hosts, never for a GPU). The launcher forwards
the signal to the ranks and waits for them (PET_SHUTDOWN_TIMEOUT), instead of torchrun's 30 seconds before SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PREEMPTED = 75
"""Exit status of a run stopped by a preemption signal after writing its checkpoint: resume it."""
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SHUTDOWN_GRACE_S = 900
"""How long the launcher waits for its ranks to checkpoint after a preemption signal before killing them."""


def die_with_launcher() -> None:
    """In a rank: be killed when the process that started this one (the launcher's agent) dies."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:  # pragma: no cover - no libc.so.6 (musl): the watchdog below still works
            _watchdog(parent)
            return
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
        return
    _watchdog(parent)  # pragma: no cover - not Linux


def _watchdog(parent: int) -> None:
    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait(1.0)

    threading.Thread(target=watch, name="accel-fsdp-parent-watchdog", daemon=True).start()


def launcher_environment(env: dict) -> dict:
    """What the launcher (torchrun's agent) needs so a preemption signal reaches the ranks and they get time to
    checkpoint: SIGUSR1 handled like SIGTERM (forwarded to the ranks), and a long grace before SIGKILL. torchrun
    reads both as options whose defaults come from PET_* variables (torch/distributed/run.py, --signals-to-handle
    and --shutdown-timeout with action=env; it then overwrites TORCHELASTIC_SIGNALS_TO_HANDLE itself, in
    torch/distributed/launcher/api.py; checked with torch 2.13.0)."""
    out = {}
    handled = env.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    if "SIGUSR1" not in handled:
        out["PET_SIGNALS_TO_HANDLE"] = handled + ",SIGUSR1"
    if "PET_SHUTDOWN_TIMEOUT" not in env and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in env:
        out["PET_SHUTDOWN_TIMEOUT"] = str(SHUTDOWN_GRACE_S)
    return out


def flag_needs_own_group(backend_config: str) -> bool:
    """The default group cannot all-reduce a CPU tensor (no CPU backend in `torch.distributed.get_backend_config()`,
    e.g. "cuda:nccl" from a launch we did not configure): the flag then needs a gloo group of its own."""
    return "cpu:" not in backend_config


class Preemption:
    """A rank's view of preemption: the signal handlers, and the agreement of all ranks on when to stop."""

    def __init__(self):
        self.signal_name: str | None = None
        self._group = None
        self._flag = None

    def install(self) -> Preemption:
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            print(f"[rank {os.environ.get('RANK', '?')}] {self.signal_name}: stopping after this optimizer step "
                  "with a checkpoint", file=sys.stderr, flush=True)

    def join_group(self, timeout=None) -> None:
        """Collective (every rank): where the flag is all-reduced. The default process group when it has a CPU
        backend, as ours always does (gloo on CPU ranks; cuda:nccl,cpu:gloo on GPUs, train/accelerator.py): a
        4-byte CPU all-reduce there is lost in the step, where a gloo group of its own (its own threads and
        sockets) measured 4-5% of a tiny model's step on 2 CPU ranks. Else a gloo group of its own, with the
        run's collective `timeout` (new_group's default is torch's 30 minutes)."""
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            own = flag_needs_own_group(dist.get_backend_config())
            self._group = dist.new_group(backend="gloo", timeout=timeout) if own else dist.group.WORLD
            self._flag = torch.zeros(1, dtype=torch.int32)

    def agreed(self) -> bool:
        """Called by every rank after every optimizer step: True on every rank after the step in which any rank got
        the signal. Blocking, so that step is the one every rank stops after: a non-blocking all-reduce read one
        step later (as this was before) stopped the run one optimizer step after the signal. It is a CPU tensor on
        the CPU backend: it waits for the other ranks' hosts to finish queueing this step, not for their GPUs, and
        the ranks meet in the step's own collectives anyway."""
        import torch.distributed as dist

        if self._group is None:
            return self.signal_name is not None
        self._flag.fill_(signal.Signals[self.signal_name].value if self.signal_name else 0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        stop = bool(self._flag.item())
        if stop and self.signal_name is None:  # another rank got it: the flag carries its number
            self.signal_name = f"{signal.Signals(int(self._flag.item())).name} to another rank"
        return stop


class Preempted(Exception):
    """Raised after the preemption checkpoint is written; the rank exits with PREEMPTED."""

    def __init__(self, step: int, checkpoint, signal_name: str):
        super().__init__(f"preempted by {signal_name} at step {step}")
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name
